"""The reward model's Bradley-Terry loss (the rm trainer's, and the evaluation of a reward-model checkpoint's),
as ``Engine.train_step`` takes a loss.

Loss per pair: ``-log sigmoid(r_c - r_r - margin) + centering_coef * (r_c + r_r)^2``, averaged over the global
batch's real pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RM_REPORTS = ("loss", "bt_loss", "accuracy", "reward_margin", "reward_chosen", "reward_rejected")
"""What ``preference_loss`` reports."""


def bradley_terry_terms(r_chosen: torch.Tensor, r_rejected: torch.Tensor, *, margin: float = 0.0,
                        centering_coef: float = 0.0) -> dict[str, torch.Tensor]:
    """Per-pair terms: loss (BT + centering), bt_loss, correct (1.0 when r_c > r_r strictly), margin (r_c - r_r)."""
    diff = r_chosen.float() - r_rejected.float()
    bt = F.softplus(-(diff - margin))  # = -log sigmoid(diff - margin), stable for large |diff|
    centering = centering_coef * (r_chosen.float() + r_rejected.float()) ** 2
    return {"loss": bt + centering, "bt_loss": bt, "correct": (diff > 0).float(), "margin": diff}


def preference_loss(rewards: torch.Tensor, batch: dict, *, margin: float, centering_coef: float):
    """Loss function for the Megatron schedule: rewards [2m] = m chosen then m rejected; weights [m] (0 = filler).

    Returns (weighted loss sum, number of real pairs, reports); Megatron divides by the pairs of the global batch.
    """
    weight = batch["pair_weight"]
    pairs = weight.shape[0]
    terms = bradley_terry_terms(rewards[:pairs], rewards[pairs:], margin=margin, centering_coef=centering_coef)
    count = weight.sum().to(torch.int)
    loss_sum = (terms["loss"] * weight).sum()

    def total(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (values.detach() * weight).sum(), count

    reports = {"loss": total(terms["loss"]), "bt_loss": total(terms["bt_loss"]),
               "accuracy": total(terms["correct"]), "reward_margin": total(terms["margin"]),
               "reward_chosen": total(rewards[:pairs]), "reward_rejected": total(rewards[pairs:])}
    return loss_sum, count, reports
