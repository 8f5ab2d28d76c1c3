"""Direct preference optimisation (DPO, IPO) of the GPT policy on Megatron Core: TP/PP/VPP/CP/DP/EP, checkpoints,
requeue, held-out evaluation.

Run the tiny CPU task (held-out accuracy from 0 to 1.0 in 40 steps, ~15 s on 2 cores):
    .venv/bin/python launch.py --config configs/dpo_tiny.yaml
Own data (the reward model's preference files, text or chat): ``algorithm.name=dpo data.train_path=pairs.jsonl
data.eval_path=held_out.jsonl model.init_from=SFT_CKPT``.

Pairs go through the schedule as the RM trainer's do (``megatron_rl.trainers.pairs``: batch sizes count pairs; a
micro-batch holds the chosen sequences then the rejected ones, right-padded), as next-token batches whose
``loss_mask`` marks the response tokens only (``PreferenceData.chosen_starts``). The loss function takes the
per-token log-probs from the vocab-parallel logits (``megatron_rl.models.logprobs``, as GRPO), sums them per
sequence (over the context-parallel ranks too) and calls ``megatron_rl.algorithms.dpo.dpo_pair_terms``.

Reference log-probs: the reference is the policy as it starts (``model.init_from``, or the seeded init). Before
the first step one forward-only pass over the train and held-out pairs (``forward_logprobs``, the path of
GRPO's reference) stores each pair's reference sums (chosen, rejected) as float32: 8 bytes per pair (35 KB for the
tiny task's 4352 pairs), and no second model in memory. They are saved in every checkpoint (``extra
["dpo_reference"]``) and a resumed run restores them from there, so it continues exactly, at any layout.

Loss per pair: the DPO (or IPO) term, plus ``algorithm.dpo_sft_coef`` x the NLL of the chosen response scaled so
that the step's mean is the mean NLL per chosen token. Metrics (train, and phase "eval" on the held-out split every
``data.eval_interval`` steps, at step 0 and at the end): loss, dpo_loss, sft_loss, accuracy (chosen reward >
rejected; ties are wrong, so step 0, where policy = reference, reads 0), reward_margin, reward_chosen,
reward_rejected (implicit rewards beta * (log pi - log ref), summed over the response).
Test: `.venv/bin/python -m pytest tests/test_dpo.py -q`
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_rl.algorithms.dpo import DPOLossConfig, dpo_pair_terms
from megatron_rl.data.preferences import PreferenceData
from megatron_rl.models.logprobs import vocab_parallel_logprobs
from megatron_rl.models.reward_model import padded_length
from megatron_rl.rl.loss import sum_over_context_parallel, whole_sequence_lengths
from megatron_rl.runtime.distributed import collective_device
from megatron_rl.runtime.training import Engine, forward_logprobs, gather_data_parallel, logits_forward
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.trainers import pairs
from megatron_rl.trainers.common import TrainerContext, job_engine
from megatron_rl.data.batches import lm_batch

REPORTS = ("loss", "dpo_loss", "sft_loss", "accuracy", "reward_margin", "reward_chosen", "reward_rejected")
REFERENCE_KEY = "dpo_reference"
"""Checkpoint extra-state key of the reference log-prob sums: {"train": [N, 2], "eval": [M, 2] or None}."""
REFERENCE_WINDOW = 16
"""Micro-batches per rank in one forward-only call of the reference pass (bounds its per-token memory)."""


@dataclasses.dataclass(kw_only=True)
class ReferencedPairs(PreferenceData):
    """Preference pairs with their reference log-prob sums."""

    reference: torch.Tensor
    """[pairs, 2] float32: the reference's log-prob sums over the chosen and the rejected response."""

    @classmethod
    def of(cls, data: PreferenceData, reference: torch.Tensor) -> "ReferencedPairs":
        if reference.shape != (len(data), 2):
            raise ConfigError(f"{data.name}: the checkpoint's reference log-probs are for {reference.shape[0]} pairs "
                              f"and the data has {len(data)}: the data changed since the run started; restore it, "
                              "or set checkpoint.resume=false to start over")
        return cls(**{f.name: getattr(data, f.name) for f in dataclasses.fields(PreferenceData)}, reference=reference)


def response_tokens(ids: list[int], start: int) -> int:
    """Tokens of the response scored (the first token of a sequence has no prediction)."""
    return len(ids) - max(start, 1)


class DPOPairBatcher(pairs.PairMicroBatcher):
    """Next-token micro-batches of pairs: tokens, labels, position_ids, loss_mask (the response's labels), and per
    pair: pair_weight, ref_chosen, ref_rejected, sft_scale (pairs / chosen response tokens of the whole batch)."""

    sft_scale = 1.0

    def micro_batches(self, data: PreferenceData, indices: list[int], *, pad_to: int) -> tuple[list[dict], int]:
        tokens = sum(response_tokens(data.chosen[i], data.chosen_starts[i]) for i in indices)
        self.sft_scale = len(indices) / max(tokens, 1)
        return super().micro_batches(data, indices, pad_to=pad_to)

    def collate(self, data: PreferenceData, indices: list[int], weights: list[float], *, longest: int) -> dict:
        seqs = [data.chosen[i] for i in indices] + [data.rejected[i] for i in indices]
        starts = [data.chosen_starts[i] for i in indices] + [data.rejected_starts[i] for i in indices]
        length = padded_length(longest - 1, fixed=self.fixed_length, multiple=self.multiple)  # inputs: all but the last
        rows = torch.full((len(seqs), length + 1), self.pad_id, dtype=torch.long)
        row_mask = torch.zeros((len(seqs), length + 1), dtype=torch.float32)
        for row, (ids, start) in enumerate(zip(seqs, starts)):
            rows[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            row_mask[row, max(start, 1):len(ids)] = 1.0
        reference = getattr(data, "reference", None)
        reference = reference[indices] if reference is not None else torch.zeros(len(indices), 2)
        per_pair = {"pair_weight": torch.tensor(weights, dtype=torch.float32), "ref_chosen": reference[:, 0],
                    "ref_rejected": reference[:, 1], "sft_scale": torch.full((len(indices),), self.sft_scale)}
        if torch.cuda.is_available():
            per_pair = {k: v.cuda(non_blocking=True) for k, v in per_pair.items()}
        return {**lm_batch(rows, row_mask), **per_pair}


def make_dpo_loss(config: DPOLossConfig):
    """The loss function for ``Engine.train_step``: (sum of the pair losses, real pairs, reports) of a micro-batch.

    Under context parallelism each rank holds chunks of every sequence: the log-prob sums and token counts are
    summed over the CP group (differentiably), every CP rank computes the same pair terms, and only CP rank 0
    counts them, so Megatron's sum over the data-parallel-with-CP ranks counts each pair once."""

    def loss_fn(logits: torch.Tensor, batch: dict):
        mask = batch["loss_mask"]
        sums = (vocab_parallel_logprobs(logits, batch["labels"]) * mask).sum(dim=-1)
        lengths, counts_pairs = whole_sequence_lengths(mask)
        if lengths is None:
            lengths = mask.sum(dim=-1)
        else:
            sums = sum_over_context_parallel(sums)
        weight = batch["pair_weight"] if counts_pairs else torch.zeros_like(batch["pair_weight"])
        n = weight.shape[0]
        terms = dpo_pair_terms(sums[:n], sums[n:], batch["ref_chosen"], batch["ref_rejected"],
                               chosen_tokens=lengths[:n], rejected_tokens=lengths[n:], config=config)
        nll = -sums[:n]
        per_pair = terms["dpo_loss"] + config.sft_coef * nll * batch["sft_scale"]
        count = weight.sum().to(torch.int)

        def total(values: torch.Tensor, denominator: torch.Tensor = count) -> tuple[torch.Tensor, torch.Tensor]:
            return (values.detach() * weight).sum(), denominator

        reports = {"loss": total(per_pair), "dpo_loss": total(terms["dpo_loss"]),
                   "sft_loss": total(nll, (lengths[:n] * weight).sum()), "accuracy": total(terms["correct"]),
                   "reward_margin": total(terms["margin"]), "reward_chosen": total(terms["reward_chosen"]),
                   "reward_rejected": total(terms["reward_rejected"])}
        return (per_pair * weight).sum(), count, reports

    return loss_fn


def reference_sums(engine: Engine, batcher: DPOPairBatcher, data: PreferenceData, cfg: JobConfig) -> torch.Tensor:
    """[pairs, 2] float32 log-prob sums (chosen, rejected) of every pair's responses under the current weights, on
    every rank: forward-only passes of this rank's share, shared along the pipeline and over the DP ranks."""
    from megatron.core import parallel_state as ps

    pad_to = pairs.whole_split_pad_to(cfg)
    window = pad_to * REFERENCE_WINDOW
    parts = []
    for low in range(0, len(data), window):
        indices = list(range(low, min(low + window, len(data))))
        batches, seq_length = batcher.micro_batches(data, indices, pad_to=pad_to)
        logprobs = forward_logprobs(engine.chunks, batches, seq_length=seq_length)
        mine = torch.zeros(len(batches) * batcher.micro_batch_size, 2, dtype=torch.float32,
                           device=collective_device(ps.get_pipeline_model_parallel_group()))
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            sums = torch.cat([(lp * b["loss_mask"]).sum(dim=-1).view(2, -1).t() for lp, b in zip(logprobs, batches)])
            mine.copy_(sums)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.broadcast(mine, src=ps.get_pipeline_model_parallel_last_rank(),
                                        group=ps.get_pipeline_model_parallel_group())
        everyone = gather_data_parallel(mine.cpu().tolist())
        parts.append(torch.tensor(everyone[:len(indices)], dtype=torch.float32))
    return torch.cat(parts)


def with_reference(ctx: TrainerContext, engine: Engine, batcher: DPOPairBatcher, *, start: int,
                   splits: list[Optional[PreferenceData]]) -> list[Optional[ReferencedPairs]]:
    """Each split with its reference sums: computed from the starting weights on a fresh start, else restored
    from the resumed checkpoint."""
    names = ("train", "eval")
    if start == 0:
        stored = {name: None if data is None else reference_sums(engine, batcher, data, ctx.cfg)
                  for name, data in zip(names, splits)}
    else:
        stored = ctx.resumed_extra.get(REFERENCE_KEY)
        if stored is None:
            raise ConfigError(f"the checkpoint resumed at step {start} has no DPO reference log-probs (it was not "
                              "saved by a DPO run); set checkpoint.resume=false or point checkpoint.dir elsewhere")
    referenced = [None if data is None else ReferencedPairs.of(data, stored[name]) for name, data in zip(names, splits)]
    ctx.extra_state = lambda: {REFERENCE_KEY: {name: None if d is None else d.reference
                                               for name, d in zip(names, referenced)}}
    return referenced


def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    max_length = pairs.preference_max_length(cfg, shape)
    encoder, train_data, eval_data = pairs.load_pairs(cfg, shape, max_length=max_length, response_starts=True)
    engine = job_engine(cfg, shape, dims=ctx.dims)
    batcher = DPOPairBatcher(cfg, pad_id=encoder.pad_id, max_length=max_length, multiple=engine.sequence_multiple)
    start = ctx.resume(engine)
    train_data, eval_data = with_reference(ctx, engine, batcher, start=start, splits=[train_data, eval_data])
    pairs.train_on_pairs(ctx, engine, batcher, train_data, eval_data, make_dpo_loss(DPOLossConfig.from_algorithm(
        cfg.algorithm)), start=start, max_length=max_length, forward_fn=logits_forward, report_names=REPORTS)
