"""Next-token-prediction training on a synthetic corpus: the smallest real Megatron job.

Run: ``python launch.py algorithm.name=pretrain run.steps=20`` (2 local processes on CPU by default).
Each sequence is an arithmetic progression of token ids with a random start and stride
(``megatron_rl.data.batches.progression_batch``), so the model can learn it and the loss falls well below
ln(vocab) within a few dozen steps.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.lm_loss import LM_REPORTS, lm_loss
from megatron_rl.data.batches import collate_lm, progression_batch
from megatron_rl.runtime.training import Engine, data_parallel_slice
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.trainers.common import TrainerContext, job_engine


def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    engine: Engine = job_engine(cfg, shape, dims=ctx.dims)
    seq_length = cfg.model.seq_length or shape.seq_length
    start = ctx.resume(engine)
    for step in range(start + 1, cfg.run.steps + 1):
        with ctx.timer() as timer:
            rows = progression_batch(seed=cfg.run.seed, step=step, batch_size=cfg.algorithm.global_batch_size,
                                     seq_length=seq_length, vocab_size=shape.vocab_size)
            micro = data_parallel_slice(list(rows), micro_batch_size=cfg.parallel.micro_batch_size)
            batches = [collate_lm(torch.stack(mb)) for mb in micro]
            metrics = engine.train_step(batches, lm_loss, seq_length=seq_length, report_names=LM_REPORTS)
        metrics["step_time_s"] = timer.seconds
        metrics["tokens_per_s"] = cfg.algorithm.global_batch_size * seq_length / timer.seconds
        ctx.end_step(engine, step, metrics)
    ctx.finish(engine)
