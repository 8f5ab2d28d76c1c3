"""GRPO math: group-relative advantages and the token-level loss (pure torch, no Megatron import).

Test: `.venv/bin/python -m pytest tests/test_grpo_math.py -q`
"""

from megatron_rl.grpo.advantages import expand_group_mask, group_advantages, groups_with_signal
from megatron_rl.grpo.loss import (
    KL_KINDS,
    LOSS_AGG_MODES,
    GRPOLossConfig,
    aggregate,
    entropy_from_full_logits,
    grpo_loss,
    kl_penalty,
    local_normalisers,
    policy_ratio_loss,
    token_logprobs_from_full_logits,
)

__all__ = [
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "GRPOLossConfig",
    "aggregate",
    "entropy_from_full_logits",
    "expand_group_mask",
    "group_advantages",
    "groups_with_signal",
    "grpo_loss",
    "kl_penalty",
    "local_normalisers",
    "policy_ratio_loss",
    "token_logprobs_from_full_logits",
]
