"""The policy loss in the form Megatron's schedule wants (``Engine.train_step``): ``grpo_loss``
(``megatron_rl.algorithms.policy_loss``) of a rollout micro-batch's logits as a sum and its denominator (see
``megatron_rl.runtime.training``), with what it reports.

Context parallelism: a micro-batch holds this CP rank's two chunks of every row, so the loss function sees parts
of sequences. Megatron sums losses and denominators over the data-parallel-with-CP group, which makes a token mean
exact as it is; the sequence means need each sequence's whole length (all-reduced over the CP group) and count each
sequence once (on CP rank 0). DPO's sequence sums use the same two helpers.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.algorithms.policy_loss import GRPOLossConfig, grpo_loss
from megatron_rl.models.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_rl.models.packed_sequences import as_rows
from megatron_rl.rollout.batch import RolloutBatch, old_logprobs

REPORTS = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_min", "ratio_max")
OFF_POLICY_REPORTS = ("behav_weight_mean", "behav_capped_fraction", "behav_weight_max")
"""Reported besides REPORTS when the loss corrects for the behaviour policy (``algorithm.off_policy_correction``)."""
TEACHER_REPORTS = ("teacher_kl",)
"""Reported besides REPORTS with on-policy distillation (``algorithm.teacher``)."""


def make_grpo_loss(config: GRPOLossConfig):
    """The loss function handed to ``Engine.train_step``: ``grpo_loss`` of one micro-batch as (sum, denominator,
    reports), on padded or packed micro-batches (``megatron_rl.rollout.packing``). The denominator is the
    micro-batch's token count (token-mean) or sequence count (the other modes);
    Megatron sums both over micro-batches and data-parallel(-with-CP) ranks, so the step's loss is the global
    one. Under context parallelism the batch holds this CP rank's chunks: see the module docstring."""

    def loss_fn(logits: torch.Tensor, batch: RolloutBatch):
        mask = batch.loss_mask
        entropy = as_rows(vocab_parallel_entropy(logits), batch)  # before the cross entropy, which works in place
        logp = as_rows(vocab_parallel_logprobs(logits, batch.labels), batch)
        seq_lengths, counts_sequences = whole_sequence_lengths(mask)
        loss_sum, metrics = grpo_loss(logp, old_logprobs(batch), batch.advantages, mask, config=config,
                                      ref_logp=batch.ref_logp, entropy=entropy,
                                      global_num_tokens=1, global_num_seqs=1, seq_lengths=seq_lengths,
                                      sum_over_parts=None if seq_lengths is None else sum_over_context_parallel,
                                      behav_logp=batch.behav_logp, teacher_logp=batch.teacher_logp)
        tokens = metrics["num_tokens"]
        sequences = metrics["num_seqs"] if counts_sequences else torch.zeros_like(metrics["num_seqs"])
        denominator = (tokens if config.loss_agg_mode == "token-mean" else sequences).to(torch.int)
        one = torch.ones((), dtype=torch.float64)
        reports = {
            "loss": (metrics["loss"], denominator), "pg_loss": (metrics["pg_loss"], denominator),
            **{name: (metrics[name] * tokens, tokens) for name in ("kl", "entropy", "clip_fraction")},
            "ratio_min": (metrics["ratio_min"], one), "ratio_max": (metrics["ratio_max"], one),
        }
        if config.teacher_coef > 0:
            reports["teacher_kl"] = (metrics["teacher_kl"] * tokens, tokens)
        if config.off_policy_correction != "none":
            reports.update({name: (metrics[name] * tokens, tokens)
                            for name in ("behav_weight_mean", "behav_capped_fraction")},
                           behav_weight_max=(metrics["behav_weight_max"], one))
        return loss_sum, denominator, reports

    return loss_fn


def sum_over_context_parallel(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over the context-parallel group, differentiably (each rank gets the gradient of the sum)."""
    from megatron.core import parallel_state as ps
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(values, group=ps.get_context_parallel_group())


def whole_sequence_lengths(mask: torch.Tensor) -> tuple[Optional[torch.Tensor], bool]:
    """(per-sequence loss-token counts over the whole sequences, whether this rank counts the sequences) for a
    micro-batch whose ``mask`` [b, s / cp] holds this context-parallel rank's chunks: the lengths are
    all-reduced over the CP group and only CP rank 0 counts sequences. (None, True) without CP."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() <= 1:  # 0: no process group (a single process)
        return None, True
    lengths = mask.detach().to(torch.float32).sum(dim=-1)
    torch.distributed.all_reduce(lengths, group=ps.get_context_parallel_group())
    return lengths, ps.get_context_parallel_rank() == 0
