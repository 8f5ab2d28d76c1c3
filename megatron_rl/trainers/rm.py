"""Reward-model training (Bradley-Terry) on Megatron Core: TP/PP/DP, checkpoints, requeue, held-out evaluation.

Run the tiny CPU task (held-out accuracy from ~0.5 to >= 0.9):
    .venv/bin/python launch.py --config configs/rm_tiny.yaml
Own data: ``algorithm.name=rm data.train_path=pairs.jsonl data.eval_path=held_out.jsonl model.init_from=CKPT``.

Batching (batch sizes count PAIRS; a micro-batch holds the chosen sequences then the rejected ones, right-padded),
the loop and the held-out evaluation are shared with DPO (``megatron_rl.trainers.pairs``); the loss is ``megatron_rl.algorithms.reward_model``'s.

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

from megatron_rl.algorithms.reward_model import RM_REPORTS, preference_loss
from megatron_rl.models.reward_model import build_reward_model_chunks, load_reward_model_weights, reward_forward
from megatron_rl.runtime.training import Engine
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.trainers import pairs
from megatron_rl.trainers.common import TrainerContext, job_engine
from megatron_rl.trainers.pairs import RewardPairBatcher

METADATA_VERSION = 1


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


def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    if cfg.parallel.cp > 1:
        raise ConfigError(f"parallel.cp={cfg.parallel.cp}: the rm trainer does not support context parallelism yet; "
                          "set parallel.cp=1")
    max_length = pairs.preference_max_length(cfg, shape)
    encoder, train_data, eval_data = pairs.load_pairs(cfg, shape, max_length=max_length)
    engine = job_engine(cfg, shape, dims=ctx.dims, build_chunks=build_reward_model_chunks)
    metadata = reward_model_metadata(cfg, shape, max_length=max_length)
    ctx.extra_state = lambda: {"reward_model": metadata}
    batcher = RewardPairBatcher(cfg, pad_id=encoder.pad_id, max_length=max_length)
    algo = cfg.algorithm

    def loss_fn(rewards, batch):
        return preference_loss(rewards, batch, margin=algo.rm_margin, centering_coef=algo.rm_centering_coef)

    start = resume_or_init(cfg, ctx, engine)
    pairs.train_on_pairs(ctx, engine, batcher, train_data, eval_data, loss_fn, start=start, max_length=max_length,
                         forward_fn=reward_forward, report_names=RM_REPORTS)
