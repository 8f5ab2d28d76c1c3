"""DPO losses from sequence log-probabilities: sigmoid DPO (with conservative label smoothing), IPO, and an NLL term.

Inputs per pair (tensors [pairs]): the policy's and the reference's log-prob SUMS over the response tokens of the
chosen and of the rejected sequence, and each response's token count. With the log-ratios
``c = pi_c - ref_c`` and ``r = pi_r - ref_r``:

- sigmoid (DPO, arXiv 2305.18290): ``-(1 - e) log sigmoid(beta (c - r)) - e log sigmoid(-beta (c - r))``, where
  ``e`` = ``label_smoothing``, the assumed probability of a flipped label (conservative DPO, as TRL's
  CPOTrainer/TPOTrainer and DPOTrainer's ``aot`` loss write it; TRL 1.16's DPO ``sigmoid`` loss has no smoothing);
- ipo (arXiv 2310.12036, eq. 17): ``(c / n_c - r / n_r - 1 / (2 beta))^2`` with the log-ratios averaged over each
  response's tokens ``n``, as TRL's DPOTrainer does (its authors' normalised form);
- sft: ``sft_coef`` x the mean NLL per chosen response token over the batch, ``-sum(pi_c) / sum(n_c)`` (TRL's
  ``sft`` loss type, added with a weight).

Implicit rewards ``beta * c`` and ``beta * r`` (log-prob sums, for either loss, as TRL logs them); margin =
their difference; accuracy = 1 where the chosen reward is strictly larger (ties count as wrong).
Pure torch; the DPO trainer (``megatron_rl.trainers.dpo``) calls ``dpo_pair_terms`` on every micro-batch.

Test: `.venv/bin/python -m pytest tests/test_dpo.py -q -k "loss or trl"`
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron_rl.spec.config.schema import DPO_LOSSES, AlgorithmConfig


@dataclasses.dataclass(kw_only=True, frozen=True)
class DPOLossConfig:
    """Knobs of the DPO loss; the defaults and checks of the values a user sets live in ``AlgorithmConfig``."""

    beta: float = 0.1
    """Strength of the pull toward the reference (IPO: the regulariser tau)."""
    label_smoothing: float = 0.0
    """Sigmoid loss: the assumed probability that a label is flipped, in [0, 0.5)."""
    loss_type: str = "sigmoid"
    """One of the schema's DPO_LOSSES: sigmoid or ipo."""
    sft_coef: float = 0.0
    """Weight of the mean NLL per chosen response token."""

    @classmethod
    def from_algorithm(cls, algo: AlgorithmConfig) -> "DPOLossConfig":
        return cls(beta=algo.dpo_beta, label_smoothing=algo.dpo_label_smoothing, loss_type=algo.dpo_loss,
                   sft_coef=algo.dpo_sft_coef)

    def __post_init__(self) -> None:
        if self.loss_type not in DPO_LOSSES or self.beta <= 0 or not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"loss_type={self.loss_type!r} (use one of {DPO_LOSSES}), beta={self.beta} (> 0), "
                             f"label_smoothing={self.label_smoothing} (in [0, 0.5))")


def dpo_pair_terms(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                   ref_rejected: torch.Tensor, *, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
                   config: DPOLossConfig) -> dict[str, torch.Tensor]:
    """Per-pair terms [pairs]: dpo_loss (differentiable in the policy sums), reward_chosen, reward_rejected,
    margin and correct (detached)."""
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    if config.loss_type == "sigmoid":
        z = config.beta * (chosen_ratio - rejected_ratio)
        smoothing = config.label_smoothing
        loss = (1 - smoothing) * F.softplus(-z) + smoothing * F.softplus(z)  # softplus(-z) = -log sigmoid(z)
    else:
        averaged = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        loss = (averaged - 1 / (2 * config.beta)) ** 2
    reward_chosen = config.beta * chosen_ratio.detach()
    reward_rejected = config.beta * rejected_ratio.detach()
    margin = reward_chosen - reward_rejected
    return {"dpo_loss": loss, "reward_chosen": reward_chosen, "reward_rejected": reward_rejected, "margin": margin,
            "correct": (margin > 0).to(margin.dtype)}


def chosen_nll(policy_chosen: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """Mean NLL per chosen response token over the pairs: ``-sum(pi_c) / sum(n_c)``."""
    return -policy_chosen.sum() / chosen_tokens.sum().clamp(min=1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, *, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
             config: DPOLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, batch metrics) of a batch of pairs: the mean DPO term plus ``sft_coef`` x ``chosen_nll``."""
    terms = dpo_pair_terms(policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_tokens=chosen_tokens,
                           rejected_tokens=rejected_tokens, config=config)
    sft = chosen_nll(policy_chosen, chosen_tokens)
    loss = terms["dpo_loss"].mean() + config.sft_coef * sft
    metrics = {"loss": loss.detach(), "dpo_loss": terms["dpo_loss"].mean().detach(), "sft_loss": sft.detach(),
               "accuracy": terms["correct"].mean(), "reward_margin": terms["margin"].mean(),
               "reward_chosen": terms["reward_chosen"].mean(), "reward_rejected": terms["reward_rejected"].mean()}
    return loss, metrics
