"""Group-relative advantages for GRPO (DeepSeekMath eq. 3; Dr. GRPO drops the std division).

Rewards arrive flat and grouped: the `group_size` completions of prompt i sit at
`rewards[i * group_size:(i + 1) * group_size]`.

Test: `.venv/bin/python -m pytest tests/test_grpo_math.py -q`
"""

from __future__ import annotations

import torch


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantage of each completion relative to its group, same shape and order as `rewards`.

    normalize_std=True: (r - mean) / (std + eps), std being the sample (Bessel-corrected) std, which is what
    the published case [1, 3] -> [-0.7071, 0.7071] implies. normalize_std=False: r - mean (Dr. GRPO).
    Groups whose rewards are all equal get exactly 0, whatever eps is. A group of size 1 has no peers, so 0.
    """
    grouped = _grouped(rewards, group_size).to(torch.float32)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)
    flat_groups = ~_has_signal(grouped)
    centred = torch.where(flat_groups.unsqueeze(1), torch.zeros_like(centred), centred)
    return centred.reshape(-1)


def _has_signal(grouped: torch.Tensor) -> torch.Tensor:
    return (grouped != grouped[:, :1]).any(dim=1)


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool [num_prompts]: True where the group's rewards are not all equal (DAPO dynamic sampling keeps these)."""
    return _has_signal(_grouped(rewards, group_size))


def expand_group_mask(group_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group bool [num_prompts] -> per-completion bool [num_prompts * group_size], to index flat tensors."""
    return group_mask.repeat_interleave(group_size)
