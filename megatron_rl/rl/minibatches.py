"""A step's mini-batches: this rank's micro-batches of a rollout, what they cost against the rows they hold, their
forward length, one figure per metric."""

from __future__ import annotations

import dataclasses

from megatron_rl.rollout.batch import RolloutBatch, RolloutRow, collate_rollout, rollout_rows
from megatron_rl.rollout.packing import pack_minibatch
from megatron_rl.runtime.training import Engine, data_parallel_slice
from megatron_rl.spec.config.schema import AlgorithmConfig, ParallelConfig
from megatron_rl.spec.model_shape import ModelShape


@dataclasses.dataclass
class PackingFigures:
    """Tokens the training forwards compute (padding included) and tokens of the rows, over a step's mini-batches."""

    train_tokens: float = 0.0
    real_tokens: float = 0.0

    def add(self, *, train_tokens: float, real_tokens: float) -> None:
        self.train_tokens += train_tokens
        self.real_tokens += real_tokens

    def ratio(self) -> float:
        """train_tokens_per_real_token: 1.0 is no padding at all."""
        return self.train_tokens / max(self.real_tokens, 1.0)


class Minibatcher:
    """Cuts rollouts into this DP rank's micro-batches for ``engine``: padded to the rollout's longest row, or
    packed by tokens with parallel.micro_batch_tokens."""

    def __init__(self, algorithm: AlgorithmConfig, parallel: ParallelConfig, *, engine: Engine, shape: ModelShape,
                 pad_id: int) -> None:
        self.algo, self.parallel, self.engine, self.shape, self.pad_id = algorithm, parallel, engine, shape, pad_id

    def __call__(self, rollout) -> tuple[list[list[RolloutBatch]], PackingFigures]:
        """This DP rank's micro-batches of each mini-batch of global_batch_size completions (a rollout's remainder
        short of a whole mini-batch is left out): micro_batch_size rows padded to the rollout's longest, or with
        parallel.micro_batch_tokens rows packed by tokens (megatron_rl/rollout/packing.py). Each micro-batch's
        ``row_ids`` name its rows' places in their mini-batch (``RolloutBatch.row_ids``). The figures count the
        tokens they compute against the rows' own."""
        rows = rollout_rows(rollout, mask_truncated=self.algo.mask_truncated)
        gbs = self.algo.global_batch_size
        usable = len(rows) - len(rows) % gbs
        packing = PackingFigures()
        minibatches = []
        for start in range(0, usable, gbs):
            share = rows[start:start + gbs]
            if self.parallel.micro_batch_tokens is None:
                batches = []
                for ids in data_parallel_slice(list(range(len(share))),
                                               micro_batch_size=self.parallel.micro_batch_size):
                    batches.append(collate_rollout([share[i] for i in ids], seq_length=rollout.seq_length,
                                                   pad_id=self.pad_id, row_ids=ids))
                packing.add(train_tokens=len(share) * rollout.seq_length,
                            real_tokens=sum(row.forward_tokens for row in share))
            else:
                batches, figures = self.pack(share)
                packing.add(**figures)
            minibatches.append(batches)
        return minibatches, packing

    def pack(self, rows: list[RolloutRow]) -> tuple[list[RolloutBatch], dict]:
        """This DP rank's packed micro-batches of one mini-batch (parallel.micro_batch_tokens)."""
        from megatron.core import parallel_state as ps

        dims = self.engine.opts.dims
        return pack_minibatch(rows, dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                              token_budget=self.parallel.micro_batch_tokens, multiple=self.engine.sequence_multiple,
                              count_multiple=dims.pp if dims.vpp > 1 else 1, pad_id=self.pad_id,
                              thd=self.engine.opts.takes_packed_sequences(self.shape))


def forward_length(batches: list) -> int:
    """The sequence length Megatron's schedule runs a mini-batch's micro-batches at (padded or packed: all alike)."""
    return batches[0].tokens.shape[1]


def combine_minibatches(totals: dict[str, list[float]]) -> dict[str, float]:
    """One figure per metric over a step's mini-batches: the mean, or the min/max of *_min/*_max keys; plus the
    number of policy optimizer steps taken (``minibatches``)."""
    combined = {}
    for key, values in totals.items():
        if key.endswith("_min"):
            combined[key] = min(values)
        elif key.endswith("_max"):
            combined[key] = max(values)
        else:
            combined[key] = sum(values) / len(values)
    combined["minibatches"] = float(len(totals.get("loss", [])))
    return combined


def record_policy_step(totals: dict[str, list[float]], epoch: int, metrics: dict[str, float], *, epochs: int) -> None:
    """Add one policy optimizer step's metrics to ``totals``: the first step's ratio range, and per-epoch clip
    fraction and KL when there are several epochs."""
    if "first_ratio_min" not in totals:
        totals["first_ratio_min"] = [metrics["ratio_min"]]
        totals["first_ratio_max"] = [metrics["ratio_max"]]
    for key, value in metrics.items():
        totals.setdefault(key, []).append(value)
    if epochs > 1:
        for key in ("clip_fraction", "kl"):
            totals.setdefault(f"{key}_epoch{epoch}", []).append(metrics[key])
