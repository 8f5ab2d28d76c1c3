"""GRPO advantages and loss against published and hand-computed numbers.

Run: `.venv/bin/python -m pytest tests/test_grpo_math.py -q`
"""

import math

import pytest
import torch

from megatron_rl.spec.config.schema import AlgorithmConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.algorithms.advantages import expand_group_mask, group_advantages, groups_with_signal
from megatron_rl.algorithms.policy_loss import (
    GRPOLossConfig,
    aggregate,
    cispo_loss,
    grpo_loss,
    kl_penalty,
    local_normalisers,
    policy_ratio_loss,
    sequence_log_ratio,
)
from megatron_rl.rl.loss import make_grpo_loss
from megatron_rl.rollout.batch import RolloutBatch


def t(values):
    return torch.tensor(values, dtype=torch.float32)


def loss_config(max_response_len: int = 4, **algorithm) -> GRPOLossConfig:
    """The loss the trainer builds from an ``algorithm:`` section (schema defaults for what is not given)."""
    return GRPOLossConfig.from_algorithm(AlgorithmConfig(**algorithm), max_response_len=max_response_len)


# ---------------------------------------------------------------- advantages


def test_published_advantages_use_sample_std():
    # NeMo RL case: group [2, 2] is flat -> 0; group [1, 3]: mean 2, sample std sqrt(2) -> -1/sqrt(2), +1/sqrt(2).
    adv = group_advantages(t([2, 2, 1, 3]), group_size=2)
    torch.testing.assert_close(adv, t([0, 0, -0.7071, 0.7071]), atol=1e-4, rtol=0)


def test_all_equal_group_is_exactly_zero():
    adv = group_advantages(t([5, 5, 5, 5]), group_size=4)
    assert torch.equal(adv, torch.zeros(4))
    adv = group_advantages(t([5, 5, 5, 5]), group_size=4, normalize_std=False)
    assert torch.equal(adv, torch.zeros(4))


def test_three_member_group_is_symmetric():
    # [0, 2, 4]: mean 2, sample std 2 -> [-1, 0, 1] (up to eps).
    adv = group_advantages(t([0, 2, 4]), group_size=3)
    torch.testing.assert_close(adv, t([-1, 0, 1]), atol=1e-5, rtol=0)


def test_dr_grpo_mean_only():
    adv = group_advantages(t([1, 3, 0, 0, 1, 1]), group_size=2, normalize_std=False)
    assert adv.tolist() == [-1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_groups_with_signal_for_dynamic_sampling():
    rewards = t([1, 1, 0, 1, 0, 0])
    keep = groups_with_signal(rewards, group_size=2)
    assert keep.tolist() == [False, True, False]
    assert expand_group_mask(keep, 2).tolist() == [False, False, True, True, False, False]
    assert rewards[expand_group_mask(keep, 2)].tolist() == [0.0, 1.0]


def test_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(t([1, 2, 3]), group_size=4)


# ---------------------------------------------------------------- clipped policy loss


def test_published_clipped_loss_token_mean():
    # NeMo RL case: ratios [0.5, 1, 1.5], clipped [0.8, 1, 1.2]; min(rA, clip(r)A) = [0.5, -1, 2.4] -> mean 0.6333.
    logp = t([[-1.69315, -1.0, -0.59453]])
    old = t([[-1.0, -1.0, -1.0]])
    adv = t([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    per_token, stats = policy_ratio_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    loss = aggregate(per_token, mask, "token-mean")
    assert loss.item() == pytest.approx(-0.6333, abs=1e-4)
    torch.testing.assert_close(per_token, t([[-0.5, 1.0, -2.4]]), atol=1e-4, rtol=0)
    assert stats["ratio_min"].item() == pytest.approx(0.5, abs=1e-4)
    assert stats["ratio_max"].item() == pytest.approx(1.5, abs=1e-4)
    # Only token 3 takes the clipped branch (token 1 has A > 0 and r < 1 - eps: the unclipped term is smaller).
    assert stats["clip_fraction"].item() == pytest.approx(1 / 3)


def test_clip_higher_is_asymmetric():
    # A = +1 at ratio 1.25: eps_high 0.28 leaves it unclipped (loss -1.25, grad -1.25); eps_high 0.2 clips (grad 0).
    old = t([[0.0]])
    mask = torch.ones(1, 1)
    for eps_high, want_loss, want_grad in [(0.28, -1.25, -1.25), (0.2, -1.2, 0.0)]:
        logp = t([[math.log(1.25)]]).requires_grad_()
        per_token, _ = policy_ratio_loss(logp, old, t([1.0]), mask, eps_low=0.2, eps_high=eps_high)
        per_token.sum().backward()
        assert per_token.item() == pytest.approx(want_loss, abs=1e-6)
        assert logp.grad.item() == pytest.approx(want_grad, abs=1e-6)
    # A = -1 at ratio 0.75 is governed by eps_low only: clipped at 0.8 whatever eps_high is.
    logp = t([[math.log(0.75)]])
    per_token, stats = policy_ratio_loss(logp, old, t([-1.0]), mask, eps_low=0.2, eps_high=0.28)
    assert per_token.item() == pytest.approx(0.8, abs=1e-6)
    assert stats["clip_fraction"].item() == 1.0


def test_dual_clip_caps_negative_advantages():
    # A = -1 at ratio 5: plain loss max(5, 1.2) = 5 with grad 5; dual clip c = 3 caps it at 3 with grad 0.
    old = t([[0.0]])
    mask = torch.ones(1, 1)
    logp = t([[math.log(5.0)]]).requires_grad_()
    plain, _ = policy_ratio_loss(logp, old, t([-1.0]), mask, eps_low=0.2, eps_high=0.2)
    plain.sum().backward()
    assert plain.item() == pytest.approx(5.0, abs=1e-5)
    assert logp.grad.item() == pytest.approx(5.0, abs=1e-5)
    logp.grad = None
    capped, stats = policy_ratio_loss(logp, old, t([-1.0]), mask, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    capped.sum().backward()
    assert capped.item() == pytest.approx(3.0)
    assert logp.grad.item() == 0.0
    assert stats["dual_clip_fraction"].item() == 1.0
    # Positive advantages are untouched by dual clip: max(-5, -1.2) = -1.2.
    pos, stats = policy_ratio_loss(logp.detach(), old, t([1.0]), mask, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    assert pos.item() == pytest.approx(-1.2, abs=1e-6)
    assert stats["dual_clip_fraction"].item() == 0.0


def test_stats_ignore_padding():
    logp = t([[0.0, 5.0]])  # the padded token has ratio e^5, which must not show in ratio_max
    old = t([[0.0, 0.0]])
    mask = t([[1, 0]])
    _, stats = policy_ratio_loss(logp, old, t([1.0]), mask, eps_low=0.2, eps_high=0.2)
    assert stats["ratio_max"].item() == 1.0
    assert stats["clip_fraction"].item() == 0.0


# ---------------------------------------------------------------- KL


def test_published_kl_estimators_before_clamp():
    logp = t([-1.0, -1.0, -1.0])
    ref = t([0.0, -15.0, -30.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), t([-1, 14, 29]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), t([0.5, 98, 420.5]))
    # k3 = exp(ref - logp) - (ref - logp) - 1: e - 2 = 0.7183, e^-14 + 13, e^-29 + 28.
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), t([0.7183, 13, 28]), atol=1e-4, rtol=0)


def test_kl_clamps():
    logp = t([-1.0, -1.0, -1.0])
    ref = t([0.0, -15.0, -30.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k3", clamp=10.0), t([0.7183, 10, 10]), atol=1e-4, rtol=0)
    # log-ratio clamp 20: the third token's log ratio 29 becomes 20 -> k3 = e^-20 + 19.
    torch.testing.assert_close(
        kl_penalty(logp, ref, "k3", log_ratio_clamp=20.0), t([0.7183, 13, 19]), atol=1e-4, rtol=0
    )


# ---------------------------------------------------------------- aggregation


RAGGED_LOSS = t([[1, 2, 3, 100], [4, 100, 100, 100], [5, 6, 100, 100], [100, 100, 100, 100]])
RAGGED_MASK = t([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])  # lengths 3, 1, 2 and an empty row


def test_aggregations_on_ragged_batch_by_hand():
    # token-mean: (1+2+3+4+5+6) / 6 tokens = 21/6 = 3.5.
    assert aggregate(RAGGED_LOSS, RAGGED_MASK, "token-mean").item() == pytest.approx(3.5)
    # seq-mean-token-mean: per-sequence means 6/3=2, 4/1=4, 11/2=5.5; mean over the 3 non-empty rows = 11.5/3.
    assert aggregate(RAGGED_LOSS, RAGGED_MASK, "seq-mean-token-mean").item() == pytest.approx(11.5 / 3)
    # seq-mean-token-sum-norm with max_response_len 4: 21 / (3 sequences * 4) = 1.75.
    got = aggregate(RAGGED_LOSS, RAGGED_MASK, "seq-mean-token-sum-norm", max_response_len=4)
    assert got.item() == pytest.approx(1.75)
    # The constant normaliser does not move with the padded width: max_response_len 10 -> 21/30.
    got = aggregate(RAGGED_LOSS, RAGGED_MASK, "seq-mean-token-sum-norm", max_response_len=10)
    assert got.item() == pytest.approx(0.7)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_sharded_aggregation_sums_to_whole_batch(mode):
    whole = aggregate(RAGGED_LOSS, RAGGED_MASK, mode, max_response_len=4)
    shards = [(RAGGED_LOSS[:2], RAGGED_MASK[:2]), (RAGGED_LOSS[2:], RAGGED_MASK[2:])]
    counts = [local_normalisers(m) for _, m in shards]
    global_tokens = sum(c[0] for c in counts)
    global_seqs = sum(c[1] for c in counts)
    assert (global_tokens.item(), global_seqs.item()) == (6.0, 3.0)
    parts = [
        aggregate(loss, m, mode, max_response_len=4, global_num_tokens=global_tokens, global_num_seqs=global_seqs)
        for loss, m in shards
    ]
    assert sum(parts).item() == pytest.approx(whole.item())


# Context parallelism cuts every row along T: CP rank 0 holds positions {0, 3}, rank 1 holds {1, 2}.
CP_PARTS = ([0, 3], [1, 2])


def test_sequence_parts_with_whole_lengths_by_hand():
    """seq-mean-token-mean of part of each row divides by the WHOLE row's length (given as seq_lengths)."""
    lengths = RAGGED_MASK.sum(-1)  # 3, 1, 2, 0
    part = RAGGED_LOSS[:, [1, 2]], RAGGED_MASK[:, [1, 2]]  # rank 1: tokens 2, 3 of row 0; 6 of row 2
    # row means of the part: (2+3)/3, 0/1, 6/2; counted rows: 3 (the empty row has whole length 0)
    got = aggregate(*part, "seq-mean-token-mean", seq_lengths=lengths)
    assert got.item() == pytest.approx((5 / 3 + 0 + 3) / 3)
    # without them the part's own lengths would be used: (5/2 + 6/1) / 2 sequences
    assert aggregate(*part, "seq-mean-token-mean").item() == pytest.approx((2.5 + 6) / 2)
    # token-mean of a part: its sum over the whole token count 6
    assert aggregate(*part, "token-mean", seq_lengths=lengths).item() == pytest.approx(11 / 6)
    assert local_normalisers(part[1], lengths) == (3.0, 3.0)  # own tokens, whole sequences
    with pytest.raises(ValueError, match="seq_lengths shape"):
        aggregate(*part, "token-mean", seq_lengths=lengths[:2])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_context_parallel_parts_sum_to_whole_rows(mode):
    """The parts of every row, each aggregated with the whole rows' lengths, sum to the whole-row loss; and so
    does the full GRPO loss (the Megatron adapter all-reduces the lengths over the CP group to get them)."""
    lengths = RAGGED_MASK.sum(-1)
    whole = aggregate(RAGGED_LOSS, RAGGED_MASK, mode, max_response_len=4)
    parts = [aggregate(RAGGED_LOSS[:, cols], RAGGED_MASK[:, cols], mode, max_response_len=4, seq_lengths=lengths)
             for cols in CP_PARTS]
    assert sum(parts).item() == pytest.approx(whole.item())

    gen = torch.Generator().manual_seed(3)
    logp, old, ref = (torch.randn(4, 4, generator=gen) * 0.3 - 1.0 for _ in range(3))
    adv = t([1.0, -2.0, 0.5, 1.5])
    cfg = loss_config(kl_coef=0.1, loss_aggregation=mode, max_response_len=4)
    expected, _ = grpo_loss(logp, old, adv, RAGGED_MASK, config=cfg, ref_logp=ref)
    got = sum(grpo_loss(logp[:, c], old[:, c], adv, RAGGED_MASK[:, c], config=cfg, ref_logp=ref[:, c],
                        seq_lengths=lengths)[0] for c in CP_PARTS)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


# ---------------------------------------------------------------- combined loss


def test_grpo_loss_combines_pg_and_kl():
    logp = t([[-1.69315, -1.0, -0.59453]])
    old = t([[-1.0, -1.0, -1.0]])
    ref = logp - t([[0.5, 0.0, -0.5]])  # log ratios to the reference 0.5, 0, -0.5: k2 = [0.125, 0, 0.125]
    adv = t([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    cfg = loss_config(kl_coef=0.1, kl_estimator="k2", loss_aggregation="token-mean")
    loss, metrics = grpo_loss(logp, old, adv, mask, config=cfg, ref_logp=ref, entropy=t([[1.0, 2.0, 3.0]]))
    # -0.63333 + 0.1 * (0.25 / 3) = -0.625
    assert loss.item() == pytest.approx(-0.625, abs=1e-4)
    assert metrics["pg_loss"].item() == pytest.approx(-0.6333, abs=1e-4)
    assert metrics["kl"].item() == pytest.approx(0.25 / 3, abs=1e-5)
    assert metrics["entropy"].item() == pytest.approx(2.0)
    assert metrics["num_tokens"].item() == 3.0
    assert set(metrics) >= {"clip_fraction", "ratio_min", "ratio_max", "kl", "pg_loss", "entropy"}


def test_kl_coef_zero_needs_no_reference():
    logp = t([[-1.0, -2.0]])
    loss, metrics = grpo_loss(logp, logp, t([1.0]), torch.ones(1, 2), config=loss_config(kl_coef=0.0))
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["kl"].item() == 0.0
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, logp, t([1.0]), torch.ones(1, 2), config=loss_config(kl_coef=0.01))


def test_on_policy_gradient_is_the_plain_policy_gradient():
    # ratio 1 everywhere (first mini-batch): d loss / d logp_t = -A_i / |o_i| / num_seqs for seq-mean-token-mean.
    # Sequence 0 (A=1, 2 tokens): -1/2/2 = -0.25 per token; sequence 1 (A=-2, 1 token): 2/1/2 = 1.0.
    logp = t([[-0.3, -0.7], [-1.1, -9.0]]).requires_grad_()
    mask = t([[1, 1], [1, 0]])
    loss, metrics = grpo_loss(logp, logp.detach(), t([1.0, -2.0]), mask,
                              config=loss_config(kl_coef=0.0, loss_aggregation="seq-mean-token-mean"))
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-0.25, -0.25], [1.0, 0.0]]))
    assert metrics["ratio_min"].item() == metrics["ratio_max"].item() == 1.0
    assert metrics["clip_fraction"].item() == 0.0


def test_the_schema_is_the_one_source_of_defaults_and_checks():
    assert loss_config().loss_agg_mode == AlgorithmConfig().loss_aggregation == "token-mean"
    assert loss_config().kl_kind == AlgorithmConfig().kl_estimator
    for bad, key in ((dict(loss_aggregation="sum"), "algorithm.loss_aggregation"),
                     (dict(dual_clip=0.5), "algorithm.dual_clip"), (dict(kl_estimator="k4"), "algorithm.kl_estimator"),
                     (dict(clip_eps_low=1.0), "algorithm.clip_eps_low")):
        with pytest.raises(ConfigError, match=key):
            loss_config(**bad)
    with pytest.raises(ValueError, match="max_response_len"):
        GRPOLossConfig(eps_low=0.2, eps_high=0.2, kl_coef=0.0, kl_kind="k3", loss_agg_mode="seq-mean-token-sum-norm")


# ---------------------------------------------------------------- GSPO: the sequence-level ratio


def test_gspo_ratio_is_the_length_normalised_sequence_ratio_by_hand():
    logp = t([[0.1, 0.3, 5.0], [0.4, 0.0, 0.0]]).requires_grad_(True)
    old = torch.zeros(2, 3)
    mask = t([[1, 1, 0], [1, 0, 0]])  # the 5.0 is padding: it must not count
    log_ratio = sequence_log_ratio(logp, old, mask)
    assert torch.allclose(log_ratio, t([[0.2, 0.2, 0.2], [0.4, 0.4, 0.4]]))
    per_token, stats = policy_ratio_loss(logp, old, t([-1.0, -1.0]), mask, eps_low=0.2, eps_high=0.2,
                                         log_ratio=log_ratio)
    # A < 0 and s > 1: the unclipped branch -A s is the larger; every token carries its sequence's value
    assert torch.allclose(per_token[0, :2], torch.full((2,), math.exp(0.2)))
    assert stats["clip_fraction"] == 0.0
    loss = aggregate(per_token, mask, "seq-mean-token-mean")
    assert loss.item() == pytest.approx((math.exp(0.2) + math.exp(0.4)) / 2)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/d logp_t of mean_i s_i = s_i / len_i / 2 on the masked tokens, 0 on padding
    expected = t([[math.exp(0.2) / 2 / 2, math.exp(0.2) / 2 / 2, 0.0], [math.exp(0.4) / 2, 0.0, 0.0]])
    assert torch.allclose(grad, expected, atol=1e-6)


def test_gspo_clips_whole_sequences():
    logp = t([[0.1, 0.3]]).requires_grad_(True)  # s = e^0.2 = 1.221 > 1 + 0.2
    per_token, stats = policy_ratio_loss(logp, torch.zeros(1, 2), t([1.0]), torch.ones(1, 2), eps_low=0.2,
                                         eps_high=0.2, log_ratio=sequence_log_ratio(logp, torch.zeros(1, 2),
                                                                                    torch.ones(1, 2)))
    assert torch.allclose(per_token, t([[-1.2, -1.2]]))
    assert stats["clip_fraction"] == 1.0  # both tokens, although the second alone (e^0.3) and the first
    (grad,) = torch.autograd.grad(per_token.sum(), logp)  # (e^0.1 < 1.2) would clip differently per token
    assert torch.equal(grad, torch.zeros(1, 2))


def test_gspo_equals_the_token_ratio_on_one_token_sequences():
    logp, old, adv = t([[0.05], [-0.4]]), t([[0.0], [0.1]]), t([1.0, -2.0])
    mask = torch.ones(2, 1)
    token = grpo_loss(logp, old, adv, mask, config=loss_config(kl_coef=0.0))[0]
    sequence = grpo_loss(logp, old, adv, mask, config=loss_config(kl_coef=0.0, importance_ratio="sequence"))[0]
    assert float(token) == pytest.approx(float(sequence))


# ---------------------------------------------------------------- CISPO: the clipped ratio as a detached weight


def test_cispo_loss_and_gradient_by_hand():
    # ratios [0.5, 1.25, 1.5] against old log-probs log 0.4; eps_low 0.2, eps_high 0.28: weights [0.8, 1.25, 1.28].
    old = t([[math.log(0.4)] * 3])
    logp = (old + t([[math.log(0.5), math.log(1.25), math.log(1.5)]])).requires_grad_(True)
    adv = t([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    per_token, stats = cispo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    weights = [0.8, 1.25, 1.28]
    logp_values = [math.log(0.2), math.log(0.5), math.log(0.6)]
    want = [-w * a * lp for w, a, lp in zip(weights, [1.0, -1.0, 2.0], logp_values)]
    torch.testing.assert_close(per_token, t([want]), atol=1e-6, rtol=0)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3)  # tokens 1 and 3 were clipped...
    (grad,) = torch.autograd.grad(aggregate(per_token, mask, "token-mean"), logp)
    # ...and every token's gradient is -w A / 3
    torch.testing.assert_close(grad, t([[-0.8 / 3, 1.25 / 3, -2.56 / 3]]), atol=1e-6, rtol=0)
    # the clipped surrogate: token 1 takes the unclipped branch (-r A / 3), token 3 the clipped one (no gradient)
    clipped = policy_ratio_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)[0]
    (clip_grad,) = torch.autograd.grad(aggregate(clipped, mask, "token-mean"), logp)
    torch.testing.assert_close(clip_grad, t([[-0.5 / 3, 1.25 / 3, 0.0]]), atol=1e-6, rtol=0)


def test_cispo_without_a_lower_bound_and_on_policy():
    # clip_eps_low 1 (MiniMax-M1): a ratio of 0.01 keeps its weight; on-policy (r = 1) the gradient is the plain
    # policy gradient -A / n, the same as the clipped surrogate's
    logp = t([[math.log(0.01), -0.7]]).requires_grad_(True)
    old = t([[0.0, -0.7]])
    per_token, stats = cispo_loss(logp, old, t([1.0]), torch.ones(1, 2), eps_low=1.0, eps_high=0.28)
    assert per_token[0, 0].item() == pytest.approx(-0.01 * math.log(0.01), rel=1e-5)
    assert stats["clip_fraction"].item() == 0.0
    logp = t([[-0.3, -0.7], [-1.1, -9.0]]).requires_grad_()
    mask = t([[1, 1], [1, 0]])
    for policy_loss in ("clip", "cispo"):
        loss, _ = grpo_loss(logp, logp.detach(), t([1.0, -2.0]), mask,
                            config=loss_config(kl_coef=0.0, loss_aggregation="seq-mean-token-mean",
                                               policy_loss=policy_loss, clip_eps_low=0.2))
        (grad,) = torch.autograd.grad(loss, logp)
        torch.testing.assert_close(grad, t([[-0.25, -0.25], [1.0, 0.0]]))


def test_cispo_in_grpo_loss_with_the_sequence_ratio_and_off_policy_weights():
    logp = t([[0.1, 0.3], [-0.2, 0.0]]).requires_grad_(True)
    old, behav = torch.zeros(2, 2), t([[0.0, 0.0], [math.log(0.5), 0.0]])
    adv, mask = t([1.0, -1.0]), t([[1, 1], [1, 0]])
    config = loss_config(kl_coef=0.0, policy_loss="cispo", importance_ratio="sequence", clip_eps_low=1.0,
                         clip_eps_high=0.2, off_policy_correction="truncated_is", is_cap=1.5,
                         loss_aggregation="token-mean")
    loss, metrics = grpo_loss(logp, old, adv, mask, config=config, behav_logp=behav)
    # sequence ratios e^0.2 (clipped to 1.2) and e^-0.2; behaviour weights pi_old / pi_behav: 1, 1, min(2, 1.5), 1
    w = [[1.2, 1.2], [math.exp(-0.2) * 1.5, 0.0]]
    want = -(w[0][0] * 0.1 + w[0][1] * 0.3) + w[1][0] * -0.2
    assert loss.item() == pytest.approx(want / 3, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, t([[-1.2 / 3, -1.2 / 3], [w[1][0] / 3, 0.0]]), atol=1e-6, rtol=0)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 3)


def test_cispo_config_checks():
    assert loss_config(policy_loss="cispo", clip_eps_low=1.0).policy_loss == "cispo"
    for bad, key in ((dict(policy_loss="ppo"), "algorithm.policy_loss=.*clip, cispo"),
                     (dict(policy_loss="cispo", dual_clip=3.0), "algorithm.dual_clip"),
                     (dict(policy_loss="clip", clip_eps_low=1.0), "algorithm.clip_eps_low")):
        with pytest.raises(ConfigError, match=key):
            loss_config(**bad)


# ---------------------------------------------------------------- the trainer's Megatron loss function


def rollout_batch(*, labels: torch.Tensor, **entries) -> RolloutBatch:
    """A padded micro-batch of these entries (its inputs, positions and row ids made up: the loss reads none)."""
    rows, width = labels.shape
    return RolloutBatch(tokens=labels, labels=labels, position_ids=torch.arange(width).expand(rows, -1),
                        row_ids=torch.arange(rows), **entries)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_trainer_loss_function_is_grpo_loss_on_logits(tensor_parallel_group, mode):
    """make_grpo_loss (what Engine.train_step runs) on logits = grpo_loss on log_softmax of the same logits,
    as (sum, denominator): the per-micro-batch share Megatron sums and divides over the global batch."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 4), generator=gen)
    mask = t([[0, 1, 1, 1], [0, 0, 1, 0], [0, 1, 1, 0]])
    old = torch.randn(3, 4, generator=gen) * 0.1 - 2.0
    ref = torch.randn(3, 4, generator=gen) * 0.1 - 2.0
    adv = t([1.0, -0.5, 2.0])
    cfg = loss_config(kl_coef=0.05, loss_aggregation=mode, max_response_len=4)
    batch = rollout_batch(labels=labels, loss_mask=mask, behav_logp=old, ref_logp=ref, advantages=adv)
    loss_sum, denominator, reports = make_grpo_loss(cfg)(logits.clone().requires_grad_(), batch)

    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    expected, metrics = grpo_loss(logp, old, adv, mask, config=cfg, ref_logp=ref)
    expected_denominator = 6 if mode == "token-mean" else 3
    assert int(denominator) == expected_denominator
    assert (loss_sum / denominator).item() == pytest.approx(expected.item(), rel=1e-5)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    total, count = reports["entropy"]
    assert (total / count).item() == pytest.approx(((entropy * mask).sum() / mask.sum()).item(), rel=1e-5)
    assert (reports["kl"][0] / reports["kl"][1]).item() == pytest.approx(metrics["kl"].item(), rel=1e-5)
    assert reports["ratio_max"][0].item() == pytest.approx(metrics["ratio_max"].item())
    loss_sum.backward()  # differentiable through Megatron's vocab-parallel cross entropy


def test_trainer_loss_without_reference_reports_zero_kl(tensor_parallel_group):
    logits = torch.zeros(1, 2, 5)
    batch = rollout_batch(labels=torch.tensor([[1, 2]]), loss_mask=torch.ones(1, 2),
                          behav_logp=torch.full((1, 2), -math.log(5)), advantages=t([1.0]))
    loss_sum, denominator, reports = make_grpo_loss(loss_config(kl_coef=0.0))(logits, batch)
    assert (loss_sum / denominator).item() == pytest.approx(-1.0)  # ratio 1, A = 1: -A
    assert reports["kl"][0].item() == 0.0
    assert (reports["entropy"][0] / reports["entropy"][1]).item() == pytest.approx(math.log(5))
    with pytest.raises(ValueError, match="ref_logp"):
        make_grpo_loss(loss_config(kl_coef=0.1))(logits, batch)


# ---------------------------------------------------------------- end to end on the synthetic task


# ---------------------------------------------------------------- rollout batches (DAPO's selection and masking)


def _rollout():
    from megatron_rl.rollout.batch import Rollout

    return Rollout(prompt_ids=[[1, 2], [1, 2], [3], [3]], response_ids=[[5, 6], [7], [8, 9, 9], [4]],
                   logprobs=[[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6], [-0.7]], prompts=["a", "a", "b", "b"],
                   completions=["x", "y", "z", "w"], answers=[1, 1, 2, 2], truncated=[False, False, True, False],
                   rewards=t([1.0, 0.0, 0.5, 0.5]), per_fn={"exact": [1.0, 0.0, 0.5, 0.5]},
                   advantages=t([0.7, -0.7, 0.0, 0.0]))


def test_selected_and_concatenated_rollouts_keep_rows_aligned():
    from megatron_rl.rollout.batch import Rollout

    whole = _rollout()
    picked = Rollout.concat([whole.select([2, 3]), whole.select([0])])
    assert picked.response_ids == [[8, 9, 9], [4], [5, 6]] and picked.truncated == [True, False, False]
    assert picked.answers == [2, 2, 1] and picked.per_fn == {"exact": [0.5, 0.5, 1.0]}
    assert torch.equal(picked.rewards, t([0.5, 0.5, 1.0])) and torch.equal(picked.advantages, t([0.0, 0.0, 0.7]))
    assert picked.logprobs[0] == [-0.4, -0.5, -0.6]


def test_truncated_completions_stay_in_the_batch_but_out_of_the_loss():
    from megatron_rl.rollout.batch import collate_rollout, rollout_rows

    rollout = _rollout()
    masked = collate_rollout(rollout_rows(rollout, mask_truncated=True), seq_length=rollout.seq_length, pad_id=0)
    kept = collate_rollout(rollout_rows(rollout), seq_length=rollout.seq_length, pad_id=0)
    assert masked["loss_mask"][2].sum() == 0 and kept["loss_mask"][2].sum() == 3
    assert torch.equal(masked["loss_mask"][[0, 1, 3]], kept["loss_mask"][[0, 1, 3]])
    assert torch.equal(masked["tokens"], kept["tokens"])
