"""Rollouts as training data: prompt + response rows, aligned log-probs and advantages, and the GRPO loss
in the form Megatron's schedule wants (a sum and its denominator, see ``megatron_rl.runtime.training``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_rl.grpo.loss import GRPOLossConfig, aggregate, kl_penalty, policy_ratio_loss
from megatron_rl.models.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs

REPORTS = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_min", "ratio_max")


@dataclass
class Rollout:
    """One rollout batch: every completion of every prompt, in group order (prompt-major)."""

    prompt_ids: list[list[int]]
    """Prompt tokens per completion (each prompt repeated group_size times)."""
    response_ids: list[list[int]]
    """Generated tokens per completion (ending with eos when it stopped)."""
    logprobs: list[list[float]]
    """Log-prob of each generated token under the policy that sampled it."""
    prompts: list[str]
    completions: list[str]
    answers: list[Any]
    rewards: Optional[torch.Tensor] = None
    per_fn: dict[str, list[float]] = field(default_factory=dict)
    advantages: Optional[torch.Tensor] = None
    ref_logprobs: Optional[list[torch.Tensor]] = field(default=None)

    @property
    def seq_length(self) -> int:
        """Padded training length: the longest prompt + response, minus the last token (inputs are shifted)."""
        return max(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)) - 1


def collate_rollout(rows: list[dict], *, seq_length: int, pad_id: int) -> dict:
    """A training micro-batch of rollout rows, right-padded; loss_mask marks the response's label positions."""
    batch_size = len(rows)
    tokens = torch.full((batch_size, seq_length + 1), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((batch_size, seq_length), dtype=torch.float32)
    old_logp = torch.zeros((batch_size, seq_length), dtype=torch.float32)
    ref_logp = torch.zeros((batch_size, seq_length), dtype=torch.float32)
    advantages = torch.zeros(batch_size, dtype=torch.float32)
    for i, row in enumerate(rows):
        prompt, response = row["prompt_ids"], row["response_ids"]
        seq = prompt + response
        tokens[i, :len(seq)] = torch.tensor(seq)
        start, end = len(prompt) - 1, len(seq) - 1  # label positions of the response tokens
        loss_mask[i, start:end] = 1.0
        old_logp[i, start:end] = torch.tensor(row["logprobs"], dtype=torch.float32)
        if row.get("ref_logprobs") is not None:
            ref_logp[i, start:end] = row["ref_logprobs"][start:end]
        advantages[i] = row["advantage"]
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": loss_mask,
             "old_logp": old_logp, "ref_logp": ref_logp, "advantages": advantages,
             "position_ids": torch.arange(seq_length).unsqueeze(0).expand(batch_size, -1).contiguous()}
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    return batch


def rollout_rows(rollout: Rollout) -> list[dict]:
    rows = []
    for i in range(len(rollout.response_ids)):
        rows.append({"prompt_ids": rollout.prompt_ids[i], "response_ids": rollout.response_ids[i],
                     "logprobs": rollout.logprobs[i], "advantage": float(rollout.advantages[i]),
                     "ref_logprobs": rollout.ref_logprobs[i] if rollout.ref_logprobs is not None else None})
    return rows


def logits_forward(model, batch: dict) -> torch.Tensor:
    """Vocab-parallel logits [batch, seq, vocab/tp] (no labels: the GRPO loss needs log-probs and entropy)."""
    return model(batch["tokens"], batch["position_ids"], None)


def make_grpo_loss(config: GRPOLossConfig, vocab_size: int, *, use_ref: bool):
    """The loss function handed to ``Engine.train_step``: (sum, denominator, reports) for one micro-batch."""

    def loss_fn(logits: torch.Tensor, batch: dict):
        mask = batch["loss_mask"]
        entropy = vocab_parallel_entropy(logits, vocab_size)  # before the cross entropy, which works in place
        logp = vocab_parallel_logprobs(logits, batch["labels"], vocab_size)
        per_token, stats = policy_ratio_loss(logp, batch["old_logp"], batch["advantages"], mask,
                                             eps_low=config.eps_low, eps_high=config.eps_high,
                                             dual_clip=config.dual_clip)
        pg_per_token = per_token
        kl = kl_penalty(logp, batch["ref_logp"], config.kl_kind, config.kl_clamp,
                        log_ratio_clamp=config.kl_log_ratio_clamp) if use_ref else torch.zeros_like(logp)
        if use_ref and config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl
        terms = dict(max_response_len=config.max_response_len, global_num_tokens=1, global_num_seqs=1)
        loss_sum = aggregate(per_token, mask, config.loss_agg_mode, **terms)
        tokens = mask.sum()
        seqs = (mask.sum(-1) > 0).sum()
        denominator = (tokens if config.loss_agg_mode == "token-mean" else seqs).to(torch.int)
        with torch.no_grad():
            one = torch.ones((), dtype=torch.float64)
            reports = {
                "loss": (loss_sum.detach(), denominator),
                "pg_loss": (aggregate(pg_per_token.detach(), mask, config.loss_agg_mode, **terms), denominator),
                "kl": ((kl.detach() * mask).sum(), tokens),
                "entropy": ((entropy * mask).sum(), tokens),
                "clip_fraction": (stats["clip_fraction"] * tokens, tokens),
                "ratio_min": (stats["ratio_min"], one),
                "ratio_max": (stats["ratio_max"], one),
            }
        return loss_sum, denominator, reports

    return loss_fn


def make_logprob_collector(vocab_size: int, sink: list):
    """A forward-only 'loss' that stores each micro-batch's per-token log-probs in ``sink`` (last stage only)."""

    def loss_fn(logits: torch.Tensor, batch: dict):
        sink.append(vocab_parallel_logprobs(logits, batch["labels"], vocab_size).detach().float().cpu())
        zero = torch.zeros((), dtype=torch.float32, device=logits.device)
        return zero, torch.ones((), dtype=torch.int, device=logits.device), {}

    return loss_fn
