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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_rl.algorithms.lm_loss import LM_REPORTS, lm_loss
from megatron_rl.data.batches import collate_sft
from megatron_rl.models.builder import (
    ModelOptions,
    build_model_chunks,
    compute_dtype,
    padded_vocab_size,
    resolve_transformer_engine,
)
from megatron_rl.models.packed_sequences import packed_forward_kwargs
from megatron_rl.runtime.distributed import collective_device
from megatron_rl.runtime.memory import peak_memory_of
from megatron_rl.runtime.phases import HostOffload
from megatron_rl.spec.config.schema import ModelConfig, OptimizerConfig, ParallelConfig, RuntimeConfig
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.spec.parallel import ParallelDims

# loss_fn(model_output, batch) -> (loss_sum, denominator as an int tensor, {name: (sum, count)})
LossFn = Callable[[torch.Tensor, Mapping], tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]]
# forward_fn(model_chunk, batch) -> model output (per-token loss, logits, rewards, or hidden states between stages)
ForwardFn = Callable[[Any, Mapping], torch.Tensor]


def lm_forward(model, batch: Mapping) -> torch.Tensor:
    """GPTModel forward: per-token cross entropy when the batch has labels, else (vocab-parallel) logits."""
    return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch.get("labels"),
                 **packed_forward_kwargs(batch))


def logits_forward(model, batch: Mapping) -> torch.Tensor:
    """Vocab-parallel logits [batch, seq, vocab/tp], even when the batch has labels (for losses that need
    log-probs and entropy rather than Megatron's cross entropy)."""
    return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), **packed_forward_kwargs(batch))


def rows_per_microbatch(microbatches: list[Mapping]) -> int:
    """The micro-batch size Megatron's schedule sizes its pipeline messages by: rows of a padded micro-batch,
    1 for a packed one (its rows are one sequence of T tokens)."""
    return microbatches[0]["tokens"].shape[0]


def logprob_collector(sink: list):
    """A forward-only 'loss' that appends each micro-batch's per-token log-probs of its labels to ``sink``.

    Only the last pipeline stage computes losses, so only there does ``sink`` fill.
    """
    from megatron_rl.models.cp_attention import gather_from_cp
    from megatron_rl.models.logprobs import vocab_parallel_logprobs
    from megatron_rl.models.packed_sequences import as_rows

    def loss_fn(logits: torch.Tensor, batch: Mapping):
        logprobs = as_rows(vocab_parallel_logprobs(logits, batch["labels"]).detach().float(), batch)
        sink.append(gather_from_cp(logprobs, seq_dim=1))  # whole sequences again under context parallelism
        zero = torch.zeros((), dtype=torch.float32, device=logits.device)
        return zero, torch.ones((), dtype=torch.int, device=logits.device), {}

    return loss_fn


def forward_logprobs(chunks: list, microbatches: list[Mapping], *, seq_length: int) -> list[torch.Tensor]:
    """Per-token log-probs [mbs, seq_length] of each micro-batch's ``labels`` under ``chunks`` (a packed
    micro-batch's as [rows, L]: ``megatron_rl.models.packed_sequences.as_rows``): a forward-only
    pass through Megatron's schedule (so TP/PP/VPP apply), in eval mode, without gradients. The log-probs are
    Megatron's vocab-parallel cross entropy over the padded vocabulary, exactly as in the training loss.

    Returns one tensor per micro-batch on the last pipeline stage and an empty list on the other stages.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.models.router_replay import routes_released

    sink: list[torch.Tensor] = []
    was_training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        with torch.no_grad(), routes_released(chunks):
            get_forward_backward_func()(
                forward_step_func=partial(_forward_step, loss_fn=logprob_collector(sink), forward_fn=logits_forward),
                data_iterator=_data_iterators(chunks, microbatches), model=chunks,
                num_microbatches=len(microbatches), seq_length=seq_length,
                micro_batch_size=rows_per_microbatch(microbatches), forward_only=True)
    finally:
        for chunk, mode in zip(chunks, was_training):
            chunk.train(mode)
    return sink


def sequence_logprobs(chunks, tokens: torch.Tensor, *, micro_batch_size: Optional[int] = None) -> torch.Tensor:
    """``[B, S - 1]`` float32 log-probs of ``tokens[:, 1:]`` (right padding allowed; the caller masks it), on
    every rank of the model replica: ``forward_logprobs`` over whole sequences, shared along the pipeline.

    The same path gives the GRPO trainer its reference log-probs; tests and the GPU check use it as the
    training-forward side when they check generation's log-probs. ``micro_batch_size`` splits the batch
    (default: all at once, or pp micro-batches under virtual pipelining, whose schedule needs at least pp).
    """
    from megatron.core import parallel_state as ps

    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    device = next(chunks[0].parameters()).device
    tokens = tokens.to(device=device, dtype=torch.long)
    batch, seq = tokens.shape
    if seq < 2:
        raise ValueError("sequence_logprobs needs sequences of at least 2 tokens")
    pp = ps.get_pipeline_model_parallel_world_size()
    mbs = micro_batch_size or (batch // pp if len(chunks) > 1 and batch % pp == 0 else batch)
    if batch % mbs:
        raise ValueError(f"batch {batch} is not divisible by micro_batch_size {mbs}")
    positions = torch.arange(seq - 1, device=device).unsqueeze(0).expand(batch, -1)
    microbatches = [{"tokens": tokens[i:i + mbs, :-1], "position_ids": positions[i:i + mbs],
                     "labels": tokens[i:i + mbs, 1:]} for i in range(0, batch, mbs)]
    logprobs = forward_logprobs(chunks, microbatches, seq_length=seq - 1)
    result = torch.empty((batch, seq - 1), dtype=torch.float32, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        torch.cat(logprobs, dim=0, out=result)
    if pp > 1:
        torch.distributed.broadcast(result, src=ps.get_pipeline_model_parallel_last_rank(),
                                    group=ps.get_pipeline_model_parallel_group())
    return result


def model_options(shape: ModelShape, dims: ParallelDims, *, model: ModelConfig, parallel: ParallelConfig,
                  runtime: RuntimeConfig, seed: int, router_replay: bool) -> ModelOptions:
    """How this rank builds ``shape``'s model: at ``dims`` (the job's, built once), with the model, parallel and
    runtime sections' settings; ``seed`` initialises the weights; ``router_replay``: MoE layers replay recorded
    routes."""
    return ModelOptions(
        dims=dims, recompute=parallel.recompute, dtype=compute_dtype(model.dtype),
        moe_load_balancing=model.moe_load_balancing, moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_expert_bias_update=model.moe_expert_bias_update, router_replay=router_replay and shape.is_moe,
        seq_length=model.seq_length or shape.seq_length, init_seed=seed,
        transformer_engine=resolve_transformer_engine(runtime.transformer_engine),
        moe_grouped_gemm=None if runtime.moe_grouped_gemm == "auto" else bool(runtime.moe_grouped_gemm),
        attention=runtime.attention, recompute_num_layers=parallel.recompute_num_layers,
        tp_comm_overlap=runtime.tp_comm_overlap, lora=model.lora)


@dataclass
class Engine:
    """Model chunks, optimizer and schedule of one rank, plus the sizes the schedule needs."""

    shape: ModelShape
    opts: ModelOptions
    chunks: list
    optimizer: Any
    scheduler: Any
    make_optimizer: Callable[[list], tuple[Any, Any]]
    step: int = 0
    peak_memory: dict[str, int] = field(default_factory=dict)
    """Peak bytes per phase since the trainer last logged them (``megatron_rl.runtime.memory``)."""
    trainable_fraction: Optional[float] = None
    """With LoRA: the trainable (adapter and head) share of the model's parameters, logged every step."""
    host_offload: HostOffload = field(default_factory=HostOffload)
    """Where optimizer state and grads wait while generating (``generation.offload_optimizer``): one host buffer
    kept across steps, and the moves' bytes and seconds since the trainer last logged them."""

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.shape.vocab_size, self.opts.dims.tp)

    @property
    def sequence_multiple(self) -> int:
        """Training sequence lengths must be multiples of this (``ParallelDims.sequence_multiple``)."""
        return self.opts.dims.sequence_multiple

    def train_step(self, microbatches: list[Mapping], loss_fn: LossFn, *, seq_length: int,
                   report_names: tuple[str, ...], forward_fn: ForwardFn = lm_forward) -> dict[str, float]:
        """Forward-backward over ``microbatches`` (this DP rank's share) and one optimizer step."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_rl.models.router_replay import routes_released

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        with peak_memory_of(self.peak_memory, "train"), routes_released(self.chunks):
            reports = get_forward_backward_func()(
                forward_step_func=partial(_forward_step, loss_fn=loss_fn, forward_fn=forward_fn),
                data_iterator=_data_iterators(self.chunks, microbatches), model=self.chunks,
                num_microbatches=len(microbatches), seq_length=seq_length,
                micro_batch_size=rows_per_microbatch(microbatches), forward_only=False)
            _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.step += 1
        metrics = reduce_reports(reports, report_names)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def forward_only(self, microbatches: list[Mapping], loss_fn: LossFn, *, seq_length: int,
                     report_names: tuple[str, ...], forward_fn: ForwardFn = lm_forward) -> dict[str, float]:
        """Forward pass through the schedule without gradients (evaluation)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_rl.models.router_replay import routes_released

        with torch.no_grad(), routes_released(self.chunks):
            reports = get_forward_backward_func()(
                forward_step_func=partial(_forward_step, loss_fn=loss_fn, forward_fn=forward_fn),
                data_iterator=_data_iterators(self.chunks, microbatches), model=self.chunks,
                num_microbatches=len(microbatches), seq_length=seq_length,
                micro_batch_size=rows_per_microbatch(microbatches), forward_only=True)
        return reduce_reports(reports, report_names)

    def reference_model(self, folder: Path) -> list:
        """The KL reference: with LoRA (``model.lora``) this engine's own chunks, which ``reference_logprobs``
        runs with their adapters disabled (the frozen base: no second copy in memory; the modules_to_save's
        current weights kept and saved in ``folder``, or loaded from there on a resume); else ``frozen_copy``."""
        if self.opts.lora is None:
            return self.frozen_copy(folder)
        if self.opts.lora.modules_to_save:
            self._keep_base_modules(folder)
        return self.chunks

    def _keep_base_modules(self, folder: Path) -> None:
        from megatron_rl.models.lora import BaseModules
        from megatron_rl.runtime import checkpoint as ckpt

        copies = [BaseModules(ckpt.unwrap(chunk)) for chunk in self.chunks]
        ckpt.remove_partial_saves(folder)
        found = ckpt.latest_checkpoint(folder)
        if found is None or (ckpt.run_id() is not None and ckpt.checkpoint_owner(found) != ckpt.run_id()):
            ckpt.save_checkpoint(folder, step=0, chunks=copies, keep_last=1)
        else:
            ckpt.load_checkpoint(found, chunks=copies, load_optimizer=False)

    def reference_logprobs(self, reference: list, microbatches: list[Mapping], *, seq_length: int) -> list:
        """The frozen ``reference`` chunks' log-probs of each micro-batch's labels (on the last pipeline stage, the
        only one that computes the loss; empty elsewhere); LoRA adapters are off meanwhile."""
        from megatron_rl.models.lora import adapters_disabled

        with adapters_disabled(reference):
            return forward_logprobs(reference, microbatches, seq_length=seq_length)

    def policy_logprobs(self, microbatches: list[Mapping], *, seq_length: int) -> list:
        """This engine's own training-forward log-probs of each micro-batch's labels (last pipeline stage; empty
        elsewhere). Before a rollout's first optimizer step they are pi_old, which makes the first update's ratio
        exactly 1 whatever kernels generation used."""
        return forward_logprobs(self.chunks, microbatches, seq_length=seq_length)

    def frozen_copy(self, folder: Path) -> list:
        """Chunks with this engine's current weights, frozen (no grad, eval mode), saved in ``folder``; when
        ``folder`` already holds them from this same run (a resumed run), they are loaded from there instead.
        A copy saved by another run (a ``resume=false`` or fresh run into an old folder) is rebuilt."""
        from megatron_rl.runtime import checkpoint as ckpt

        copies = build_model_chunks(self.shape, self.opts)
        ckpt.remove_partial_saves(folder)
        found = ckpt.latest_checkpoint(folder)
        if found is None or (ckpt.run_id() is not None and ckpt.checkpoint_owner(found) != ckpt.run_id()):
            for copy, chunk in zip(copies, self.chunks):
                copy.load_state_dict(ckpt.unwrap(chunk).state_dict())
            ckpt.save_checkpoint(folder, step=0, chunks=copies, keep_last=1)
        else:
            ckpt.load_checkpoint(found, chunks=copies, load_optimizer=False)
        for copy in copies:
            copy.eval()
            copy.requires_grad_(False)
        return copies

    def reset_optimizer_schedule(self) -> None:
        """A fresh optimizer and LR schedule on the current weights (a new training stage starts at step 0)."""
        self.optimizer, self.scheduler = self.make_optimizer(self.chunks)
        self.step = 0

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)


def _data_iterators(chunks: list, microbatches: list[Mapping]):
    """One iterator for a single chunk; one per chunk under virtual pipelining (each chunk reads every batch)."""
    if len(chunks) == 1:
        return iter(microbatches)
    return [iter(microbatches) for _ in chunks]


def _forward_step(data_iterator: Iterable[Mapping], model, *, loss_fn: LossFn, forward_fn: ForwardFn):
    """Micro-batches arrive whole; under context parallelism each rank keeps its two sequence chunks (Megatron's
    load-balanced order) of every per-token entry. The schedule is given the global sequence length. A batch
    with ``routes`` routes its tokens by them (``megatron_rl.models.router_replay``)."""
    from megatron_rl.models.cp_attention import slice_batch_for_cp

    batch = slice_batch_for_cp(next(data_iterator))
    if "routes" in batch:  # a rollout's recorded experts (algorithm.router_replay)
        from megatron_rl.models.router_replay import replay

        replay(model, batch["routes"])
    return forward_fn(model, batch), partial(loss_fn, batch=batch)


def reduce_reports(reports: list[dict], names: tuple[str, ...]) -> dict[str, float]:
    """Reduce each reported (value, count) over micro-batches and data-parallel ranks; every rank gets the result.

    Names ending in ``_min`` / ``_max`` are minimum / maximum of the values; the others are sum / count.
    Only the last pipeline stage computes losses, so the results are then shared along the pipeline.
    """
    from megatron.core import parallel_state

    groups = (parallel_state.get_data_parallel_group(with_context_parallel=True),
              parallel_state.get_pipeline_model_parallel_group())
    device = collective_device(groups[0])
    mean_names = [n for n in names if not n.endswith(("_min", "_max"))]
    sums = torch.zeros(2 * len(mean_names), dtype=torch.float64, device=device)
    extremes = {n: [] for n in names if n.endswith(("_min", "_max"))}
    for report in reports:
        for i, name in enumerate(mean_names):
            total, count = report[name]
            sums[2 * i] += total.detach().double().sum().to(device)
            sums[2 * i + 1] += count.detach().double().sum().to(device) if torch.is_tensor(count) else count
        for name, values in extremes.items():
            values.append(report[name][0].detach().to(device, torch.float64).reshape(()))
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


def overlap_grad_reduce_in_schedule(wrapped: list) -> None:
    """Hand Megatron's schedules the DDP hooks of an overlapped gradient reduce, as Megatron's training loop does:
    ``no_sync`` around the micro-batches before the last (their grads only accumulate), and ``start_grad_sync``
    of each chunk once its last backward pass is done (interleaved pipelines), so that bucket reduces run
    during the backward pass; ``finalize_model_grads`` waits for them. Set on chunk 0's config, the one the
    schedules read."""
    config = wrapped[0].config
    if len(wrapped) == 1:
        config.no_sync_func, config.grad_sync_func = wrapped[0].no_sync, wrapped[0].start_grad_sync
    else:
        config.no_sync_func = [chunk.no_sync for chunk in wrapped]
        config.grad_sync_func = [chunk.start_grad_sync for chunk in wrapped]


def initialize_tp_communicators(shape: ModelShape, opts: ModelOptions, *, micro_batch_size: int) -> None:
    """TE's userbuffers for runtime.tp_comm_overlap, sized for one micro-batch's [tokens, hidden] on this TP
    group (Megatron's ``_initialize_tp_communicators``). GPU path: unverified until a device runs it."""
    from transformer_engine.pytorch import module as te_module

    tokens = micro_batch_size * opts.seq_length // opts.dims.cp
    te_module.base.initialize_ub(shape=[tokens, shape.hidden_size], tp_size=opts.dims.tp, use_fp8=False,
                                 dtype=opts.dtype)


def build_engine(shape: ModelShape, opts: ModelOptions, *, optimizer: OptimizerConfig, runtime: RuntimeConfig,
                 parallel: ParallelConfig, steps: int, lr: Optional[float] = None,
                 build_chunks: Callable[[ModelShape, ModelOptions], list] = build_model_chunks) -> Engine:
    """Model chunks wrapped in Megatron DDP, Megatron's (distributed) optimizer and its LR/WD schedule: the
    optimizer section's settings (``lr``: another peak), its schedule over ``steps``, gradients as the runtime
    section says.

    ``build_chunks`` makes this rank's model chunks (default: the GPT policy; the RM trainer passes its own).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if opts.tp_comm_overlap:
        initialize_tp_communicators(shape, opts, micro_batch_size=parallel.micro_batch_size)
    chunks = build_chunks(shape, opts)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=runtime.grad_dtype == "fp32", overlap_grad_reduce=runtime.overlap_grad_reduce,
        bucket_size=runtime.grad_bucket_size, use_distributed_optimizer=parallel.distributed_optimizer)
    wrapped = []
    for i, chunk in enumerate(chunks):
        chunk.config.calculate_per_token_loss = True
        chunk.config.finalize_model_grads_func = finalize_model_grads
        wrapped.append(DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                               disable_bucketing=i > 0))
    if ddp_config.overlap_grad_reduce:
        overlap_grad_reduce_in_schedule(wrapped)
    optim = optimizer
    peak_lr = optim.lr if lr is None else lr

    def make_optimizer(model_chunks: list):
        optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam", lr=peak_lr, min_lr=min(optim.min_lr, peak_lr), weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad, bf16=opts.dtype == torch.bfloat16, fp16=opts.dtype == torch.float16,
                params_dtype=opts.dtype, use_distributed_optimizer=parallel.distributed_optimizer),
            model_chunks)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if optim.lr_warmup_steps else peak_lr, max_lr=peak_lr,
            min_lr=min(optim.min_lr, peak_lr), lr_warmup_steps=optim.lr_warmup_steps,
            lr_decay_steps=max(steps, optim.lr_warmup_steps + 1), lr_decay_style=optim.lr_decay_style,
            start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=max(steps, 1),
            wd_incr_style="constant")
        return optimizer, scheduler

    optimizer, scheduler = make_optimizer(wrapped)
    if opts.lora is not None:
        from megatron_rl.models.lora import trainable_fraction

        fraction = trainable_fraction(wrapped)
    return Engine(shape=shape, opts=opts, chunks=wrapped, optimizer=optimizer, scheduler=scheduler,
                  make_optimizer=make_optimizer,
                  trainable_fraction=fraction if opts.lora is not None else None)


def data_parallel_share(items: list, *, with_context_parallel: bool = False) -> list:
    """This DP rank's contiguous share of a list every rank holds (rank r gets the r-th of dp equal parts).
    ``with_context_parallel``: over the dp*cp ranks instead (CP ranks as extra workers, e.g. rollout generation)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=with_context_parallel)
    if len(items) % dp:
        what = "data-parallel x context-parallel" if with_context_parallel else "data-parallel"
        raise ValueError(f"{len(items)} items do not split evenly over {dp} {what} ranks")
    per_rank = len(items) // dp
    rank = parallel_state.get_data_parallel_rank(with_context_parallel=with_context_parallel)
    return items[rank * per_rank:(rank + 1) * per_rank]


def data_parallel_slice(items: list, *, micro_batch_size: int) -> list[list]:
    """This DP rank's share of a global batch, cut into micro-batches (every rank sees the same global list)."""
    mine = data_parallel_share(items)
    if len(mine) % micro_batch_size:
        raise ValueError(f"global batch {len(items)} is not divisible by dp x micro_batch_size={micro_batch_size}")
    return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]


def sft_step(engine: Engine, examples: list, *, global_batch_size: int, micro_batch_size: int, seq_length: int,
             pad_id: int) -> dict[str, float]:
    """One optimizer step of the next-token loss on SFT ``examples`` ((ids, loss mask) each; the global batch,
    identical on every rank): the SFT trainer's step and GRPO's warm-up's."""
    micro = data_parallel_slice(examples[:global_batch_size], micro_batch_size=micro_batch_size)
    batches = [collate_sft(mb, seq_length=seq_length, pad_id=pad_id) for mb in micro]
    return engine.train_step(batches, lm_loss, seq_length=seq_length, report_names=LM_REPORTS)


def gather_data_parallel(items: list, *, with_context_parallel: bool = False) -> list:
    """The inverse of ``data_parallel_share``: every DP rank's list, concatenated in rank order, on every rank."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=with_context_parallel)
    world = torch.distributed.get_world_size(group)
    if world == 1:
        return list(items)
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, list(items), group=group)
    return [item for part in gathered for item in part]
