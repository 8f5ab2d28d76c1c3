"""Parallelism planner: pick TP/PP/VPP/CP/EP/DP, micro-batch and recompute for a model on N GPUs, predict
memory per GPU and speed, and refuse what cannot run. Pure Python (no torch/megatron import).

    from megatron_rl.spec.model_shape import load_model_shape
    from launcher.planner import plan
    print(plan(load_model_shape("llama-3.1-405b"), num_gpus=16384, gpu_type="h100-80gb",
               global_batch_size=2048).explain())

CLI: ``python launch.py plan --model llama-3.1-405b --gpus 16384 --gpu-type h100-80gb``.
Tests: ``.venv/bin/python -m pytest tests/test_planner.py tests/test_planner_calibration.py -q``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from launcher.planner.compare import SIZE_KEYS, RunnerUp, nearest, runner_up
from launcher.planner.costs import GrpoSizing, Runtime, SplitPlacement, Workload
from launcher.planner.estimate import PLANNED_KEYS, TIME_PARTS, Estimate, KvPool, Layout
from launcher.planner.gpus import GIB, GPUS, GpuSpec, get_gpu
from launcher.planner.moe_comm import check_runtime
from launcher.planner.rl_step import RL_MODES, RolloutSuggestion, generation_pool, rollout, suggest_rollout_tasks
from launcher.planner.search import SearchOutcome, search
from megatron_rl.spec.config.schema import RECOMPUTE_MODES
from megatron_rl.spec.errors import ConfigError, as_yaml, did_you_mean
from megatron_rl.spec.limits import check_limits
from megatron_rl.spec.model_shape import ModelShape

__all__ = ["GPUS", "PLANNED_KEYS", "TIME_PARTS", "GpuSpec", "GrpoSizing", "Layout", "NoFeasibleLayout", "PlanResult",
           "RolloutSuggestion", "RunnerUp", "Runtime", "SplitPlacement", "evaluate", "layout_arg", "parse_layout",
           "plan", "smallest_fitting_gpus"]

MODES = ("pretrain", "grpo", "rm", "dpo", "ppo", "eval")
PRECISIONS = ("bf16", "fp8")


class NoFeasibleLayout(ConfigError):
    """No legal layout fits in memory on the requested GPUs (exit code 3)."""

    exit_code = 3

    def __init__(self, message: str, *, smallest_gpus: int | None, leanest: Estimate | None = None,
                 nearest: Estimate | None = None):
        super().__init__(message)
        self.smallest_gpus = smallest_gpus
        """Smallest GPU count (same GPU type, batch, sequence and fixed keys) that fits; None if none was found."""
        self.leanest = leanest
        """The legal layout that needed the least memory, where one was estimated."""
        self.nearest = nearest
        """With kept layout keys: the fitting layout on these GPUs that changes them least (compare.change_cost);
        None when no keys were kept or nothing fits here."""


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """A chosen (or evaluated) layout with its predicted memory and speed, and what the search saw."""

    layout: Layout
    """The chosen layout."""
    estimate: Estimate
    """Its full estimate (bytes, stage split, bubble)."""
    alternatives: tuple[Estimate, ...] = ()
    """Next-fastest fitting layouts: the fastest of each other (tp, pp, cp, ep) first, then other vpp, micro-batch
    and recompute variants (_alternatives)."""
    runner_up: RunnerUp | None = None
    """The best layout not chosen and why it lost: the first alternative, or the planner's own pick when the kept
    keys excluded a faster one; None without alternatives."""
    rejections: dict[str, dict] = field(default_factory=dict)
    """constraint -> {"count": candidates ruled out, "example": one reason}."""
    considered: int = 0
    """Candidate layouts enumerated (including subtrees pruned by a constraint)."""
    evaluated: int = 0
    """Layouts whose memory and time were estimated."""
    search_seconds: float = 0.0
    """Wall time of the search."""
    workload: dict = field(default_factory=dict)
    """Model, GPUs, sequence, batch, mode, precision (and the GRPO sizing)."""
    constraints: dict[str, Any] = field(default_factory=dict)
    """Layout keys the caller held fixed (``parallel:`` names)."""
    limits: dict[str, tuple[Any, str]] = field(default_factory=dict)
    """Layout keys held at the only value the trainers run yet: key -> (value, why)."""
    rollout_suggestion: RolloutSuggestion | None = None
    """Split placement: the cluster.rollout_tasks that balances generation and training for the chosen layout (a
    suggestion; the config keeps its own)."""

    @property
    def memory(self) -> dict[str, float]:
        """GiB per GPU: weights, gradients, optimizer, activations, kv_cache, reference_model, overhead, total,
        capacity."""
        return self.estimate.memory_gib()

    @property
    def fits(self) -> bool:
        """Whether the layout fits in device memory."""
        return self.estimate.fits

    @property
    def kv_pool(self) -> KvPool | None:
        """RL modes: the paged engine's KV pool per generating GPU (the rollout GPUs' with split placement)."""
        return generation_pool(self.estimate)

    @property
    def expected_error(self):
        """How far off a prediction of this kind typically was on published runs (error_bands.Band), or None."""
        from launcher.planner.error_bands import band, kind_of

        return band(kind_of(self.workload["mode"], self.workload.get("moe", False)))

    @property
    def predicted(self) -> dict[str, float]:
        """step_time_s, mfu (fraction of the bf16 peak), tokens_per_s_per_gpu."""
        e = self.estimate
        return {"step_time_s": round(e.step_time_s, 4), "mfu": round(e.mfu, 4),
                "training_mfu": round(e.training_mfu, 4), "tokens_per_s_per_gpu": round(e.tokens_per_s_per_gpu, 1)}

    def to_dict(self) -> dict:
        """The issue's JSON object (plus stage split, rejections and search counts)."""
        out = _summary(self.estimate)
        out["alternatives"] = [_summary(a) for a in self.alternatives]
        out["runner_up"] = self.runner_up.to_dict() if self.runner_up else None
        out["stage_layers"] = list(self.estimate.stage_layers)
        out["rejections"] = self.rejections
        out["search"] = {"considered": self.considered, "evaluated": self.evaluated,
                         "seconds": round(self.search_seconds, 4)}
        out["workload"] = self.workload
        expected = self.expected_error
        out["expected_error"] = expected.to_dict() if expected is not None else None
        out["constraints"] = self.constraints
        out["limits"] = {key: [value, why] for key, (value, why) in self.limits.items()}
        if self.rollout_suggestion is not None:
            out["suggested_rollout_tasks"] = self.rollout_suggestion.to_dict()
        return out

    def megatron_args(self) -> dict[str, object]:
        """Megatron-LM arguments for the chosen layout (keys without dashes), recompute modules included."""
        return self.layout.megatron_args(tuple(self.workload.get("selective_modules", ("layernorm",))))

    def to_json(self) -> str:
        """to_dict() as one JSON line."""
        return json.dumps(self.to_dict())

    def explain(self) -> str:
        """Human-readable tables: layout, memory, speed, alternatives, constraints."""
        from launcher.planner.report import explain

        return explain(self)


def _summary(e: Estimate) -> dict:
    """One layout's JSON: layout, memory, fits, predicted speed and the step time by part (with split placement the
    rollout GPUs' side too)."""
    out = {"layout": e.layout.to_dict(), "memory_gib": e.memory_gib(), "fits": e.fits,
           "predicted": {"step_time_s": round(e.step_time_s, 4), "mfu": round(e.mfu, 4),
                         "training_mfu": round(e.training_mfu, 4),
                         "tokens_per_s_per_gpu": round(e.tokens_per_s_per_gpu, 1)},
           "time_breakdown_s": {k: round(v, 6) for k, v in e.breakdown_s.items()}}
    if e.split is not None:
        out["split"] = e.split.to_dict()
    pool = generation_pool(e)
    if pool is not None:
        out["kv_pool"] = pool.to_dict()
    return out


def layout_arg(layout: Layout) -> str:
    """The --layout value that keeps every key of ``layout`` (parse_layout reads it back; the split keys are
    spelt out, so the same pipeline split comes back)."""
    values = {key: value for key, value in layout.to_dict().items() if key != "dp"}
    short = {"micro_batch_size": "mbs", "sequence_parallel": "sp"}
    return ",".join(f"{short.get(key, key)}={as_yaml(value)}" for key, value in values.items() if value is not None)


def parse_layout(text: str) -> dict:
    """'tp=8,pp=16,vpp=4,cp=1,ep=1,mbs=1,recompute=selective,sp=true' -> partial layout dict with the
    ``parallel:`` names (PLANNED_KEYS and etp; mbs and sp are short for micro_batch_size and sequence_parallel)."""
    aliases = {"mbs": "micro_batch_size", "sp": "sequence_parallel"}
    ints = {"tp", "pp", "vpp", "cp", "ep", "etp", "micro_batch_size", "first_stage_layers", "last_stage_layers",
            "recompute_num_layers"}
    bools = {"sequence_parallel", "account_for_embedding", "account_for_loss"}
    out: dict = {}
    # a comma inside a pipeline_layout is Megatron's cosmetic one: items start at a comma before 'key='
    for item in filter(None, (p.strip() for p in re.split(r",(?=\s*[A-Za-z_]+\s*=)", str(text)))):
        if "=" not in item:
            raise ConfigError(f"--layout: '{item}' is not key=value (e.g. tp=8,pp=16,mbs=1)")
        key, value = (x.strip() for x in item.split("=", 1))
        key = aliases.get(key.lower(), key.lower())
        if key in out:
            raise ConfigError(f"--layout: {key} is given twice; give it once")
        if key in ints:
            try:
                out[key] = int(value)
            except ValueError:
                raise ConfigError(f"--layout {key}={value}: must be an integer") from None
            if out[key] < 1:
                raise ConfigError(f"--layout {key}={value}: must be >= 1")
        elif key in bools:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"--layout {key}={value}: must be true or false")
            out[key] = value.lower() in ("true", "1", "yes")
        elif key == "pipeline_layout":
            out[key] = value
        elif key == "recompute":
            if value not in RECOMPUTE_MODES:
                raise ConfigError(f"--layout recompute={value}: use one of {', '.join(RECOMPUTE_MODES)}")
            out[key] = value
        else:
            known = sorted(ints | bools | {"recompute", "pipeline_layout"} | set(aliases))
            raise ConfigError(f"--layout: unknown field '{key}'{did_you_mean(key, known)}; known: {', '.join(known)}")
    return out


def _workload(shape: ModelShape, *, num_gpus: int, gpu_type: str, seq_length: int | None, global_batch_size: int,
              mode: str, precision: str, grpo: GrpoSizing | None, runtime: Runtime | None,
              split: SplitPlacement | None = None, pads_sequences: bool | None = None) -> Workload:
    gpu = get_gpu(gpu_type) if isinstance(gpu_type, str) else gpu_type
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ConfigError(f"--gpus must be a positive integer, got {num_gpus!r}")
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"--global-batch-size must be a positive integer, got {global_batch_size!r}")
    if mode not in MODES:
        raise ConfigError(f"--mode {mode!r}: use one of {', '.join(MODES)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision == "fp8" and not gpu.fp8_tflops:
        raise ConfigError(f"--precision fp8: {gpu.name} has no fp8 tensor cores; use bf16")
    seq = shape.seq_length if seq_length is None else seq_length
    if not isinstance(seq, int) or seq < 1:
        raise ConfigError(f"--seq-len must be a positive integer, got {seq!r}")
    if seq > shape.max_position_embeddings:
        raise ConfigError(f"--seq-len {seq} exceeds the model's max_position_embeddings "
                          f"({shape.max_position_embeddings})")
    if grpo is not None and mode in RL_MODES:
        _check_rollout(grpo, seq)
    if split is not None:
        _check_split(split, mode)
    return Workload(shape=shape, gpu=gpu, num_gpus=num_gpus, seq_length=seq, global_batch_size=global_batch_size,
                    mode=mode, precision=precision, runtime=runtime or Runtime(), grpo=grpo, split=split,
                    pads_sequences=pads_sequences)


def _check_split(split: SplitPlacement, mode: str) -> None:
    """One-line errors for a split placement the step model cannot take."""
    if mode != "grpo":
        raise ConfigError(f"cluster.rollout_tasks={split.rollout_gpus}: separate rollout GPUs are planned for "
                          f"grpo only, not {mode}; set cluster.rollout_tasks=0")
    if split.rollout_gpus < 1:
        raise ConfigError(f"cluster.rollout_tasks={split.rollout_gpus}: split placement needs at least one rollout GPU")
    if split.weight_sync not in ("gloo", "nccl", "files"):
        raise ConfigError(f"algorithm.weight_sync={split.weight_sync}: use gloo, nccl or files")


def _describe(w: Workload) -> dict:
    out = {"model": w.shape.name, "gpus": w.num_gpus, "gpu_type": w.gpu.name, "seq_length": w.seq_length,
           "global_batch_size": w.global_batch_size, "mode": w.mode, "precision": w.precision,
           "moe": w.shape.is_moe,
           "selective_modules": list(w.selective_modules())}
    if w.mode in RL_MODES:
        g = w.grpo or GrpoSizing()
        r = rollout(w)
        out["grpo"] = {"rollout_batch_size": r.sequences, "max_prompt_length": r.prompt,
                       "max_response_length": r.response, "mean_response_length": r.mean_response,
                       "samples_per_prompt": r.group, "generation_concurrency": r.concurrency or None,
                       **({"turns": r.turns, "reply_tokens": r.reply, "env_step_s": g.env_step_s,
                           "env_concurrent_steps": g.env_concurrent_steps} if r.turns > 1 else {}),
                       "kv_memory_gib": g.kv_memory_gib, "kv_block_tokens": g.kv_block_tokens,
                       "cuda_graphs": g.cuda_graphs,
                       "reference_model": g.reference_model and w.mode != "eval",
                       "recompute_old_logprobs": g.recompute_old_logprobs and w.mode != "eval",
                       "reward_model": g.reward_model, "train_seq_length": r.train_seq,
                       "teacher_params": g.teacher_params, "teacher_offloaded": g.teacher_offloaded,
                       "optimizer_steps": r.steps, "kv_cache_released_for_training": g.kv_cache_released_for_training,
                       "optimizer_offloaded_for_generation": g.optimizer_offloaded_for_generation}
    if w.mode == "dpo":
        out["dpo"] = {"pairs": w.global_batch_size, "sequences": 2 * w.global_batch_size,
                      "reference": "log-probs precomputed once over the data; no reference model held"}
    if w.split is not None:
        out["split"] = {"rollout_gpus": w.split.rollout_gpus, "max_staleness": w.split.max_staleness,
                        "weight_sync": w.split.weight_sync}
    out["runtime"] = {"transformer_engine": w.runtime.transformer_engine,
                      "attention": "flash" if w.runtime.flash_attention else "unfused",
                      "tp_comm_overlap": w.runtime.tp_comm_overlap,
                      "overlap_grad_reduce": w.runtime.overlap_grad_reduce,
                      "main_grad_bytes": w.runtime.main_grad_bytes, "memory_margin": w.runtime.memory_margin}
    if w.runtime.comm_backend != "nccl":  # named only when it is not the default
        out["runtime"]["comm_backend"] = w.runtime.comm_backend
    return out


def _check_rollout(g: GrpoSizing, seq: int) -> None:
    """One-line errors for a rollout sizing the step model cannot take."""
    if g.rollout_batch_size is not None and g.rollout_batch_size < 1:
        raise ConfigError("grpo rollout_batch_size must be >= 1")
    prompt = g.max_prompt_length if g.max_prompt_length is not None else seq // 4
    response = g.max_response_length if g.max_response_length is not None else seq - prompt
    mean = g.mean_response_length
    if mean is not None and not 1 <= mean <= response:
        raise ConfigError(f"--mean-response-len {mean}: give a length from 1 to the longest response ({response})")


def _rejections(outcome: SearchOutcome) -> dict[str, dict]:
    return {k: {"count": n, "example": outcome.examples[k]} for k, n in outcome.rejections.most_common()}


def _alternatives(best: Estimate, ranked: list[Estimate], top_k: int) -> tuple[Estimate, ...]:
    """Up to top_k of ``ranked`` (fastest first, ``best`` first of all): the fastest of each (tp, pp, cp, ep) other
    than best's, then the fastest of each remaining (tp, pp, vpp, cp, ep)."""
    sizes = {_sizes_key(best.layout)}
    per_size = []
    for e in ranked:
        if len(per_size) >= top_k:
            break
        if _sizes_key(e.layout) not in sizes:
            sizes.add(_sizes_key(e.layout))
            per_size.append(e)
    seen = {_parallel_key(e.layout) for e in (best, *per_size)}
    others = []
    for e in ranked:
        if len(per_size) + len(others) >= top_k:
            break
        if _parallel_key(e.layout) not in seen:
            seen.add(_parallel_key(e.layout))
            others.append(e)
    return (*per_size, *others)


def _sizes_key(layout: Layout) -> tuple:
    return (layout.dims.tp, layout.dims.pp, layout.dims.cp, layout.dims.ep)


def _parallel_key(layout: Layout) -> tuple:
    return (layout.dims.tp, layout.dims.pp, layout.dims.vpp, layout.dims.cp, layout.dims.ep)


def _runner_up(w: Workload, best: Estimate, alternatives: tuple[Estimate, ...], kept: Mapping[str, Any],
               limits_held: Mapping[str, Any]) -> RunnerUp | None:
    """The planner's own pick when the ``kept`` keys excluded a faster layout, else the first alternative."""
    if kept:
        free = search(w, dict(limits_held), keep_all=False).fitting
        own = min(free, key=lambda e: (e.step_time_s, e.total), default=None)
        if own is not None and own.step_time_s < best.step_time_s:
            return runner_up(best, own, kept)
    return runner_up(best, alternatives[0]) if alternatives else None


def _nearest_fitting(w: Workload, kept: Mapping[str, Any], limits_held: Mapping[str, Any]) -> Estimate | None:
    """The fitting layout that changes the ``kept`` keys least: searched with the kept TP/CP/EP/SP held first
    (more pipeline stages, more recompute, a smaller micro-batch), with only the trainer limits held if none fits."""
    sizes = {k: v for k, v in kept.items() if k in SIZE_KEYS}
    attempts = [{**limits_held, **sizes}] if sizes else []
    for held in (*attempts, dict(limits_held)):
        try:
            found = nearest(search(w, held, keep_all=True).fitting, kept)
        except ConfigError:
            continue
        if found is not None:
            return found
    return None


def plan(shape: ModelShape, *, num_gpus: int, gpu_type: str, seq_length: int | None = None,
         global_batch_size: int, mode: str = "pretrain", precision: str = "bf16", grpo: GrpoSizing | None = None,
         top_k: int = 5, runtime: Runtime | None = None, fixed: Mapping[str, Any] | None = None,
         limits: Mapping[str, tuple[Any, str]] | None = None, split: SplitPlacement | None = None,
         pads_sequences: bool | None = None) -> PlanResult:
    """Search every legal layout and return the fastest that fits; NoFeasibleLayout (with the smallest GPU count
    that would fit) when none does. ``fixed``: layout keys (PLANNED_KEYS) the search keeps. ``limits``:
    key -> (value, why) for values the job can only run at (megatron_rl.spec.limits); held fixed like ``fixed``, which
    must agree with them, and reported by explain() and to_dict(). ``split``: separate rollout GPUs (rl_step.py);
    ``num_gpus`` then counts the training GPUs alone, and the result suggests a rollout GPU count.
    ``pads_sequences``: the job's trainer rounds its sequence lengths up itself (``Workload.pads_sequences``)."""
    limits = dict(limits or {})
    constraints = dict(fixed or {})
    check_limits(constraints, limits)
    limits_held = _held_limits(limits)
    check_runtime(runtime)
    w = _workload(shape, num_gpus=num_gpus, gpu_type=gpu_type, seq_length=seq_length,
                  global_batch_size=global_batch_size, mode=mode, precision=precision, grpo=grpo, runtime=runtime,
                  split=split, pads_sequences=pads_sequences)
    start = time.perf_counter()
    outcome = search(w, {**limits_held, **constraints}, keep_all=False)
    elapsed = time.perf_counter() - start
    if not outcome.fitting:
        raise _no_fit(w, outcome, constraints, limits, with_nearest=top_k > 0)
    ranked = sorted(outcome.fitting, key=lambda e: (e.step_time_s, e.total))
    best = ranked[0]
    alternatives = _alternatives(best, ranked, top_k)
    return PlanResult(layout=best.layout, estimate=best, alternatives=alternatives,
                      runner_up=_runner_up(w, best, alternatives, constraints, limits_held) if top_k else None,
                      rejections=_rejections(outcome), considered=outcome.considered, evaluated=outcome.evaluated,
                      search_seconds=elapsed, workload=_describe(w), constraints=constraints, limits=limits,
                      rollout_suggestion=suggest_rollout_tasks(w, best))


def _no_fit(w: Workload, outcome: SearchOutcome, constraints: Mapping[str, Any],
            limits: Mapping[str, tuple[Any, str]], *, with_nearest: bool) -> NoFeasibleLayout:
    """The one-line error for a search that found nothing fitting: what it kept, what ruled the candidates out,
    the leanest one's memory, the nearest fitting layout (with kept keys and ``with_nearest``) and the smallest
    GPU count that fits."""
    limits_held = _held_limits(limits)
    held = {**limits_held, **constraints}
    smallest = smallest_fitting_gpus(w, held)
    reasons = "; ".join(f"{k}: {v['count']}" for k, v in _rejections(outcome).items()) or "no candidates"
    rollout = f" training GPUs (+ {w.split.rollout_gpus} rollout)" if w.split is not None else ""
    where = (f"the smallest GPU count that fits is {smallest} x {w.gpu.name}{rollout}" if smallest else
             f"no GPU count up to {_MAX_GPUS} fits" + (" while keeping those" if held else
                                                      "; shorten the sequence or the batch"))
    overflow = outcome.examples.get("rollout GPU memory")
    if smallest is None and overflow is not None:
        where = f"more training GPUs do not help while {overflow}"
    leanest = outcome.leanest
    needs = (f"; the leanest layout needs {leanest.total / GIB:.1f} of {leanest.capacity / GIB:.1f} GiB"
             if leanest is not None else "")
    near = _nearest_fitting(w, constraints, limits_held) if constraints and with_nearest else None
    hint = (f"; nearest layout that fits: --layout {layout_arg(near.layout)} ({near.total / GIB:.1f} GiB)"
            if near is not None else "")
    limited = {k: value for k, (value, _) in limits.items() if k not in constraints}
    kept = ((f", keeping {_pairs(constraints)}" if constraints else "")
            + (f", trainer limits {_pairs(limited)}" if limited else ""))
    return NoFeasibleLayout(f"no layout of {w.shape.name} fits on {w.num_gpus} x {w.gpu.name}{rollout} "
                            f"(seq {w.seq_length}, global batch {w.global_batch_size}, mode {w.mode}{kept}; "
                            f"ruled out: {reasons}){needs}{hint}; {where}", smallest_gpus=smallest, leanest=leanest,
                            nearest=near)


def _held_limits(limits: Mapping[str, tuple[Any, str]]) -> dict[str, Any]:
    """The layout keys the trainer limits hold, with their values."""
    return {k: value for k, (value, _) in limits.items() if k in PLANNED_KEYS}


def _pairs(values: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={as_yaml(v)}" for k, v in values.items())


def evaluate(shape: ModelShape, layout_partial: dict | str, *, num_gpus: int, gpu_type: str,
             seq_length: int | None = None, global_batch_size: int, mode: str = "pretrain",
             precision: str = "bf16", grpo: GrpoSizing | None = None, top_k: int = 5,
             runtime: Runtime | None = None, split: SplitPlacement | None = None) -> PlanResult:
    """Evaluate a (partial) layout; the planner fills what it leaves out. Illegal -> ConfigError with the reason;
    legal but too big -> a result with fits False. ``split`` as for plan()."""
    fixed = parse_layout(layout_partial) if isinstance(layout_partial, str) else dict(layout_partial)
    if "mbs" in fixed:
        fixed["micro_batch_size"] = fixed.pop("mbs")
    if "sp" in fixed:
        fixed["sequence_parallel"] = fixed.pop("sp")
    w = _workload(shape, num_gpus=num_gpus, gpu_type=gpu_type, seq_length=seq_length,
                  global_batch_size=global_batch_size, mode=mode, precision=precision, grpo=grpo, runtime=runtime,
                  split=split)
    start = time.perf_counter()
    outcome = search(w, fixed, keep_all=True)
    elapsed = time.perf_counter() - start
    if outcome.fitting:
        ranked = sorted(outcome.fitting, key=lambda e: (e.step_time_s, e.total))
        chosen, alts = ranked[0], _alternatives(ranked[0], ranked, top_k)
    elif outcome.leanest is not None:
        chosen, alts = outcome.leanest, ()
    else:
        reasons = "; ".join(f"{k}: {v['example']}" for k, v in _rejections(outcome).items()) or "no candidates"
        raise ConfigError(f"--layout {layout_partial}: no legal completion ({reasons})")
    return PlanResult(layout=chosen.layout, estimate=chosen, alternatives=alts,
                      runner_up=runner_up(chosen, alts[0]) if alts else None, rejections=_rejections(outcome),
                      considered=outcome.considered, evaluated=outcome.evaluated, search_seconds=elapsed,
                      workload=_describe(w))


_MAX_GPUS = 131072


def smallest_fitting_gpus(w: Workload, fixed: Mapping[str, Any] | None = None) -> int | None:
    """Smallest GPU count (same GPU type, model, sequence, batch, mode and ``fixed`` layout keys) with a layout
    that fits.

    Counts are whole nodes above one node (with split placement the training GPUs are the nodes' GPUs less the
    rollout GPUs, and the count returned is the training GPUs). Doubling finds a count that fits (trying the nodes
    for the next power of two training GPUs too, where batch sizes divide), bisection narrows it assuming more GPUs
    never hurt, and a short scan below the answer catches batch-divisibility gaps."""
    from dataclasses import replace

    gpn = w.gpu.gpus_per_node
    rollout = w.split.rollout_gpus if w.split is not None else 0

    def fits(world: int) -> bool:
        if world - rollout < 1:
            return False
        try:
            return bool(search(replace(w, num_gpus=world - rollout), fixed, first_fit=True).fitting)
        except ConfigError:  # the fixed keys cannot split this count
            return False

    wb, gb, _ = w.weight_bytes_per_param(1)
    floor = w.shape.num_params() * (wb + gb) / (w.gpu.memory_gib * 1024**3)  # weights + grads must fit
    small = [c for c in range(1, gpn + 1) if gpn % c == 0 and c - rollout > w.num_gpus and c - rollout >= floor]
    for c in small:
        if fits(c):
            return c - rollout
    lo = max(1, -(-(max(w.num_gpus + 1, int(floor)) + rollout) // gpn))  # in nodes
    hi = lo
    while not fits(hi * gpn):
        if hi * gpn >= _MAX_GPUS:
            return None
        training = hi * gpn - rollout
        round_up = -(-((1 << (training - 1).bit_length()) + rollout) // gpn)  # nodes for a power of two
        if round_up != hi and fits(round_up * gpn):
            lo, hi = hi + 1, round_up
            break
        lo, hi = hi + 1, min(hi * 2, _MAX_GPUS // gpn)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid * gpn):
            hi = mid
        else:
            lo = mid + 1
    best = hi
    for nodes in range(hi - 1, max(0, hi - 8), -1):
        if nodes * gpn - rollout > w.num_gpus and fits(nodes * gpn):
            best = nodes
    return best * gpn - rollout
