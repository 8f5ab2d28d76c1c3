"""Reward-model training (Bradley-Terry) on Megatron Core: TP/PP/DP, checkpoints, requeue, held-out evaluation.

Run the tiny CPU task (held-out accuracy from ~0.5 to >= 0.9):
    .venv/bin/python launch.py --config configs/rm_tiny.yaml
Own data: ``algorithm.name=rm data.train_path=pairs.jsonl data.eval_path=held_out.jsonl model.init_from=CKPT``.

Batch sizes count PAIRS: ``algorithm.global_batch_size`` pairs per optimizer step, ``parallel.micro_batch_size``
pairs per micro-batch. A micro-batch holds 2 x micro_batch_size sequences, the chosen ones then the rejected
ones, right-padded (to the longest, or to ``data.max_length`` when pipeline stages need fixed shapes).

Loss per pair: ``-log sigmoid(r_c - r_r - algorithm.rm_margin) + algorithm.rm_centering_coef * (r_c + r_r)^2``,
averaged over the global batch. Metrics (train, and phase "eval" on the held-out split every
``data.eval_interval`` steps, at step 0 and at the end): loss, bt_loss, accuracy (r_c > r_r; ties are wrong),
reward_margin (mean r_c - r_r), reward_chosen, reward_rejected. Data counts are logged once as phase "data".

The checkpoint's common state carries ``extra["reward_model"]`` (model shape, tokenizer, max_length), which
``megatron_rl.rewards.reward_model_scorer.RewardModelScorer`` reads to rebuild the model in a GRPO job.
Test: `.venv/bin/python -m pytest tests/test_rm.py -q`
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from launcher.config.schema import JobConfig
from launcher.errors import ConfigError
from launcher.model_shape import ModelShape
from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.preferences import PreferenceData, SequenceEncoder, load_preference_splits
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.models.reward_model import (
    build_reward_model_chunks,
    load_reward_model_weights,
    padded_length,
    reward_forward,
    right_padded_batch,
)
from megatron_rl.runtime.training import Engine, build_engine, data_parallel_slice
from megatron_rl.trainers.common import TrainerContext

REPORTS = ("loss", "bt_loss", "accuracy", "reward_margin", "reward_chosen", "reward_rejected")
METADATA_VERSION = 1


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


def collate_pairs(chosen: list[list[int]], rejected: list[list[int]], weights: list[float], *, pad_id: int,
                  fixed_length: Optional[int], multiple: int) -> dict:
    seqs = chosen + rejected
    length = padded_length(max(len(s) for s in seqs), fixed=fixed_length, multiple=multiple)
    batch = right_padded_batch(seqs, pad_id=pad_id, length=length)
    weight = torch.tensor(weights, dtype=torch.float32)
    batch["pair_weight"] = weight.cuda() if torch.cuda.is_available() else weight
    return batch


class PairBatcher:
    """Cuts pair lists into this DP rank's micro-batches (filler pairs of weight 0 complete the last ones)."""

    def __init__(self, cfg: JobConfig, *, pad_id: int, max_length: int) -> None:
        par = cfg.parallel
        self.micro_batch_size = par.micro_batch_size
        self.pad_id = pad_id
        self.multiple = par.tp if par.sequence_parallel else 1
        self.fixed_length = padded_length(max_length, multiple=self.multiple) if par.pp > 1 else None

    def micro_batches(self, data: PreferenceData, indices: list[int], *, pad_to: int) -> tuple[list[dict], int]:
        """(micro-batches of this rank, padded sequence length for the schedule)."""
        weights = [1.0] * len(indices)
        while len(indices) % pad_to:
            indices, weights = indices + [indices[0]], weights + [0.0]
        items = list(zip(indices, weights))
        batches = []
        for micro in data_parallel_slice(items, micro_batch_size=self.micro_batch_size):
            batches.append(collate_pairs([data.chosen[i] for i, _ in micro], [data.rejected[i] for i, _ in micro],
                                         [w for _, w in micro], pad_id=self.pad_id, fixed_length=self.fixed_length,
                                         multiple=self.multiple))
        seq_length = max(b["tokens"].shape[1] for b in batches)
        return batches, seq_length


def reward_model_metadata(cfg: JobConfig, shape: ModelShape, *, max_length: int) -> dict:
    """What a scorer needs to rebuild this reward model: stored in every checkpoint's common state."""
    tokenizer = cfg.model.tokenizer
    if tokenizer is not None and Path(tokenizer).is_dir():
        tokenizer = str(Path(tokenizer).resolve())
    return {"version": METADATA_VERSION, "shape": shape.to_dict(), "tokenizer": tokenizer, "max_length": max_length,
            "trust_remote_code": cfg.model.trust_remote_code, "chat_template": cfg.data.chat_template,
            "system_prompt": cfg.data.system_prompt}


def resume_or_init(cfg: JobConfig, ctx: TrainerContext, engine: Engine) -> int:
    """Resume this run's newest checkpoint; else load model.init_from (policy: trunk only, head fresh); else 0."""

    def load_init(path: str, chunks: list) -> str:
        head_loaded = load_reward_model_weights(path, chunks)
        return "reward model, head included" if head_loaded else "trunk only; rm_head freshly initialised"

    return ctx.resume(engine, load_init=load_init)


def evaluate(engine: Engine, batcher: PairBatcher, data: PreferenceData, cfg: JobConfig, loss_fn) -> dict[str, float]:
    """Metrics over every held-out pair (exactly: filler pairs carry weight 0)."""
    from megatron.core import parallel_state

    interleaved = cfg.parallel.pp if (cfg.parallel.vpp or 1) > 1 else 1  # micro-batches run in groups of pp
    pad_to = parallel_state.get_data_parallel_world_size() * cfg.parallel.micro_batch_size * interleaved
    batches, seq_length = batcher.micro_batches(data, list(range(len(data))), pad_to=pad_to)
    engine.train(False)
    try:
        return engine.forward_only(batches, loss_fn, seq_length=seq_length, report_names=REPORTS,
                                   forward_fn=reward_forward)
    finally:
        engine.train(True)


def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    if cfg.parallel.cp > 1:
        raise ConfigError(f"parallel.cp={cfg.parallel.cp}: the rm trainer does not support context parallelism yet; "
                          "set parallel.cp=1")
    seq_length = cfg.model.seq_length or shape.seq_length
    max_length = cfg.data.max_length or seq_length
    if max_length > shape.max_position_embeddings:
        raise ConfigError(f"data.max_length={max_length} exceeds {shape.name}'s max_position_embeddings "
                          f"{shape.max_position_embeddings}")
    tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    encoder = SequenceEncoder(tokenizer, ChatFormat.from_config(cfg.data, tokenizer))
    train_data, eval_data = load_preference_splits(cfg.data, encoder, max_length=max_length,
                                                   vocab_size=shape.vocab_size, seed=cfg.run.seed)
    engine = build_engine(cfg, shape, build_chunks=build_reward_model_chunks)
    engine.micro_batch_size = 2 * cfg.parallel.micro_batch_size  # sequences per micro-batch: chosen + rejected
    metadata = reward_model_metadata(cfg, shape, max_length=max_length)
    ctx.extra_state = lambda: {"reward_model": metadata}
    batcher = PairBatcher(cfg, pad_id=encoder.pad_id, max_length=max_length)
    algo = cfg.algorithm

    def loss_fn(rewards, batch):
        return preference_loss(rewards, batch, margin=algo.rm_margin, centering_coef=algo.rm_centering_coef)

    interval = cfg.data.eval_interval
    start = resume_or_init(cfg, ctx, engine)
    if start == 0:
        ctx.logger.truncate_after(-1)  # a fresh start also rewrites the step-0 data/eval lines
        counts = {"train_pairs": len(train_data), "train_truncated": train_data.num_truncated,
                  "train_dropped": train_data.num_dropped}
        if eval_data is not None:
            counts.update(eval_pairs=len(eval_data), eval_truncated=eval_data.num_truncated,
                          eval_dropped=eval_data.num_dropped)
        ctx.logger.log(0, counts, phase="data")
        ctx.say(f"preference data (max_length {max_length}, policy {cfg.data.truncation}): "
                + "; ".join(f"{d.name}: {len(d)} pairs of {d.num_read} read, {d.num_truncated} truncated, "
                            f"{d.num_dropped} dropped" for d in (train_data, eval_data) if d is not None))
        if eval_data is not None and interval:
            ctx.logger.log(0, evaluate(engine, batcher, eval_data, cfg, loss_fn), phase="eval")
    for step in range(start + 1, cfg.run.steps + 1):
        with ctx.timer() as timer:
            indices = pair_order(len(train_data), step=step, global_batch_size=algo.global_batch_size,
                                 seed=cfg.run.seed)
            batches, padded = batcher.micro_batches(train_data, indices, pad_to=1)
            metrics = engine.train_step(batches, loss_fn, seq_length=padded, report_names=REPORTS,
                                        forward_fn=reward_forward)
        metrics["step_time_s"] = timer.seconds
        metrics["pairs_per_s"] = algo.global_batch_size / timer.seconds
        if eval_data is not None and interval and (step % interval == 0 or step == cfg.run.steps):
            ctx.logger.log(step, evaluate(engine, batcher, eval_data, cfg, loss_fn), phase="eval")
        ctx.end_step(engine, step, metrics)
    ctx.finish(engine)
