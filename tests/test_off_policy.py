"""Off-policy corrections (megatron_rl/algorithms/policy_loss.py) on hand-computed tokens.

Run: `.venv/bin/python -m pytest tests/test_off_policy.py -q`
"""

import math

import pytest
import torch

from megatron_rl.algorithms.policy_loss import behaviour_weights, off_policy_ratio_loss
from megatron_rl.algorithms.policy_loss import policy_ratio_loss

CLIP = dict(eps_low=0.2, eps_high=0.2)


def logs(*values):
    return torch.tensor([[math.log(v) for v in values]], dtype=torch.float64)


# One row of four tokens. pi_old / pi_behav = 1, 1.5, 3, 0.5 and pi_theta / pi_old = 1.1, 1.3, 0.9, 1.0.
BEHAV = logs(1.0, 1.0, 1.0, 1.0)
OLD = logs(1.0, 1.5, 3.0, 0.5)
RATIO = (1.1, 1.3, 0.9, 1.0)
MASK = torch.ones(1, 4, dtype=torch.float64)


def current():
    return (OLD + logs(*RATIO)).requires_grad_(True)


@pytest.mark.parametrize("correction, advantage, expected_loss, expected_grad", [
    # A = +1: -min(r, clip(r, 0.8, 1.2)) = -1.1, -1.2 (clipped, no gradient), -0.9, -1.0, times w.
    # TIS, C = 2: w = 1, 1.5, min(3, 2) = 2, 0.5
    ("truncated_is", 1.0, [-1.1, -1.8, -1.8, -0.5], [-1.1, 0.0, -1.8, -0.5]),
    # decoupled, C = 2: w = 1, 1.5, 0 (3 > C: left out), 0.5
    ("decoupled", 1.0, [-1.1, -1.8, 0.0, -0.5], [-1.1, 0.0, 0.0, -0.5]),
    # A = -1: -min(-r, -clip(r)) = max(r, clip(r)) = 1.1, 1.3, 0.9, 1.0; gradient r * w on all of them
    ("truncated_is", -1.0, [1.1, 1.95, 1.8, 0.5], [1.1, 1.95, 1.8, 0.5]),
    ("none", 1.0, [-1.1, -1.2, -0.9, -1.0], [-1.1, 0.0, -0.9, -1.0]),
])
def test_hand_cases(correction, advantage, expected_loss, expected_grad):
    logp = current()
    loss, stats = off_policy_ratio_loss(logp, OLD, BEHAV, torch.tensor([advantage], dtype=torch.float64), MASK,
                                        correction=correction, cap=2.0, **CLIP)
    assert torch.allclose(loss, torch.tensor([expected_loss], dtype=torch.float64), atol=1e-12)
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([expected_grad], dtype=torch.float64), atol=1e-12)
    # the weight statistics are of the raw ratio pi_old / pi_behav: mean (1 + 1.5 + 3 + 0.5) / 4, max 3
    assert stats["behav_weight_mean"].item() == pytest.approx(1.5)
    assert stats["behav_weight_max"].item() == pytest.approx(3.0)
    assert stats["behav_capped_fraction"].item() == (0.0 if correction == "none" else 0.25)
    assert stats["clip_fraction"].item() == pytest.approx(0.25 if advantage > 0 else 0.0)


def test_decoupled_is_areals_objective_in_probabilities():
    """AReaL eq. 5 written with probabilities, independently: J = pi_prox / pi_behav * min(u A, clip(u) A)."""
    gen = torch.Generator().manual_seed(0)
    p_behav, p_prox, p_theta = (torch.rand(3, 5, generator=gen, dtype=torch.float64) * 0.9 + 0.05 for _ in range(3))
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    loss, _ = off_policy_ratio_loss(p_theta.log(), p_prox.log(), p_behav.log(), advantages, torch.ones(3, 5),
                                    correction="decoupled", cap=1e9, **CLIP)
    u, a = p_theta / p_prox, advantages[:, None]
    objective = p_prox / p_behav * torch.minimum(u * a, u.clamp(0.8, 1.2) * a)
    assert torch.allclose(-loss, objective, atol=1e-12)


@pytest.mark.parametrize("correction", ["truncated_is", "decoupled"])
def test_on_policy_samples_reduce_exactly_to_the_clipped_loss(correction):
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 6, generator=gen) * 3
    logp = (old + 0.3 * torch.randn(4, 6, generator=gen)).requires_grad_(True)
    advantages, mask = torch.randn(4, generator=gen), (torch.rand(4, 6, generator=gen) > 0.3).float()
    plain, plain_stats = policy_ratio_loss(logp, old, advantages, mask, dual_clip=3.0, **CLIP)
    corrected, stats = off_policy_ratio_loss(logp, old, old.clone(), advantages, mask, correction=correction,
                                             cap=2.0, dual_clip=3.0, **CLIP)
    assert torch.equal(plain, corrected)
    (g_plain,) = torch.autograd.grad(plain.sum(), logp)
    (g_corrected,) = torch.autograd.grad(corrected.sum(), logp)
    assert torch.equal(g_plain, g_corrected)
    assert stats["behav_weight_max"].item() == 1.0 and stats["behav_capped_fraction"].item() == 0.0
    assert all(torch.equal(plain_stats[k], stats[k]) for k in plain_stats)


def test_the_weight_is_detached_and_masked_tokens_do_not_count():
    old = logs(1.0, 4.0).requires_grad_(True)
    behav = logs(1.0, 1.0).requires_grad_(True)
    weights, stats = behaviour_weights(old, behav, torch.tensor([[1.0, 0.0]]), correction="truncated_is", cap=2.0)
    assert not weights.requires_grad and weights.tolist() == [[1.0, 2.0]]
    assert stats["behav_weight_max"].item() == 1.0 and stats["behav_capped_fraction"].item() == 0.0


def test_the_cap_is_truncation_for_tis_and_exclusion_for_decoupled_at_the_boundary():
    old, behav = logs(2.0, 2.0000001), logs(1.0, 1.0)
    tis, _ = behaviour_weights(old, behav, torch.ones(1, 2), correction="truncated_is", cap=2.0)
    decoupled, _ = behaviour_weights(old, behav, torch.ones(1, 2), correction="decoupled", cap=2.0)
    assert tis[0].tolist() == pytest.approx([2.0, 2.0]) and decoupled[0].tolist() == pytest.approx([2.0, 0.0])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="cap must be >= 1"):
        behaviour_weights(OLD, BEHAV, MASK, correction="truncated_is", cap=0.5)
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        behaviour_weights(OLD, BEHAV, MASK, correction="tis", cap=2.0)
    with pytest.raises(ValueError, match="does not match"):
        behaviour_weights(OLD, BEHAV[:, :2], MASK, correction="truncated_is", cap=2.0)


@pytest.mark.parametrize("correction, expected", [
    # token-mean of the hand cases above (A = +1): decoupled (-1.1 - 1.8 + 0 - 0.5) / 4, TIS (-1.1 - 1.8 - 1.8 - 0.5) / 4
    ("decoupled", -3.4 / 4), ("truncated_is", -5.2 / 4), ("none", -4.2 / 4)])
def test_the_grpo_loss_applies_the_correction_the_config_names(correction, expected):
    """The loss the trainer steps with (grpo_loss, as make_grpo_loss calls it with the batch's behav_logp) is the
    hand-computed per-token loss of the correction, aggregated; its behav_* stats are those of the weights."""
    from megatron_rl.algorithms.policy_loss import GRPOLossConfig, grpo_loss

    config = GRPOLossConfig(eps_low=0.2, eps_high=0.2, kl_coef=0.0, kl_kind="k3", loss_agg_mode="token-mean",
                            off_policy_correction=correction, is_cap=2.0)
    loss, metrics = grpo_loss(current(), OLD, torch.ones(1, dtype=torch.float64), MASK, config=config,
                              behav_logp=BEHAV)
    assert float(loss) == pytest.approx(expected, abs=1e-9)
    if correction != "none":
        assert float(metrics["behav_weight_mean"]) == pytest.approx((1 + 1.5 + 3 + 0.5) / 4)
        assert float(metrics["behav_capped_fraction"]) == pytest.approx(0.25)
        with pytest.raises(ValueError, match="needs behav_logp"):
            grpo_loss(current(), OLD, torch.ones(1, dtype=torch.float64), MASK, config=config)
