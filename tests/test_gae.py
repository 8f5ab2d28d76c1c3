"""PPO's advantage maths (megatron_rl/algorithms/gae.py) against returns computed by hand for short sequences,
with padding, a masked hole, and gamma/lambda at 0 and 1.

Run: ``.venv/bin/python -m pytest tests/test_gae.py -q`` (< 1 s).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.gae import clipped_value_loss, explained_variance, gae, token_rewards, whiten

R = torch.tensor([[0.0, 0.0, 1.0]])
V = torch.tensor([[0.5, 0.6, 0.7]])
FULL = torch.ones(1, 3)


@pytest.mark.parametrize("gamma,lam,advantages,returns", [
    # Monte Carlo: A_t = sum of future rewards - V_t, R_t = 1
    (1.0, 1.0, [0.5, 0.4, 0.3], [1.0, 1.0, 1.0]),
    # TD(0): A_t = r_t + V_{t+1} - V_t
    (1.0, 0.0, [0.1, 0.1, 0.3], [0.6, 0.7, 1.0]),
    # gamma 0: A_t = r_t - V_t whatever lambda, R_t = r_t
    (0.0, 1.0, [-0.5, -0.6, 0.3], [0.0, 0.0, 1.0]),
    # deltas 0.04, 0.03, 0.3; A_1 = 0.03 + 0.855 * 0.3, A_0 = 0.04 + 0.855 * A_1
    (0.9, 0.95, [0.04 + 0.855 * (0.03 + 0.855 * 0.3), 0.03 + 0.855 * 0.3, 0.3],
     [0.5 + 0.04 + 0.855 * (0.03 + 0.855 * 0.3), 0.6 + 0.03 + 0.855 * 0.3, 1.0]),
])
def test_gae_equals_hand_computed_returns(gamma, lam, advantages, returns):
    adv, ret = gae(R, V, FULL, gamma=gamma, lam=lam)
    assert adv.tolist()[0] == pytest.approx(advantages, abs=1e-6)
    assert ret.tolist()[0] == pytest.approx(returns, abs=1e-6)


def test_padding_and_masked_holes_take_no_part():
    """A right-padded row and a row with a masked token in the middle equal the unpadded 3-token sequence."""
    reference, _ = gae(R, V, FULL, gamma=0.9, lam=0.95)
    padded, padded_ret = gae(torch.tensor([[0.0, 0.0, 1.0, 5.0]]), torch.tensor([[0.5, 0.6, 0.7, 9.0]]),
                             torch.tensor([[1.0, 1.0, 1.0, 0.0]]), gamma=0.9, lam=0.95)
    holed, _ = gae(torch.tensor([[0.0, 7.0, 0.0, 1.0]]), torch.tensor([[0.5, 3.0, 0.6, 0.7]]),
                   torch.tensor([[1.0, 0.0, 1.0, 1.0]]), gamma=0.9, lam=0.95)
    assert padded[0, :3].tolist() == pytest.approx(reference[0].tolist(), abs=1e-6)
    assert padded[0, 3] == 0 and padded_ret[0, 3] == 0
    assert holed[0, [0, 2, 3]].tolist() == pytest.approx(reference[0].tolist(), abs=1e-6) and holed[0, 1] == 0


def test_token_rewards_put_the_reward_on_the_last_token_and_subtract_the_kl():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rewards = token_rewards(torch.tensor([2.0, -1.0, 3.0]), mask)
    assert rewards.tolist() == [[0, 0, 2, 0], [-1, 0, 0, 0], [0, 0, 0, 0]]
    kl = torch.full_like(mask, 0.5)
    with_kl = token_rewards(torch.tensor([2.0, -1.0, 3.0]), mask, kl=kl, kl_coef=0.2)
    assert torch.allclose(with_kl, torch.tensor([[-0.1, -0.1, 1.9, 0], [-1.1, 0, 0, 0], [0, 0, 0, 0]]))


def test_whitening_over_unmasked_entries():
    values = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    std = (5 / 3) ** 0.5  # unbiased variance of 1, 2, 3, 4
    expected = [[-1.5 / std, -0.5 / std, 0.0], [0.5 / std, 1.5 / std, 0.0]]
    assert torch.allclose(whiten(values, mask), torch.tensor(expected), atol=1e-6)
    assert torch.allclose(whiten(values, mask, shift_mean=False), (torch.tensor(expected) + 2.5) * mask, atol=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        whiten(values, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_clipped_value_loss_takes_the_larger_error():
    old = torch.tensor([[1.0, 1.0, 1.0]])
    new = torch.tensor([[1.5, 1.1, 0.0]])
    target = torch.tensor([[2.0, 0.0, 0.0]])
    loss, clipped = clipped_value_loss(new, old, target, FULL, clip=0.2)
    # token 0: V 1.5 (err 0.25) vs clipped 1.2 (err 0.64); 1: 1.1 (1.21) vs 1.1; 2: 0.0 (0) vs 0.8 (0.64)
    assert loss.tolist()[0] == pytest.approx([0.32, 0.605, 0.32])
    assert clipped.tolist()[0] == [1.0, 0.0, 1.0]
    plain, _ = clipped_value_loss(new, old, target, FULL, clip=None)
    assert plain.tolist()[0] == pytest.approx([0.125, 0.605, 0.0])


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)
    assert explained_variance(-returns, returns, mask) < 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="gamma and lambda"):
        gae(R, V, FULL, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match="shaped like the mask"):
        gae(R, V[:, :2], FULL, gamma=1.0, lam=1.0)
