"""Reward-model training (Bradley-Terry) on Megatron Core: TP/PP/DP, checkpoints, requeue, held-out evaluation.

Run the tiny CPU task (held-out accuracy from ~0.5 to >= 0.9):
    .venv/bin/python launch.py --config configs/rm_tiny.yaml
Own data: ``algorithm.name=rm data.train_path=pairs.jsonl data.eval_path=held_out.jsonl model.init_from=CKPT``.

Batching (batch sizes count PAIRS; a micro-batch holds the chosen sequences then the rejected ones, right-padded),
the loop and the held-out evaluation are shared with DPO (``megatron_rl.trainers.pairs``).

Loss per pair: ``-log sigmoid(r_c - r_r - algorithm.rm_margin) + algorithm.rm_centering_coef * (r_c + r_r)^2``,
averaged over the global batch. Metrics (train, and phase "eval" on the held-out split every
``data.eval_interval`` steps, at step 0 and at the end): loss, bt_loss, accuracy (r_c > r_r; ties are wrong),
reward_margin (mean r_c - r_r), reward_chosen, reward_rejected. Data counts are logged once as phase "data".

The checkpoint's common state carries ``extra["reward_model"]`` (model shape, tokenizer, max_length), which
``megatron_rl.rewards.reward_model_scorer.RewardModelScorer`` reads to rebuild the model in a GRPO job.
Test: `.venv/bin/python -m pytest tests/test_rm.py -q`
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_rl.data.preferences import PreferenceData
from megatron_rl.models.reward_model import (
    build_reward_model_chunks,
    load_reward_model_weights,
    padded_length,
    reward_forward,
    right_padded_batch,
)
from megatron_rl.runtime.training import Engine, build_engine
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.trainers import pairs
from megatron_rl.trainers.common import TrainerContext
from megatron_rl.trainers.pairs import PairMicroBatcher, pair_order  # noqa: F401  (pair_order: rm's public name)

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


def collate_pairs(chosen: list[list[int]], rejected: list[list[int]], weights: list[float], *, pad_id: int,
                  fixed_length: Optional[int], multiple: int, longest: Optional[int] = None) -> dict:
    seqs = chosen + rejected
    length = padded_length(longest or max(len(s) for s in seqs), fixed=fixed_length, multiple=multiple)
    batch = right_padded_batch(seqs, pad_id=pad_id, length=length)
    weight = torch.tensor(weights, dtype=torch.float32)
    batch["pair_weight"] = weight.cuda() if torch.cuda.is_available() else weight
    return batch


class PairBatcher(PairMicroBatcher):
    """Reward-model micro-batches: tokens, position_ids, last_index (the reward's position) and pair_weight."""

    def collate(self, data: PreferenceData, indices: list[int], weights: list[float], *, longest: int) -> dict:
        return collate_pairs([data.chosen[i] for i in indices], [data.rejected[i] for i in indices], weights,
                             pad_id=self.pad_id, fixed_length=self.fixed_length, multiple=self.multiple,
                             longest=longest)


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
    return pairs.evaluate(engine, batcher, data, cfg, loss_fn, forward_fn=reward_forward, report_names=REPORTS)


def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    if cfg.parallel.cp > 1:
        raise ConfigError(f"parallel.cp={cfg.parallel.cp}: the rm trainer does not support context parallelism yet; "
                          "set parallel.cp=1")
    max_length = pairs.preference_max_length(cfg, shape)
    encoder, train_data, eval_data = pairs.load_pairs(cfg, shape, max_length=max_length)
    engine = build_engine(cfg, shape, build_chunks=build_reward_model_chunks)
    metadata = reward_model_metadata(cfg, shape, max_length=max_length)
    ctx.extra_state = lambda: {"reward_model": metadata}
    batcher = PairBatcher(cfg, pad_id=encoder.pad_id, max_length=max_length)
    algo = cfg.algorithm

    def loss_fn(rewards, batch):
        return preference_loss(rewards, batch, margin=algo.rm_margin, centering_coef=algo.rm_centering_coef)

    start = resume_or_init(cfg, ctx, engine)
    pairs.train_on_pairs(ctx, engine, batcher, train_data, eval_data, loss_fn, start=start, max_length=max_length,
                         forward_fn=reward_forward, report_names=REPORTS)
