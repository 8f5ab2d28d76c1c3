"""What the pairwise trainers (reward model, DPO) share: the preference data and its length, the pair order of
each step, micro-batches of pairs, the held-out evaluation and the training loop with its logging.

Batch sizes count PAIRS: ``algorithm.global_batch_size`` pairs per optimizer step, ``parallel.micro_batch_size``
pairs per micro-batch. A micro-batch holds 2 x micro_batch_size sequences, the chosen ones then the rejected
ones, right-padded (to the longest, or to ``data.max_length`` when pipeline stages need fixed shapes); a
trainer's ``PairMicroBatcher.collate`` says which tensors they become.

Held-out metrics (phase "eval") are logged at step 0, every ``data.eval_interval`` steps and at the end; the
data counts once, as phase "data".
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.preferences import PreferenceData, SequenceEncoder, load_preference_splits
from megatron_rl.algorithms.reward_model import RM_REPORTS, preference_loss
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.models.reward_model import (build_reward_model_chunks, load_reward_model_weights, padded_length,
                                             reward_forward, right_padded_batch)
from megatron_rl.rewards.reward_model_scorer import read_reward_model_metadata
from megatron_rl.runtime.training import Engine, ForwardFn, LossFn, data_parallel_slice
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.spec.run_files import EVAL_FILE
from megatron_rl.trainers.common import TrainerContext, job_engine, record_eval


def preference_max_length(cfg: JobConfig, shape: ModelShape) -> int:
    """data.max_length (default: the training sequence length), checked against the model's positions."""
    max_length = cfg.data.max_length or cfg.model.seq_length or shape.seq_length
    if max_length > shape.max_position_embeddings:
        raise ConfigError(f"data.max_length={max_length} exceeds {shape.name}'s max_position_embeddings "
                          f"{shape.max_position_embeddings}")
    return max_length


def load_pairs(cfg: JobConfig, shape: ModelShape, *, max_length: int, response_starts: bool = False):
    """(sequence encoder, train pairs, held-out pairs or None) of the job's data section."""
    tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    encoder = SequenceEncoder(tokenizer, ChatFormat.from_config(cfg.data, tokenizer))
    train_data, eval_data = load_preference_splits(cfg.data, encoder, max_length=max_length,
                                                   vocab_size=shape.vocab_size, seed=cfg.run.seed,
                                                   response_starts=response_starts)
    return encoder, train_data, eval_data


def pair_order(num_pairs: int, *, step: int, global_batch_size: int, seed: int) -> list[int]:
    """Indices of the pairs of 1-based ``step``: a seeded permutation per epoch, running on across epoch ends.

    A function of (step, seed) only, so a resumed run sees exactly the pairs it would have seen.
    """
    out: list[int] = []
    position = (step - 1) * global_batch_size
    while len(out) < global_batch_size:
        epoch, offset = divmod(position, num_pairs)
        order = list(range(num_pairs))
        random.Random(f"rm-order:{seed}:{epoch}").shuffle(order)
        take = order[offset:offset + global_batch_size - len(out)]
        out.extend(take)
        position += len(take)
    return out


class PairMicroBatcher:
    """Cuts pair lists into this DP rank's micro-batches (filler pairs of weight 0 complete the last ones);
    subclasses turn one micro-batch of pairs into tensors (``collate``)."""

    def __init__(self, cfg: JobConfig, *, pad_id: int, max_length: int, multiple: Optional[int] = None) -> None:
        """``multiple``: sequence lengths are padded to a multiple of it (default: the TP size under sequence
        parallelism)."""
        par = cfg.parallel
        self.micro_batch_size = par.micro_batch_size
        self.pad_id = pad_id
        self.multiple = multiple or (par.tp if par.sequence_parallel else 1)
        self.fixed_length = padded_length(max_length, multiple=self.multiple) if par.pp > 1 else None

    def collate(self, data: PreferenceData, indices: list[int], weights: list[float], *, longest: int) -> dict:
        """The tensors of one micro-batch, its sequences padded for ``longest`` tokens."""
        raise NotImplementedError

    def micro_batches(self, data: PreferenceData, indices: list[int], *, pad_to: int) -> tuple[list[dict], int]:
        """(micro-batches of this rank, padded sequence length for the schedule). Every micro-batch of every rank
        is padded to the longest sequence of all ``indices``: MoE layers exchange token counts over the
        data-parallel ranks, which must then agree."""
        weights = [1.0] * len(indices)
        while len(indices) % pad_to:
            indices, weights = indices + [indices[0]], weights + [0.0]
        longest = max(len(side[i]) for side in (data.chosen, data.rejected) for i in set(indices))
        items = list(zip(indices, weights))
        batches = [self.collate(data, [i for i, _ in micro], [w for _, w in micro], longest=longest)
                   for micro in data_parallel_slice(items, micro_batch_size=self.micro_batch_size)]
        seq_length = max(b["tokens"].shape[1] for b in batches)
        return batches, seq_length


def whole_split_pad_to(cfg: JobConfig) -> int:
    """Pairs that a pass over a whole split is padded to a multiple of: every DP rank gets whole micro-batches,
    in groups of pp under virtual pipelining (its schedule runs micro-batches in groups of pp)."""
    from megatron.core import parallel_state

    interleaved = cfg.parallel.pp if (cfg.parallel.vpp or 1) > 1 else 1
    return parallel_state.get_data_parallel_world_size() * cfg.parallel.micro_batch_size * interleaved


def evaluate(engine: Engine, batcher: PairMicroBatcher, data: PreferenceData, cfg: JobConfig, loss_fn: LossFn, *,
             forward_fn: ForwardFn, report_names: tuple[str, ...]) -> dict[str, float]:
    """Metrics over every held-out pair (exactly: filler pairs carry weight 0)."""
    batches, seq_length = batcher.micro_batches(data, list(range(len(data))), pad_to=whole_split_pad_to(cfg))
    engine.train(False)
    try:
        return engine.forward_only(batches, loss_fn, seq_length=seq_length, report_names=report_names,
                                   forward_fn=forward_fn)
    finally:
        engine.train(True)


def log_data_counts(ctx: TrainerContext, train_data: PreferenceData, eval_data: Optional[PreferenceData], *,
                    max_length: int) -> None:
    counts = {"train_pairs": len(train_data), "train_truncated": train_data.num_truncated,
              "train_dropped": train_data.num_dropped}
    if eval_data is not None:
        counts.update(eval_pairs=len(eval_data), eval_truncated=eval_data.num_truncated,
                      eval_dropped=eval_data.num_dropped)
    ctx.logger.log(0, counts, phase="data")
    ctx.say(f"preference data (max_length {max_length}, policy {ctx.cfg.data.truncation}): "
            + "; ".join(f"{d.name}: {len(d)} pairs of {d.num_read} read, {d.num_truncated} truncated, "
                        f"{d.num_dropped} dropped" for d in (train_data, eval_data) if d is not None))


def train_on_pairs(ctx: TrainerContext, engine: Engine, batcher: PairMicroBatcher, train_data: PreferenceData,
                   eval_data: Optional[PreferenceData], loss_fn: LossFn, *, start: int, max_length: int,
                   forward_fn: ForwardFn, report_names: tuple[str, ...]) -> None:
    """Steps ``start + 1 .. run.steps`` over the train pairs (held-out evaluations between), then the final save."""
    cfg = ctx.cfg
    gbs, interval = cfg.algorithm.global_batch_size, cfg.data.eval_interval

    def log_eval(step: int) -> None:
        ctx.logger.log(step, evaluate(engine, batcher, eval_data, cfg, loss_fn, forward_fn=forward_fn,
                                      report_names=report_names), phase="eval")

    if start == 0:
        ctx.logger.truncate_after(-1)  # a fresh start also rewrites the step-0 data/eval lines
        log_data_counts(ctx, train_data, eval_data, max_length=max_length)
        if eval_data is not None and interval:
            log_eval(0)
    for step in range(start + 1, cfg.run.steps + 1):
        with ctx.timer() as timer:
            indices = pair_order(len(train_data), step=step, global_batch_size=gbs, seed=cfg.run.seed)
            batches, padded = batcher.micro_batches(train_data, indices, pad_to=1)
            metrics = engine.train_step(batches, loss_fn, seq_length=padded, report_names=report_names,
                                        forward_fn=forward_fn)
        metrics["step_time_s"] = timer.seconds
        metrics["pairs_per_s"] = gbs / timer.seconds
        if eval_data is not None and interval and (step % interval == 0 or step == cfg.run.steps):
            log_eval(step)
        ctx.end_step(engine, step, metrics)
    ctx.finish(engine)


def collate_pairs(chosen: list[list[int]], rejected: list[list[int]], weights: list[float], *, pad_id: int,
                  fixed_length: Optional[int], multiple: int, longest: Optional[int] = None) -> dict:
    seqs = chosen + rejected
    length = padded_length(longest or max(len(s) for s in seqs), fixed=fixed_length, multiple=multiple)
    batch = right_padded_batch(seqs, pad_id=pad_id, length=length)
    weight = torch.tensor(weights, dtype=torch.float32)
    batch["pair_weight"] = weight.cuda() if torch.cuda.is_available() else weight
    return batch


class RewardPairBatcher(PairMicroBatcher):
    """Reward-model micro-batches: tokens, position_ids, last_index (the reward's position) and pair_weight."""

    def collate(self, data: PreferenceData, indices: list[int], weights: list[float], *, longest: int) -> dict:
        return collate_pairs([data.chosen[i] for i in indices], [data.rejected[i] for i in indices], weights,
                             pad_id=self.pad_id, fixed_length=self.fixed_length, multiple=self.multiple,
                             longest=longest)


def is_reward_model(checkpoint: str) -> bool:
    """Whether ``checkpoint`` was saved by the rm trainer (its common state carries the reward-model metadata)."""
    try:
        read_reward_model_metadata(checkpoint)
    except ConfigError:
        return False
    return True


def evaluate_reward_model(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    """The eval trainer on a reward-model checkpoint (``model.init_from``): held-out pair accuracy (the rm
    trainer's own evaluation, phase "eval") as its eval.json entry: {"accuracy", "reward_margin", "n_pairs", "checkpoint", "kept"}."""
    max_length = preference_max_length(cfg, shape)
    encoder, _, held_out_pairs = load_pairs(cfg, shape, max_length=max_length)
    if held_out_pairs is None:
        raise ConfigError("evaluating a reward model needs held-out preference pairs: set data.eval_path, or a "
                          "synthetic prefer_* data.task")
    engine = job_engine(cfg, shape, dims=ctx.dims, build_chunks=build_reward_model_chunks)
    load_reward_model_weights(cfg.model.init_from, engine.chunks)
    batcher = RewardPairBatcher(cfg, pad_id=encoder.pad_id, max_length=max_length)
    algo = cfg.algorithm
    metrics = evaluate(engine, batcher, held_out_pairs, cfg, lambda rewards, batch: preference_loss(
        rewards, batch, margin=algo.rm_margin, centering_coef=algo.rm_centering_coef), forward_fn=reward_forward,
        report_names=RM_REPORTS)
    stage = cfg.eval.stage or cfg.run.name
    entry = {"accuracy": metrics["accuracy"], "reward_margin": metrics["reward_margin"],
             "n_pairs": len(held_out_pairs), "checkpoint": str(cfg.model.init_from), "kept": True}
    if ctx.rank == 0:
        record_eval(Path(cfg.run.dir) / EVAL_FILE, stage, entry)
        ctx.logger.log(0, metrics, phase="eval", total=0)
    ctx.logger.close()
    ctx.say(f"{'stage':<12} {'accuracy':>8} {'margin':>8} {'pairs':>7}\n"
            f"{stage:<12} {entry['accuracy']:>8.3f} {entry['reward_margin']:>8.3f} {entry['n_pairs']:>7d}")
