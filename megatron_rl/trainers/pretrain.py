"""Next-token-prediction training on a synthetic corpus: the smallest real Megatron job.

Run: ``python launch.py algorithm.name=pretrain run.steps=20`` (2 local processes on CPU by default).
Each sequence is an arithmetic progression of token ids with a random start and stride, so the model can
learn it and the loss falls well below ln(vocab) within a few dozen steps.
"""

from __future__ import annotations

import torch

from megatron_rl.runtime.training import Engine, build_engine, data_parallel_slice
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.trainers.common import TrainerContext

REPORTS = ("loss",)


def progression_batch(*, seed: int, step: int, batch_size: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """[batch, seq_length + 1] token ids: (start + stride * i) mod vocab, identical on every rank."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 8, (batch_size, 1), generator=gen)
    return (start + stride * torch.arange(seq_length + 1)) % vocab_size


def lm_batch(rows: torch.Tensor, row_mask: torch.Tensor) -> dict:
    """A next-token micro-batch from full rows: inputs rows[:, :-1], labels rows[:, 1:]; ``row_mask`` says which
    row tokens are targets (it is shifted onto the label positions)."""
    tokens = rows[:, :-1].contiguous()
    batch = {"tokens": tokens, "labels": rows[:, 1:].contiguous(), "loss_mask": row_mask[:, 1:].float().contiguous(),
             "position_ids": torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens).contiguous()}
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    return batch


def collate_lm(rows: torch.Tensor) -> dict:
    """A micro-batch where every token after the first is a target."""
    return lm_batch(rows, torch.ones_like(rows, dtype=torch.float32))


def lm_loss(per_token_loss: torch.Tensor, batch: dict):
    """Token-mean cross entropy over the global batch (Megatron divides by the summed token count)."""
    mask = batch["loss_mask"]
    loss_sum = (per_token_loss.float() * mask).sum()
    count = mask.sum().to(torch.int)
    return loss_sum, count, {"loss": (loss_sum.detach(), count)}


def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    engine: Engine = build_engine(cfg, shape)
    seq_length = cfg.model.seq_length or shape.seq_length
    start = ctx.resume(engine)
    for step in range(start + 1, cfg.run.steps + 1):
        with ctx.timer() as timer:
            rows = progression_batch(seed=cfg.run.seed, step=step, batch_size=cfg.algorithm.global_batch_size,
                                     seq_length=seq_length, vocab_size=shape.vocab_size)
            micro = data_parallel_slice(list(rows), micro_batch_size=cfg.parallel.micro_batch_size)
            batches = [collate_lm(torch.stack(mb)) for mb in micro]
            metrics = engine.train_step(batches, lm_loss, seq_length=seq_length, report_names=REPORTS)
        metrics["step_time_s"] = timer.seconds
        metrics["tokens_per_s"] = cfg.algorithm.global_batch_size * seq_length / timer.seconds
        ctx.end_step(engine, step, metrics)
    ctx.finish(engine)
