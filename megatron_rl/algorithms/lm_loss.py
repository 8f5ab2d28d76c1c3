"""The next-token loss of pretraining and SFT, as ``Engine.train_step`` takes a loss (``runtime/training.py``)."""

from __future__ import annotations

import torch

LM_REPORTS = ("loss",)
"""What ``lm_loss`` reports."""


def lm_loss(per_token_loss: torch.Tensor, batch: dict):
    """Token-mean cross entropy over the global batch (Megatron divides by the summed token count)."""
    mask = batch["loss_mask"]
    loss_sum = (per_token_loss.float() * mask).sum()
    count = mask.sum().to(torch.int)
    return loss_sum, count, {"loss": (loss_sum.detach(), count)}
