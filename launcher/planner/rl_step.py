"""The step of the post-training modes: GRPO (and PPO, evaluation) as this project's trainers run it, and DPO.

An RL step (megatron_rl/trainers/rl.py) is, in order:

* generation (megatron_rl/generation/engine.py, the paged engine) on every data-parallel x context-parallel rank
  for its share of the rollout. Its KV pool (``kv_pool``: generation.kv_memory_gib, or the planner's pick: what the
  layout's memory leaves while generating, up to what the share needs) sets how many rows decode at once; a
  finished row's place goes to the next waiting one (continuous admission), so the batch stays full until the
  queue drains, then the last rows finish over up to the longest response (``generation_time``). Each GRPO
  group's prompt is prefilled once (compute-bound, at the training GEMM efficiency); each decode step is bounded
  by max(HBM read of the weights and the KV the fed rows hold, their compute, a per-layer launch floor) plus two
  latency-bound TP all-reduces per layer and an EP dispatch + combine per MoE layer. Under PP the rows decode
  in M = pp parts on their own (megatron_rl/generation/engine.py ``Engine._run_pipelined``), successive steps
  overlapping across the stages: a step is vpp x max(pp, M) virtual-stage forwards of one part, each paying a
  send/recv hop. A prefill is counted as one forward of the prompts admitted together in M parts, which overlap
  only in the pipeline's fill and drain: (M (vpp - 1) pp + M + pp - 1) virtual-stage forwards of one part;
* the log-prob forward passes over the rollout's training tokens: the old policy when recomputed
  (algorithm.recompute_old_logprobs), the reference when algorithm.kl_coef > 0, and the colocated reward model's
  scoring forward;
* epochs x rollout / global_batch_size optimizer steps, each exactly ``plan --mode pretrain``'s step at the
  rollout's padded length (prompt + max response: the trainer pads every row to the longest), or, with
  parallel.micro_batch_tokens (packed rows), at the mean row's length (``PACKING_SLACK``);
* the phase switches: the KV pool allocated (zeroed) once, and with generation.offload_optimizer the optimizer state
  copied to host memory and back over the host link (grads are freed and come back as zeros, no copy). There is no
  weight refit: generation runs on the training weights.

With split placement (cluster.rollout_tasks) the training GPUs hold no KV cache and generate nothing; the rollout
GPUs' generation is added to their step (max_staleness=0) or overlaps it (max_staleness > 0): see below.

PPO adds a critic of the policy's shape (its weights, grads and optimizer in memory; a value forward and its own
optimizer steps in time). eval is generation alone (weights, KV cache and buffers). DPO trains the policy on
chosen and rejected (2 sequences per pair); the reference log-probs are taken once, in a pass over the data before
training, so no reference model is held and no reference pass is charged per step.

## Split placement

Split placement (``cluster.rollout_tasks`` = R > 0): the last R processes only generate, the others train.

The trainer GPUs run the training layout (``parallel.*``) over world - R processes (``Workload.num_gpus``, with
``Workload.split`` set); they hold no KV cache and generate nothing (rl_step._rl_memory, rl_step._rl_timing). The R
rollout GPUs form R / (tp*pp) replicas at the training layout's tp x pp and pipeline split (vpp included), or at
parallel.rollout_tp x rollout_pp (``SplitPlacement.replica``), cp=1 and ep=1
(``megatron_rl.spec.parallel.rollout_replica_error``; ``megatron_rl.spec.parallel.rollout_parallel``). A rollout GPU
holds its bf16 weight shard (no gradients or optimizer state) and its KV pool (``kv_pool``, picked for the rollout
GPU when generation.kv_memory_gib is null); its memory and generation time are ``plan --mode eval``'s of the rollout on
those GPUs, i.e. rl_step's generation model (``rollout_estimate``).

One step, per version of the policy:

* the trainer GPUs: the optimizer steps, log-prob passes and reward scoring, then the weight sync
  (``weight_sync_s``): the policy's bf16 weights (with model.lora only its trainable share,
  ``Runtime.trainable_fraction``) over TCP for algorithm.weight_sync gloo or files (``costs.TCP_GB_S``), or over
  the inter-node network for nccl;
* the rollout GPUs: the rollout's prefill and decode.

With algorithm.max_staleness = 0 the trainer waits for rollouts of its current weights, so the step is the sum of
the two; with max_staleness > 0 the next rollout is generated while the trainer trains, and the step is the longer
of the two (``SplitStep.step_s``); the MFU and tokens/s/GPU count both sides' GPUs. ``suggest_rollout_tasks`` finds
the fewest rollout GPUs (a multiple of tp*pp) whose generation is no longer than the trainer's part, for a chosen
layout.

Check it: ``.venv/bin/python -m pytest tests/test_planner_rl_step.py tests/test_planner_split_placement.py -q``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from launcher.planner.costs import (
    ADAM_BYTES_PER_PARAM,
    GIB,
    TCP_LATENCY_S,
    GrpoSizing,
    Workload,
    kv_cache_elements_per_token_per_layer,
)
from launcher.planner.estimate import (
    Estimate,
    KvPool,
    Layout,
    RankGroup,
    SplitStep,
    TimeTerms,
    rank_groups,
    stage_params,
    training_estimate,
)
from megatron_rl.spec.parallel import DECODE_GRAPH_ROWS, ParallelDims, uneven_splits

RL_MODES = ("grpo", "ppo", "eval")
"""Modes with a rollout (GrpoSizing)."""
DECODE_LAYER_OVERHEAD_S = 100e-6
"""Floor of one decoder layer's forward in a decode step: eager PyTorch (without generation.cuda_graphs), about 15
kernel launches of ~7 us each. An assumption, not fitted: no measured GPU decode of this engine exists yet."""
DECODE_LAYER_GRAPH_S = 40e-6
"""The same floor when the step replays a CUDA graph (generation.cuda_graphs, at most DECODE_GRAPH_ROWS[-1] rows):
the launches go, the ~15 small kernels' own ~2.5 us each stay. An assumption, not fitted (no GPU has replayed
this engine's graphs yet)."""
PACKING_SLACK = 1.05
"""Packed training (parallel.micro_batch_tokens) computes this many tokens per token of the rows: the padding that
fills micro-batches up to one length (megatron_rl/rollout/packing.py; tests/test_packing.py measures <= 1.01 on a
long tail of 64 rows). Packed training is planned as padded training at the mean row's length, so a micro-batch of
mbs rows stands for a packed one of mbs x train_seq tokens, and attention is costed at the mean length (an
underestimate for long tails: each row's attention grows with its own length squared)."""
SAMPLING_BYTES_PER_LOGIT = 10
"""Per live row and vocabulary entry: bf16 gathered logits, fp32 probabilities and fp32 sampling scratch."""


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """One RL step's rollout as the planner takes it."""

    sequences: int
    """Rollout sequences (prompts x samples per prompt)."""
    prompt: int
    """Prompt tokens (every prompt at GrpoSizing.max_prompt_length)."""
    response: int
    """Longest response (generation.max_new_tokens): the decode steps of the last rows."""
    mean_response: float
    """Mean response tokens."""
    group: int
    """Completions sharing one prompt (prefilled once)."""
    concurrency: int
    """Cap on the rows decoded at once per generation rank (generation.max_concurrent); 0 = none (the KV pool is
    the limit)."""
    train_seq: int
    """Padded training length of the rollout: prompt + response, at most the model's sequence length. Packed
    (GrpoSizing.packed): the mean row, prompt + mean response, times PACKING_SLACK."""
    minibatches: int
    """Optimizer mini-batches of global_batch_size sequences per rollout."""
    steps: int
    """Optimizer steps per RL step: epochs x minibatches (0 for eval)."""
    turns: int = 1
    """Policy turns per episode (GrpoSizing.turns)."""
    reply: float = 0.0
    """Environment reply tokens of a mean row (GrpoSizing.reply_tokens): context, prefilled between turns; the
    longest row is taken to hold twice as many."""

    @property
    def trained_tokens(self) -> float:
        """Real (unpadded) tokens of the rollout, environment replies included: NeMo RL's tokens/s/GPU numerator."""
        return self.sequences * (self.prompt + self.mean_response + self.reply)

    @property
    def longest(self) -> float:
        """The longest row: prompt, the longest response and (multi-turn) twice the mean replies."""
        return self.prompt + self.response + 2 * self.reply


def rollout(w: Workload) -> Rollout:
    """The rollout of an RL workload, with the defaults of GrpoSizing (made once per workload)."""
    return w._cached(("rollout",), lambda: _rollout(w))


def _rollout(w: Workload) -> Rollout:
    g = w.grpo or GrpoSizing()
    sequences, prompt, response, concurrency = w.grpo_sizes()
    mean = g.mean_response_length if g.mean_response_length is not None else response / 2
    minibatches = max(1, sequences // w.global_batch_size)
    reply = g.reply_tokens if g.turns > 1 else 0
    train_seq = (math.ceil((prompt + mean + reply) * PACKING_SLACK) if g.packed else prompt + response + 2 * reply)
    return Rollout(sequences=sequences, prompt=prompt, response=response, mean_response=float(mean),
                   group=max(1, g.samples_per_prompt), concurrency=concurrency,
                   train_seq=min(w.seq_length, train_seq), minibatches=minibatches,
                   steps=0 if w.mode == "eval" else g.epochs * minibatches, turns=max(1, g.turns), reply=float(reply))


def packed_micro_batch(w: Workload, rows_per_rank: int) -> int:
    """The micro-batch size a packed job (parallel.micro_batch_tokens) is planned at: the rows one micro-batch of
    that many tokens holds at the packed training length, as the largest divisor of a data-parallel rank's rows
    that is no more (at least 1). The job itself packs by tokens and ignores parallel.micro_batch_size."""
    fits = max(1, (w.grpo or GrpoSizing()).micro_batch_tokens // rollout(w).train_seq)
    return max(b for b in range(1, min(fits, rows_per_rank) + 1) if rows_per_rank % b == 0)


def training_workload(w: Workload) -> Workload:
    """The workload of one optimizer step: pretraining at the rollout's padded length (RL modes), or on chosen and
    rejected sequences, two per pair (dpo). Made once per workload."""
    made = w._cost_cache.get("training workload")
    if made is None:
        made = w._cost_cache["training workload"] = (
            replace(w, mode="pretrain", global_batch_size=2 * w.global_batch_size) if w.mode == "dpo" else
            replace(w, mode="pretrain", seq_length=rollout(w).train_seq, grpo=None))
    return made


def mode_estimate(w: Workload, layout: Layout, *, only_if_fits: bool = False) -> Estimate | float:
    """Estimate of a dpo, grpo, ppo or eval step (``only_if_fits``: training_estimate's)."""
    tw = training_workload(w)
    if w.mode == "dpo":
        return training_estimate(tw, layout, only_if_fits=only_if_fits)
    r = rollout(w)
    return training_estimate(tw, layout, memory=lambda gr, ne, ex, parts: _rl_memory(w, layout, r, gr, ne, ex, parts),
                             finish=lambda optimizer, terms, flops: _rl_timing(w, layout, r, optimizer, terms, flops),
                             only_if_fits=only_if_fits)


def _rl_timing(w: Workload, layout: Layout, r: Rollout, optimizer_bytes: float, terms: TimeTerms,
               batch_flops: float) -> dict:
    """The RL step's time, MFUs and tokens/s from one optimizer step's terms (its model FLOPs ``batch_flops``):
    colocated, generation and training add up on the same GPUs; with split placement (w.split) generation runs on
    the rollout GPUs and split.split_step combines the two sides."""
    g = w.grpo or GrpoSizing()
    step = terms.training_step()
    step_s = sum(step.values())
    fwd_pass = _forward_pass_s(terms, step)
    passes = int(g.recompute_old_logprobs and w.mode != "eval") + int(g.reference_model and w.mode != "eval")
    trainer_parts = {"logprob_passes": passes * r.minibatches * fwd_pass,
                     "reward_model": r.minibatches * fwd_pass if g.reward_model else 0.0,
                     "teacher": (r.minibatches * fwd_pass * g.teacher_params / w.total_params
                                 + (2 * _teacher_bytes(w, layout) / w.host_link if g.teacher_offloaded else 0.0)),
                     "critic": (r.minibatches * fwd_pass + r.steps * step_s) if w.mode == "ppo" else 0.0}
    train_time = r.steps * step_s
    split, gpus = None, w.num_gpus
    if w.split is None:
        d = layout.dims
        key = ("generation", d.tp, d.pp, d.vpp, d.cp, d.ep, d.dp, *d.split())
        prefill, decode = w._cached(key, lambda: generation_time(w, layout, r))
        offloads = g.optimizer_offloaded_for_generation and w.mode != "eval"
        offload = 2 * optimizer_bytes / w.host_link if offloads else 0.0
        rl_parts = {**trainer_parts, "generation_prefill": prefill, "generation_decode": decode,
                    "environment": environment_time(w, layout, r),
                    "phase_switch": kv_pool(w, layout).budget / w.hbm + offload}
        total = train_time + sum(rl_parts.values())
    else:
        split = split_step(w, layout, trainer_s=train_time + sum(trainer_parts.values()))
        rl_parts = {**trainer_parts, "weight_sync": split.weight_sync_s, "rollout_wait": split.rollout_wait_s}
        total = split.step_s
        gpus += w.split.rollout_gpus
    train_flops = r.steps * batch_flops
    other = (passes + int(g.reward_model) + g.teacher_params / w.total_params) * r.minibatches * batch_flops / 3
    if w.mode == "ppo":
        other += r.minibatches * batch_flops / 3 + train_flops
    gen_flops = 2 * w.active_params * r.sequences * (r.prompt / r.group + r.mean_response)
    tokens = r.sequences * r.mean_response if w.mode == "eval" else r.trained_tokens
    return {"step_time_s": total, "time_terms": terms._replace(steps=r.steps, rl_parts=rl_parts),
            "mfu": (train_flops + other + gen_flops) / (total * gpus * w.bf16_peak),
            "training_mfu": train_flops / (train_time * w.num_gpus * w.bf16_peak) if train_time else 0.0,
            "tokens_per_s_per_gpu": tokens / total / gpus, "split": split,
            "kv_pool": kv_pool(w, layout) if w.split is None else None}


def _forward_pass_s(t: TimeTerms, step: dict[str, float]) -> float:
    """One forward-only pass over a global batch at the training layout: the forward share of the pipeline."""
    g = t.slowest
    fwd = g.dense_layers * t.dense.fwd_s + g.moe_layers * t.moe.fwd_s
    bwd = g.dense_layers * t.dense.bwd_s + g.moe_layers * t.moe.bwd_s
    pipeline = sum(v for k, v in step.items() if k not in ("dp_comm", "optimizer"))
    return fwd / max(fwd + bwd, 1e-30) * pipeline


def _rl_memory(w: Workload, L: Layout, r: Rollout, gr: RankGroup, ne: float, ex: float, parts: dict) -> dict:
    """One rank's memory in the RL modes: the larger of the generation phase (weights, frozen models, KV cache,
    inference buffers, and grads + optimizer unless offloaded) and the training phase (no KV cache), or their sum
    when the KV cache is not released for training; with split placement the training phase and frozen models
    alone."""
    g = w.grpo or GrpoSizing()
    out = dict(parts)
    bf16 = (ne + ex) * 2.0
    out["reference_model"] = bf16 if g.reference_model and w.mode != "eval" else 0.0
    out["reward_model"] = bf16 if g.reward_model else 0.0
    teacher = _teacher_bytes(w, L)
    out["teacher_model"] = max(0.0, teacher - parts["activations"]) if g.teacher_offloaded else teacher
    if w.split is not None:  # the trainer GPUs do not generate (split.rollout_estimate sizes the rollout GPUs)
        return out
    pool = kv_pool(w, L)
    kv = pool.tokens * (gr.dense_layers + gr.moe_layers) * _kv_token_layer_bytes(w, L)
    buffers = _inference_buffers(w, L, r, gr, pool.rows)
    out["kv_cache_generating"] = kv
    if w.mode == "eval":
        out.update(gradients=0.0, optimizer=0.0, activations=0.0, kv_cache=kv, inference_buffers=buffers)
        return out
    copies = 1.0
    if w.mode == "ppo":  # the critic: the policy's shape, trained in the same phase, offloaded with it
        out["critic"] = parts["weights"] + parts["gradients"] + parts["optimizer"]
        copies = 2.0
    if not g.kv_cache_released_for_training:
        out.update(kv_cache=kv, inference_buffers=buffers)
        return out
    training_only = parts["activations"] + (copies * (parts["gradients"] + parts["optimizer"])
                                            if g.optimizer_offloaded_for_generation else 0.0)
    kv_extra = max(0.0, kv - training_only)
    out.update(kv_cache=kv_extra, inference_buffers=max(0.0, kv + buffers - training_only) - kv_extra)
    return out


def generation_floor(w: Workload, L: Layout) -> float:
    """Bytes the fullest rank holds while generating, before overhead, whatever the micro-batch and recompute: weights,
    frozen models, grads + optimizer unless offloaded, the KV pool and inference buffers (none of the last two on the
    trainer GPUs of split placement, which do not generate). A lower bound of the estimate's total, so the search
    may skip a layout's variants when it alone overflows."""
    r = rollout(w)
    generates = w.split is None
    pool = kv_pool(w, L) if generates else None
    worst = 0.0
    for gr in _groups(w, L):
        held = _generation_resident(w, L, gr)
        if pool is not None:
            held += (pool.tokens * (gr.dense_layers + gr.moe_layers) * _kv_token_layer_bytes(w, L)
                     + _inference_buffers(w, L, r, gr, pool.rows))
        worst = max(worst, held)
    return worst


KV_HEADROOM = 1.25
"""A pool the planner picks holds at most every row of a rank's share (or generation.max_concurrent of them) at
once: each with its prompt (shared by the group), this many times the mean response, and half a block of rounding.
Rows longer than the mean then seldom wait, and more memory would buy nothing."""


def generation_pool(e: Estimate) -> KvPool | None:
    """The KV pool of the GPUs that generate in ``e``: its own, or with split placement the rollout GPUs'."""
    return e.split.rollout_gpu.kv_pool if e.split is not None else e.kv_pool


def kv_pool(w: Workload, L: Layout) -> KvPool:
    """The KV pool of ``L``'s generation ranks and the rows it decodes at once (made once per layout)."""
    key = ("kv pool", L.dims.tp, L.dims.pp, L.dims.vpp, L.dims.cp, L.dims.ep, L.dims.dp, *L.dims.split())
    return w._cached(key, lambda: _kv_pool(w, L))


def _kv_pool(w: Workload, L: Layout) -> KvPool:
    g = w.grpo or GrpoSizing()
    r = rollout(w)
    share = r.sequences / (L.dims.dp * L.dims.cp)
    per_token_layer = _kv_token_layer_bytes(w, L)
    groups = _groups(w, L)
    most = max(gr.dense_layers + gr.moe_layers for gr in groups)
    plans = g.plans_kv_memory and (w.mode == "eval" or g.kv_cache_released_for_training)
    held = _held_per_row(w, r)
    if g.kv_memory_gib is not None:
        tokens, source = g.kv_memory_gib * GIB / (most * per_token_layer), "given"
    elif not plans:
        tokens, source = share * r.longest, "every row"
    else:
        at_once = min(share, r.concurrency or math.inf)
        needed = at_once * (r.prompt / r.group + min(r.response, KV_HEADROOM * r.mean_response) + r.reply
                            + g.kv_block_tokens / 2)
        room = min(_room_tokens(w, L, r, gr, held, per_token_layer) for gr in groups)
        least = L.dims.pp * r.longest  # one row at its longest in each pipeline part: the engine's floor
        tokens, source = max(least, min(needed, room)), "chosen"
    rows = min(share, r.concurrency or math.inf)
    if source != "every row":  # every row has its blocks from the start; otherwise the pool sets how many decode
        rows = max(1.0, min(rows, tokens / held))
    return KvPool(budget=tokens * most * per_token_layer, tokens=tokens, rows=rows, source=source)


def _held_per_row(w: Workload, r: Rollout) -> float:
    """KV tokens a decoding row holds on average while rows wait: its share of the group's prompt, half a block of
    rounding, and the response so far. A row of length n holds n/2 on average over the n steps it decodes, so a
    slot holds E[n^2] / (2 E[n]) = 2/3 of the mean for lengths spread evenly up to twice the mean; the
    environment's replies, which arrive through the episode, count half."""
    g = w.grpo or GrpoSizing()
    return r.prompt / r.group + g.kv_block_tokens / 2 + min(r.response, 2 * r.mean_response / 3) + r.reply / 2


def _room_tokens(w: Workload, L: Layout, r: Rollout, gr: RankGroup, held: float, per_token_layer: float) -> float:
    """Pool tokens that fit beside what rank group ``gr`` holds while generating: the usable memory less the
    overhead and fragmentation, less the resident models and state, shared by the KV (its layers per token) and
    the inference buffers of the rows the pool lets decode at once (per row, 1 / ``held`` of a token)."""
    usable = w.gpu.memory_gib * GIB * (1.0 - w.runtime.memory_margin)
    room = (usable - w.runtime.overhead_gib * GIB) / (1.0 + w.runtime.fragmentation) - _generation_resident(w, L, gr)
    per_row = _inference_buffers(w, L, r, gr, 1.0, linear=True)
    return max(0.0, room) / ((gr.dense_layers + gr.moe_layers) * per_token_layer + per_row / held)


def _generation_resident(w: Workload, L: Layout, gr: RankGroup) -> float:
    """Bytes rank group ``gr`` holds while generating besides the KV pool and buffers: bf16 weights (PPO: the
    critic's too), the frozen reference and reward models, and the trained models' grads and optimizer state
    unless they wait in host memory (generation.offload_optimizer)."""
    g = w.grpo or GrpoSizing()
    ne, ex = stage_params(w, gr, L)
    wb, gb, _ = w.weight_bytes_per_param(1)
    models = 2 if w.mode == "ppo" else 1
    frozen = 2.0 * ((g.reference_model and w.mode != "eval") + g.reward_model)
    held = (ne + ex) * (models * wb + frozen) + (0.0 if g.teacher_offloaded else _teacher_bytes(w, L))
    if w.mode != "eval" and not g.optimizer_offloaded_for_generation:
        shards = (L.dims.dp * L.dims.cp, L.dims.edp)
        opt = tuple(ADAM_BYTES_PER_PARAM / n for n in shards) if w.runtime.distributed_optimizer else \
            (ADAM_BYTES_PER_PARAM, ADAM_BYTES_PER_PARAM)
        held += models * w.runtime.trainable_fraction * ((ne + ex) * gb + ne * opt[0] + ex * opt[1])
    return held


def _teacher_bytes(w: Workload, L: Layout) -> float:
    """The distillation teacher's bf16 weights per GPU (GrpoSizing.teacher_params over tp x pp); 0 without one."""
    g = w.grpo or GrpoSizing()
    return 2.0 * g.teacher_params / (L.dims.tp * L.dims.pp) if w.mode != "eval" else 0.0


def _groups(w: Workload, L: Layout) -> tuple:
    return rank_groups(w.shape.moe_layers, w.shape.num_layers, L.dims.pp, L.dims.vpp, *L.dims.split())


def _kv_token_layer_bytes(w: Workload, L: Layout) -> float:
    """KV bytes of one token on one layer of a TP rank."""
    return kv_cache_elements_per_token_per_layer(w.shape, L.dims.tp) * (w.grpo or GrpoSizing()).kv_cache_bytes


def _inference_buffers(w: Workload, L: Layout, r: Rollout, gr: RankGroup, rows: float, *,
                       linear: bool = False) -> float:
    """Generation buffers for ``rows`` rows decoding at once: the last stage's gathered logits and sampling tensors
    (twice for up to DECODE_GRAPH_ROWS[-1] rows with generation.cuda_graphs: the graphs' pool keeps its own),
    and every stage's prefill working set (one layer's activations for their groups' prompts, prefilled together
    when admitted at once; no autograd; SP is off while generating). ``linear``: without the floor of one prompt."""
    kind = "moe" if w.shape.is_moe else "dense"
    per_token = w._cached(("prefill act", L.dims.tp, L.dims.ep),
                          lambda: sum(training_workload(w)._act_terms(kind, L.dims.tp, False, L.dims.ep).values()))
    prompts = rows / r.group if linear else max(1.0, rows / r.group)
    graph_rows = min(rows, DECODE_GRAPH_ROWS[-1]) if (w.grpo or GrpoSizing()).cuda_graphs else 0.0  # the pool's
    logits = (rows + graph_rows) * w.shape.vocab_size * SAMPLING_BYTES_PER_LOGIT if gr.last else 0.0
    return logits + prompts * r.prompt * per_token


@dataclass(frozen=True)
class _Stage:
    """What one pipeline rank group computes per forward in generation."""

    layers: int
    moe_layers: int
    weight_bytes: float
    dense_params: float
    expert_params: float


def _stages(w: Workload, L: Layout) -> list[_Stage]:
    s = w.shape
    groups = rank_groups(s.moe_layers, s.num_layers, L.dims.pp, L.dims.vpp, *L.dims.split())
    wb = w.weight_bytes_per_param(1)[0]
    out = []
    for gr in groups:
        ne, ex = stage_params(w, gr, L)
        out.append(_Stage(gr.dense_layers + gr.moe_layers, gr.moe_layers, (ne + ex) * wb, ne, ex))
    return out


def generation_time(w: Workload, L: Layout, r: Rollout) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one rollout under continuous admission (kv_pool): while rows wait, the
    pool's ``rows`` decode at once and a finished row's place goes to the next, for share x mean / rows - mean
    steps; then the last rows drain over up to the longest response, the rows fed falling as they finish and
    leave the batch (mean / max of them on average). A fed row reads its prompt and 2/3 of
    the mean response of KV a step (``_held_per_row``). Each group's prompt is prefilled once, with the groups
    admitted together: share / rows prefill forwards of rows / group prompts. Multi-turn (``r.turns`` > 1): each
    later turn prefills every row's share of the replies (``r.reply`` over turns - 1 chunks), and a decode step
    reads half the replies' KV too."""
    share = r.sequences / (L.dims.dp * L.dims.cp)
    pool = kv_pool(w, L)
    rows = min(share, pool.rows)
    stages = _stages(w, L)
    context = r.prompt + min(r.response, 2 * r.mean_response / 3) + r.reply / 2

    def step(fed: float) -> float:
        t = _pipelined_decode_step(w, L, stages, fed, lambda st, n: _decode_part(w, L, st, n, context))
        return t + fed * w.shape.vocab_size * SAMPLING_BYTES_PER_LOGIT / w.hbm + 2 * w.nvlink_latency

    def prefill_of(prompts: float) -> float:
        return _pipelined(w, L, stages, prompts, lambda st, n: _prefill_part(w, L, st, n * r.prompt, r.prompt))

    full_steps = max(0.0, share * r.mean_response / rows - r.mean_response)
    tail_fed = max(1.0, rows * min(1.0, r.mean_response / r.response))
    decode = full_steps * step(rows) + r.response * step(tail_fed)
    prefill = share / rows * prefill_of(max(1.0, rows / r.group))
    if r.turns > 1 and r.reply:
        chunk = r.reply / (r.turns - 1)  # one reply: prefilled onto each fed row between its turns
        replies = _pipelined(w, L, stages, rows, lambda st, n: _prefill_part(w, L, st, n * chunk, chunk))
        prefill += share / rows * (r.turns - 1) * replies
    return prefill, decode


def environment_time(w: Workload, L: Layout, r: Rollout) -> float:
    """Seconds a rollout worker spends in its episodes' environment steps: its share of the rows, ``turns`` steps
    each (the planner takes the most), ``env_concurrent_steps`` at a time (GrpoSizing.env_step_s)."""
    g = w.grpo or GrpoSizing()
    if r.turns == 1 and not g.env_step_s:
        return 0.0
    return r.sequences / (L.dims.dp * L.dims.cp) * r.turns * g.env_step_s / g.env_concurrent_steps


def _pipelined(w: Workload, L: Layout, stages: list[_Stage], rows: float, part_time) -> float:
    """One forward of ``rows`` through ``StageChain.forward`` (the prefill): M = min(pp, rows) parts; each virtual
    stage forward of a part takes the slowest rank's time over vpp, plus one send/recv hop under PP."""
    if L.dims.pp == 1:
        return part_time(stages[0], rows)
    parts, chunk, hop = _pipeline_part(w, L, stages, rows, part_time)
    forwards = parts * (L.dims.vpp - 1) * L.dims.pp + parts + L.dims.pp - 1
    return forwards * (chunk + hop)


def _pipelined_decode_step(w: Workload, L: Layout, stages: list[_Stage], rows: float, part_time) -> float:
    """One decode step of ``rows`` in the pipelined decode's steady state (engine.py ``Engine._run_pipelined``): M =
    min(pp, rows) parts decode on their own, so a rank runs M x vpp virtual-stage forwards of a part per step while each part's step passes through
    pp x vpp of them in turn: vpp x max(pp, M) x (forward + hop)."""
    if L.dims.pp == 1:
        return part_time(stages[0], rows)
    parts, chunk, hop = _pipeline_part(w, L, stages, rows, part_time)
    return L.dims.vpp * max(L.dims.pp, parts) * (chunk + hop)


def _pipeline_part(w: Workload, L: Layout, stages: list[_Stage], rows: float, part_time) -> tuple[float, float, float]:
    """(parts, one part's virtual-stage forward on the slowest rank, one send/recv hop of a part)."""
    parts = min(L.dims.pp, max(1.0, rows))
    per_part = rows / parts
    chunk = max(part_time(st, per_part) for st in stages) / L.dims.vpp
    bw = w.ib if L.dims.tp * L.dims.cp * L.dims.dp >= w.gpu.gpus_per_node else w.nvlink
    hop = per_part * w.shape.hidden_size * 2 / bw + (w.ib_latency if bw == w.ib else w.nvlink_latency)
    return parts, chunk, hop


def _expert_share(w: Workload, L: Layout, rows: float) -> tuple[float, float]:
    """(expert FLOPs per expert parameter held, fraction of the local experts' weights read) for ``rows`` tokens
    fed per GPU: the EP group routes the rows of max(1, ep / tp) replicas, topk experts each."""
    s = w.shape
    if not s.is_moe:
        return 0.0, 0.0
    load = w.runtime.expert_load if L.dims.ep > 1 else 1.0
    flops_per_param = (2 * rows * s.moe_router_topk * load * L.dims.ep / (L.dims.tp * s.num_experts) if L.dims.ep > 1
                       else 2 * rows * s.moe_router_topk / s.num_experts)
    routed = rows * max(1.0, L.dims.ep / L.dims.tp) * s.moe_router_topk
    return flops_per_param, 1.0 - math.exp(-routed / s.num_experts)


def _collectives(w: Workload, L: Layout, st: _Stage, tokens: float) -> float:
    """Two TP all-reduces per layer (no SP while generating) and an EP dispatch + combine per MoE layer."""
    h = w.shape.hidden_size
    t = 0.0
    if L.dims.tp > 1:
        t += st.layers * 2 * (2 * w.nvlink_latency + tokens * h * 2 * 2 * (L.dims.tp - 1) / L.dims.tp / w.nvlink)
    if L.dims.ep > 1 and st.moe_layers:
        inter = L.dims.ep * L.dims.etp > w.gpu.gpus_per_node
        bw, lat = (w.ib, w.ib_latency) if inter else (w.nvlink, w.nvlink_latency)
        volume = tokens * w.shape.moe_router_topk * h * 2 * (L.dims.ep - 1) / L.dims.ep * w.runtime.expert_load
        t += st.moe_layers * 2 * (lat + volume / bw)
    return t


def _decode_part(w: Workload, L: Layout, st: _Stage, rows: float, context: float) -> float:
    """One decode forward of ``rows`` rows through one rank's layers."""
    flops_per_expert_param, touched = _expert_share(w, L, rows)
    wb = w.weight_bytes_per_param(1)[0]
    weights = st.dense_params * wb + st.expert_params * wb * touched
    g = w.grpo or GrpoSizing()
    kv = rows * context * st.layers * kv_cache_elements_per_token_per_layer(w.shape, L.dims.tp) * g.kv_cache_bytes
    flops = 2 * rows * st.dense_params + flops_per_expert_param * st.expert_params
    compute = flops / (w.gemm_peak * w.gemm_efficiency(w.shape.hidden_size / L.dims.tp, rows))
    graphed = g.cuda_graphs and rows <= DECODE_GRAPH_ROWS[-1]
    floor = st.layers * (DECODE_LAYER_GRAPH_S if graphed else DECODE_LAYER_OVERHEAD_S)
    return max((weights + kv) / w.hbm, compute, floor) + _collectives(w, L, st, rows)


def _prefill_part(w: Workload, L: Layout, st: _Stage, tokens: float, prompt: int) -> float:
    """One prefill forward of ``tokens`` prompt tokens through one rank's layers: GEMMs and causal attention at
    the training efficiency, or the weights' read when that is longer."""
    flops_per_expert_param, _ = _expert_share(w, L, tokens)
    s = w.shape
    heads = s.num_attention_heads / L.dims.tp
    attention = tokens * prompt * st.layers * heads * (w.dqk + w.dv)  # 2 FLOPs x 2 GEMMs x causal half
    flops = 2 * tokens * st.dense_params + flops_per_expert_param * st.expert_params + attention
    compute = flops / (w.gemm_peak * w.gemm_efficiency(s.hidden_size / L.dims.tp, tokens))
    return max(compute, st.weight_bytes / w.hbm) + _collectives(w, L, st, tokens)


def estimate(w: Workload, layout: Layout, *, only_if_fits: bool = False) -> Estimate | float:
    """Memory and time of a legal layout for w's mode: the RL modes (grpo, ppo, eval) and dpo by
    ``mode_estimate``, the others are one optimizer step. ``only_if_fits``: a layout that does not fit gives its total
    bytes alone (training_estimate)."""
    if w.mode in ("grpo", "ppo", "eval", "dpo"):
        return mode_estimate(w, layout, only_if_fits=only_if_fits)
    return training_estimate(w, layout, only_if_fits=only_if_fits)


# ----------------------------------------------------------------------------------------------- split placement
SYNC_BYTES_PER_PARAM = 2
"""The trainer publishes bf16 weights."""
SUGGESTION_SLACK = 0.05
"""When no rollout GPU count keeps up with training, the suggestion is the fewest whose generation is within this
fraction of the fastest (one sequence per replica): more replicas would gain less than that."""


@dataclass(frozen=True, kw_only=True)
class RolloutSuggestion:
    """The rollout_tasks that balances generation against the trainer's part for one layout (a suggestion: the
    config is not changed)."""

    rollout_tasks: int
    """Suggested cluster.rollout_tasks (a multiple of tp * pp)."""
    replicas: int
    """Rollout replicas it makes."""
    generation_s: float
    """Generation seconds at that count."""
    trainer_s: float
    """The trainer's seconds per step (they do not depend on the rollout GPUs)."""

    @property
    def balanced(self) -> bool:
        """Whether generation is no longer than the trainer's part (False: even one sequence per replica is
        slower)."""
        return self.generation_s <= self.trainer_s

    def to_dict(self) -> dict:
        """JSON-ready summary (seconds)."""
        return {"rollout_tasks": self.rollout_tasks, "replicas": self.replicas,
                "generation_s": round(self.generation_s, 4), "trainer_s": round(self.trainer_s, 4),
                "balanced": self.balanced}


def rollout_layout(w: Workload, layout: Layout, replicas: int) -> Layout:
    """The layout of the rollout GPUs: the replica's tp x pp (``SplitPlacement.replica``: the training layout's,
    with its pipeline split and vpp, unless parallel.rollout_tp / rollout_pp say otherwise; another pp gets the
    job's own split of the layers), cp=1, ep=1, ``replicas`` data-parallel replicas (generation runs without
    sequence parallelism)."""
    tp, pp = w.split.replica(layout.dims.tp, layout.dims.pp)
    sizes = dict(world_size=tp * pp * replicas, tp=tp, pp=pp, cp=1, ep=1, etp=None, sp=False)
    if pp == layout.dims.pp:
        dims = replace(layout.dims, **sizes, rollout_tasks=0, rollout_tp=None, rollout_pp=None)
    else:
        first, last = (uneven_splits(w.shape.num_layers, pp) or [(None, None)])[0] \
            if w.shape.num_layers % pp else (None, None)
        dims = ParallelDims(**sizes, first_stage_layers=first, last_stage_layers=last)
    return Layout(dims=dims, micro_batch_size=1, recompute="none")


def replica_size(w: Workload, layout: Layout) -> int:
    """GPUs of one rollout replica beside ``layout``."""
    tp, pp = w.split.replica(layout.dims.tp, layout.dims.pp)
    return tp * pp


def replicas_of(w: Workload, layout: Layout) -> int:
    """Rollout replicas of the split workload ``w`` beside ``layout``."""
    return w.split.rollout_gpus // replica_size(w, layout)


def rollout_estimate(w: Workload, layout: Layout, replicas: int | None = None) -> Estimate:
    """Memory of one rollout GPU and the generation time of the rollout on ``replicas`` replicas (default: the
    workload's) at ``layout``'s tp x pp: ``plan --mode eval`` of the rollout on those GPUs, no frozen models."""
    replicas = replicas or replicas_of(w, layout)
    key = ("rollout estimate", replicas, layout.dims.tp, layout.dims.pp, layout.dims.vpp, *layout.dims.split())
    return w._cached(key, lambda: mode_estimate(_rollout_workload(w, replicas * replica_size(w, layout), replicas),
                                                rollout_layout(w, layout, replicas)))


def _rollout_workload(w: Workload, gpus: int, replicas: int) -> Workload:
    """``w``'s rollout as generation alone (mode eval) on ``gpus`` GPUs of ``replicas`` replicas."""
    g = w.grpo or GrpoSizing()
    sizing = replace(g, rollout_batch_size=rollout(w).sequences, reference_model=False, recompute_old_logprobs=False,
                     reward_model=False, epochs=1, kv_cache_released_for_training=False,
                     optimizer_offloaded_for_generation=False)
    return replace(w, mode="eval", num_gpus=gpus, global_batch_size=replicas, grpo=sizing, split=None)


def weight_sync_s(w: Workload) -> tuple[float, float]:
    """(seconds, bytes) of one weight sync: the policy's bf16 weights, or with model.lora the trainable share
    (Runtime.trainable_fraction, of the base's parameter count), over TCP (gloo, files) or the inter-node network
    (nccl)."""
    sent = w.shape.num_params() * SYNC_BYTES_PER_PARAM * w.runtime.trainable_fraction
    if w.split.weight_sync == "nccl":
        return sent / w.ib + w.ib_latency, sent
    return sent / w.tcp + TCP_LATENCY_S, sent


def split_step(w: Workload, layout: Layout, *, trainer_s: float) -> SplitStep:
    """The step of ``layout`` with split placement, given the trainer's work before the weight sync."""
    sync_s, sync_bytes = weight_sync_s(w)
    return SplitStep(rollout_gpus=w.split.rollout_gpus, replicas=replicas_of(w, layout),
                     rollout_gpu=rollout_estimate(w, layout), trainer_s=trainer_s + sync_s, weight_sync_s=sync_s,
                     weight_sync_bytes=sync_bytes, weight_sync=w.split.weight_sync, overlapped=w.split.overlapped)


def rollout_memory_error(w: Workload, layout: Layout) -> str | None:
    """Why a rollout GPU at ``layout``'s tp x pp overflows (the reason the search rules the layout out), or None."""
    e = rollout_estimate(w, layout)
    if e.fits:
        return None
    mem = e.memory_gib()
    tp, pp = w.split.replica(layout.dims.tp, layout.dims.pp)
    return (f"a rollout GPU (tp={tp} x pp={pp} replica, {replicas_of(w, layout)} replicas) needs "
            f"{mem['total']:.1f} GiB of {e.usable / GIB:.1f} (bf16 weights {mem['weights']:.1f}, KV cache "
            f"{mem['kv_cache']:.1f}); lower generation.kv_memory_gib (or leave it null for the planner to pick), or use more "
            f"rollout tasks or a larger tp*pp")


def suggest_rollout_tasks(w: Workload, chosen: Estimate) -> RolloutSuggestion | None:
    """The fewest rollout GPUs (whole replicas of ``chosen``'s tp x pp, at most one per rollout sequence) whose
    generation takes no longer than the trainer's part; when no count does, the fewest whose generation is within
    SUGGESTION_SLACK of the fastest; None when a rollout GPU overflows even at one sequence per replica. Generation
    time falls as replicas are added (shares shrink), so a bisection finds the count."""
    if chosen.split is None:
        return None
    layout, trainer_s = chosen.layout, chosen.split.trainer_s

    def generation(replicas: int) -> float:
        e = rollout_estimate(w, layout, replicas)
        return e.step_time_s if e.fits else math.inf

    most = max(1, rollout(w).sequences)
    fastest = generation(most)
    if math.isinf(fastest):
        return None
    target = trainer_s if fastest <= trainer_s else fastest * (1 + SUGGESTION_SLACK)
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi) // 2
        if generation(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return RolloutSuggestion(rollout_tasks=lo * replica_size(w, layout), replicas=lo, generation_s=generation(lo),
                             trainer_s=trainer_s)
