"""The Megatron training engine shared by every trainer: model chunks in DDP, optimizer, LR schedule, one step.

A trainer supplies micro-batches and a loss function; ``Engine.train_step`` runs them through Megatron's
forward-backward schedule (so TP/PP/VPP/CP/DP all apply) and takes one optimizer step.

Loss functions return ``(loss_sum, denominator, report)``. Megatron sums ``loss_sum`` over micro-batches and
data-parallel ranks and divides the gradients by the summed ``denominator`` (``calculate_per_token_loss``),
so a loss is normalised over the global batch exactly, whatever the layout: token count for a token mean,
sequence count for a sequence mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Optional

import torch

from launcher.config.schema import JobConfig
from launcher.model_shape import ModelShape
from megatron_rl.models.builder import ModelOptions, build_model_chunks, compute_dtype, padded_vocab_size

# loss_fn(model_output, batch) -> (loss_sum, denominator as an int tensor, {name: (sum, count)})
LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]]
# forward_fn(model_chunk, batch) -> model output (per-token loss, logits, rewards, or hidden states between stages)
ForwardFn = Callable[[Any, dict], torch.Tensor]


def lm_forward(model, batch: dict) -> torch.Tensor:
    """GPTModel forward: per-token cross entropy when the batch has labels, else (vocab-parallel) logits."""
    return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch.get("labels"))


def model_options(cfg: JobConfig, shape: ModelShape) -> ModelOptions:
    par = cfg.parallel
    return ModelOptions(
        tp=par.tp, pp=par.pp, vpp=par.vpp, cp=par.cp, ep=par.ep, sequence_parallel=par.sequence_parallel,
        recompute=par.recompute, dtype=compute_dtype(cfg.model.dtype),
        seq_length=cfg.model.seq_length or shape.seq_length, init_seed=cfg.run.seed)


@dataclass
class Engine:
    """Model chunks, optimizer and schedule of one rank, plus the sizes the schedule needs."""

    shape: ModelShape
    opts: ModelOptions
    chunks: list
    optimizer: Any
    scheduler: Any
    micro_batch_size: int
    make_optimizer: Callable[[list], tuple[Any, Any]]
    step: int = 0

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.shape.vocab_size, self.opts.tp)

    def train_step(self, microbatches: list[dict], loss_fn: LossFn, *, seq_length: int,
                   report_names: tuple[str, ...], forward_fn: ForwardFn = lm_forward) -> dict[str, float]:
        """Forward-backward over ``microbatches`` (this DP rank's share) and one optimizer step."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_fn=loss_fn, forward_fn=forward_fn),
            data_iterator=self._iterators(microbatches), model=self.chunks,
            num_microbatches=len(microbatches), seq_length=seq_length,
            micro_batch_size=self.micro_batch_size, forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.step += 1
        metrics = reduce_reports(reports, report_names)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def forward_only(self, microbatches: list[dict], loss_fn: LossFn, *, seq_length: int,
                     report_names: tuple[str, ...], forward_fn: ForwardFn = lm_forward) -> dict[str, float]:
        """Forward pass through the schedule without gradients (evaluation)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        with torch.no_grad():
            reports = get_forward_backward_func()(
                forward_step_func=partial(_forward_step, loss_fn=loss_fn, forward_fn=forward_fn),
                data_iterator=self._iterators(microbatches), model=self.chunks,
                num_microbatches=len(microbatches), seq_length=seq_length,
                micro_batch_size=self.micro_batch_size, forward_only=True)
        return reduce_reports(reports, report_names)

    def _iterators(self, microbatches: list[dict]):
        if len(self.chunks) == 1:
            return iter(microbatches)
        return [iter(microbatches) for _ in self.chunks]

    def reset_optimizer_schedule(self) -> None:
        """A fresh optimizer and LR schedule on the current weights (a new training stage starts at step 0)."""
        self.optimizer, self.scheduler = self.make_optimizer(self.chunks)
        self.step = 0

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)


def _forward_step(data_iterator: Iterable[dict], model, *, loss_fn: LossFn, forward_fn: ForwardFn):
    batch = next(data_iterator)
    return forward_fn(model, batch), partial(loss_fn, batch=batch)


def reduce_reports(reports: list[dict], names: tuple[str, ...]) -> dict[str, float]:
    """Reduce each reported (value, count) over micro-batches and data-parallel ranks; every rank gets the result.

    Names ending in ``_min`` / ``_max`` are minimum / maximum of the values; the others are sum / count.
    Only the last pipeline stage computes losses, so the results are then shared along the pipeline.
    """
    from megatron.core import parallel_state

    groups = (parallel_state.get_data_parallel_group(with_context_parallel=True),
              parallel_state.get_pipeline_model_parallel_group())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mean_names = [n for n in names if not n.endswith(("_min", "_max"))]
    sums = torch.zeros(2 * len(mean_names), dtype=torch.float64, device=device)
    extremes = {n: [] for n in names if n.endswith(("_min", "_max"))}
    for report in reports:
        for i, name in enumerate(mean_names):
            total, count = report[name]
            sums[2 * i] += total.detach().double().sum()
            sums[2 * i + 1] += count.detach().double().sum() if torch.is_tensor(count) else count
        for name, values in extremes.items():
            values.append(report[name][0].detach().double().reshape(()))
    for group in groups:
        torch.distributed.all_reduce(sums, group=group)
    result = {name: float(sums[2 * i] / sums[2 * i + 1]) if sums[2 * i + 1] else float("nan")
              for i, name in enumerate(mean_names)}
    for name, values in extremes.items():
        is_max = name.endswith("_max")
        fallback = torch.tensor(-math.inf if is_max else math.inf, dtype=torch.float64, device=device)
        value = torch.stack(values).max() if is_max and values else torch.stack(values).min() if values else fallback
        value = value.clone()
        for group in groups:
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX if is_max
                                         else torch.distributed.ReduceOp.MIN, group=group)
        result[name] = float(value)
    return {name: result[name] for name in names}


def build_engine(cfg: JobConfig, shape: ModelShape, *, total_steps: Optional[int] = None,
                 lr: Optional[float] = None,
                 build_chunks: Callable[[ModelShape, ModelOptions], list] = build_model_chunks) -> Engine:
    """Model chunks wrapped in Megatron DDP, Megatron's (distributed) optimizer and its LR/WD schedule.

    ``build_chunks`` makes this rank's model chunks (default: the GPT policy; the RM trainer passes its own).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opts = model_options(cfg, shape)
    chunks = build_chunks(shape, opts)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer)
    wrapped = []
    for i, chunk in enumerate(chunks):
        chunk.config.calculate_per_token_loss = True
        chunk.config.finalize_model_grads_func = finalize_model_grads
        wrapped.append(DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                               disable_bucketing=i > 0))
    optim = cfg.optimizer
    peak_lr = optim.lr if lr is None else lr
    steps = total_steps or cfg.run.steps

    def make_optimizer(model_chunks: list):
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=peak_lr, min_lr=min(optim.min_lr, peak_lr), weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad, bf16=opts.dtype == torch.bfloat16, fp16=opts.dtype == torch.float16,
                params_dtype=opts.dtype, use_distributed_optimizer=cfg.parallel.distributed_optimizer),
            model_chunks)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if optim.lr_warmup_steps else peak_lr, max_lr=peak_lr,
            min_lr=min(optim.min_lr, peak_lr), lr_warmup_steps=optim.lr_warmup_steps,
            lr_decay_steps=max(steps, optim.lr_warmup_steps + 1), lr_decay_style=optim.lr_decay_style,
            start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=max(steps, 1),
            wd_incr_style="constant")
        return optimizer, scheduler

    optimizer, scheduler = make_optimizer(wrapped)
    return Engine(shape=shape, opts=opts, chunks=wrapped, optimizer=optimizer, scheduler=scheduler,
                  micro_batch_size=cfg.parallel.micro_batch_size, make_optimizer=make_optimizer)


def data_parallel_slice(items: list, *, micro_batch_size: int) -> list[list]:
    """This DP rank's share of a global batch, cut into micro-batches (every rank sees the same global list)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    if len(items) % (dp * micro_batch_size):
        raise ValueError(f"global batch {len(items)} is not divisible by dp={dp} x micro_batch_size={micro_batch_size}")
    per_rank = len(items) // dp
    mine = items[rank * per_rank:(rank + 1) * per_rank]
    return [mine[i:i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
