"""PPO's advantages and value loss over response tokens: generalised advantage estimation (Schulman et al. 2016,
"High-Dimensional Continuous Control Using Generalized Advantage Estimation", eq. 16), token rewards with the
sequence reward at the last token minus an optional per-token KL penalty (Ouyang et al. 2022), masked whitening,
the clipped value loss (as in OpenAI's baselines ppo2 and verl) and explained variance.

All tensors are [batch, T] over response positions with a 0/1 ``mask`` (1 = a generated token). Masked positions
take no part: a response's last token is its last unmasked one, and GAE runs over the unmasked tokens only.

    delta_t = r_t + gamma * V_{t+1} - V_t             (V after the last token is 0: the episode ends)
    A_t     = delta_t + gamma * lambda * A_{t+1}
    R_t     = A_t + V_t                                (the value targets)

Test: ``.venv/bin/python -m pytest tests/test_gae.py -q``
"""

from __future__ import annotations

import torch


def _check(mask: torch.Tensor, *tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.shape != mask.shape:
            raise ValueError(f"expected tensors shaped like the mask {tuple(mask.shape)}, got {tuple(tensor.shape)}")


def token_rewards(sequence_rewards: torch.Tensor, mask: torch.Tensor, *, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """[batch, T] rewards: each sequence's reward at its last unmasked token, minus ``kl_coef * kl`` on every
    unmasked token (``kl``: a per-token KL estimate to the reference; None or kl_coef 0 leaves it out)."""
    if sequence_rewards.shape != mask.shape[:1]:
        raise ValueError(f"sequence_rewards must be [batch] = {mask.shape[0]}, got {tuple(sequence_rewards.shape)}")
    mask = mask.float()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values
    rewards = torch.zeros_like(mask)
    has_tokens = last >= 0
    rows = torch.nonzero(has_tokens).squeeze(1)
    rewards[rows, last[rows]] = sequence_rewards[rows].float()
    if kl is not None and kl_coef:
        _check(mask, kl)
        rewards = rewards - kl_coef * kl.float() * mask
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), [batch, T], zero at masked positions. Masked positions are skipped: the next value of
    a token is the next unmasked token's (0 past the last)."""
    _check(mask, rewards, values)
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lambda must be in [0, 1], got gamma={gamma}, lambda={lam}")
    mask = mask.float()
    rewards, values = rewards.float() * mask, values.float() * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        live = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage * live
        next_value = torch.where(live > 0, values[:, t], next_value)
        next_advantage = torch.where(live > 0, advantage, next_advantage)
    return advantages, (advantages + values) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the unmasked entries (unbiased variance, as TRL and verl); ``shift_mean=False``
    only rescales (OpenRLHF's option). Masked entries come back 0."""
    _check(mask, values)
    mask = mask.float()
    count = mask.sum()
    if count < 2:
        raise ValueError("whitening needs at least 2 unmasked values")
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / (count - 1)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                       clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2) and whether the clipped term won
    (the value clip fraction's numerator); ``clip=None``: the plain 0.5 * (V - R)^2. Masked entries are 0."""
    _check(mask, values, old_values, returns)
    mask = mask.float()
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped * mask, torch.zeros_like(mask)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped) * mask, (clipped > unclipped).float() * mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the unmasked tokens: 1 for a perfect critic, 0 for a constant one, negative
    for a harmful one; nan when the returns do not vary."""
    _check(mask, values, returns)
    keep = mask > 0
    target, residual = returns[keep].double(), (returns - values)[keep].double()
    variance = target.var(unbiased=False)
    return float("nan") if variance == 0 else float(1.0 - residual.var(unbiased=False) / variance)
