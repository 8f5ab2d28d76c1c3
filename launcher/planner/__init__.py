"""Parallelism planner: pick TP/PP/VPP/CP/EP/DP, micro-batch and recompute for a model on N GPUs, predict
memory per GPU and speed, and refuse what cannot run. Pure Python (no torch/megatron import).

    from launcher.model_shape import load_model_shape
    from launcher.planner import plan
    print(plan(load_model_shape("llama-3.1-405b"), num_gpus=16384, gpu_type="h100-80gb",
               global_batch_size=2048).explain())

CLI: ``python launch.py plan --model llama-3.1-405b --gpus 16384 --gpu-type h100-80gb``.
Tests: ``.venv/bin/python -m pytest tests/test_planner.py tests/test_planner_calibration.py -q``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from launcher.errors import ConfigError, did_you_mean
from launcher.limits import as_yaml, check_limits
from launcher.model_shape import ModelShape
from launcher.planner.costs import GrpoSizing, Runtime, Workload
from launcher.planner.estimate import RECOMPUTE_MODES, Estimate, Layout
from launcher.planner.gpus import GIB, GPUS, GpuSpec, get_gpu
from launcher.planner.search import SearchOutcome, search

__all__ = ["GPUS", "PLANNED_KEYS", "GpuSpec", "GrpoSizing", "Layout", "NoFeasibleLayout", "PlanResult", "Runtime",
           "evaluate", "parse_layout", "plan", "smallest_fitting_gpus"]

MODES = ("pretrain", "grpo", "rm")
PRECISIONS = ("bf16", "fp8")
PLANNED_KEYS = tuple(f.name for f in fields(Layout) if f.name != "dp")
"""The ``parallel:`` keys the planner chooses (its layout's names; dp follows from them)."""


class NoFeasibleLayout(ConfigError):
    """No legal layout fits in memory on the requested GPUs (exit code 3)."""

    exit_code = 3

    def __init__(self, message: str, *, smallest_gpus: int | None, leanest: Estimate | None = None):
        super().__init__(message)
        self.smallest_gpus = smallest_gpus
        """Smallest GPU count (same GPU type, batch, sequence and fixed keys) that fits; None if none was found."""
        self.leanest = leanest
        """The legal layout that needed the least memory, where one was estimated."""


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """A chosen (or evaluated) layout with its predicted memory and speed, and what the search saw."""

    layout: Layout
    """The chosen layout."""
    estimate: Estimate
    """Its full estimate (bytes, stage split, bubble)."""
    alternatives: tuple[Estimate, ...] = ()
    """Next-fastest fitting layouts with different parallel sizes."""
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
    def predicted(self) -> dict[str, float]:
        """step_time_s, mfu (fraction of the bf16 peak), tokens_per_s_per_gpu."""
        e = self.estimate
        return {"step_time_s": round(e.step_time_s, 4), "mfu": round(e.mfu, 4),
                "tokens_per_s_per_gpu": round(e.tokens_per_s_per_gpu, 1)}

    def to_dict(self) -> dict:
        """The issue's JSON object (plus stage split, rejections and search counts)."""
        def summary(e: Estimate) -> dict:
            return {"layout": _layout_json(e.layout), "memory_gib": e.memory_gib(), "fits": e.fits,
                    "predicted": {"step_time_s": round(e.step_time_s, 4), "mfu": round(e.mfu, 4),
                                  "tokens_per_s_per_gpu": round(e.tokens_per_s_per_gpu, 1)}}

        out = summary(self.estimate)
        out["alternatives"] = [summary(a) for a in self.alternatives]
        out["stage_layers"] = list(self.estimate.stage_layers)
        out["rejections"] = self.rejections
        out["search"] = {"considered": self.considered, "evaluated": self.evaluated,
                         "seconds": round(self.search_seconds, 4)}
        out["workload"] = self.workload
        out["constraints"] = self.constraints
        out["limits"] = {key: [value, why] for key, (value, why) in self.limits.items()}
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


def _layout_json(layout: Layout) -> dict:
    d = layout.to_dict()
    return d


def parse_layout(text: str) -> dict:
    """'tp=8,pp=16,vpp=4,cp=1,ep=1,mbs=1,recompute=selective,sp=true' -> partial layout dict with the
    ``parallel:`` names (PLANNED_KEYS and etp; mbs and sp are short for micro_batch_size and sequence_parallel)."""
    aliases = {"mbs": "micro_batch_size", "sp": "sequence_parallel"}
    ints = {"tp", "pp", "vpp", "cp", "ep", "etp", "micro_batch_size", "first_stage_layers", "last_stage_layers"}
    bools = {"sequence_parallel", "account_for_embedding", "account_for_loss"}
    out: dict = {}
    for item in filter(None, (p.strip() for p in str(text).split(","))):
        if "=" not in item:
            raise ConfigError(f"--layout: '{item}' is not key=value (e.g. tp=8,pp=16,mbs=1)")
        key, value = (x.strip() for x in item.split("=", 1))
        key = aliases.get(key.lower(), key.lower())
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
        elif key == "recompute":
            if value not in RECOMPUTE_MODES:
                raise ConfigError(f"--layout recompute={value}: use one of {', '.join(RECOMPUTE_MODES)}")
            out[key] = value
        else:
            known = sorted(ints | bools | {"recompute"} | set(aliases))
            raise ConfigError(f"--layout: unknown field '{key}'{did_you_mean(key, known)}; known: {', '.join(known)}")
    return out


def _workload(shape: ModelShape, *, num_gpus: int, gpu_type: str, seq_length: int | None, global_batch_size: int,
              mode: str, precision: str, grpo: GrpoSizing | None, runtime: Runtime | None) -> Workload:
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
    if mode == "grpo" and grpo is not None and grpo.rollout_batch_size is not None and grpo.rollout_batch_size < 1:
        raise ConfigError("grpo rollout_batch_size must be >= 1")
    return Workload(shape=shape, gpu=gpu, num_gpus=num_gpus, seq_length=seq, global_batch_size=global_batch_size,
                    mode=mode, precision=precision, runtime=runtime or Runtime(), grpo=grpo)


def _describe(w: Workload) -> dict:
    out = {"model": w.shape.name, "gpus": w.num_gpus, "gpu_type": w.gpu.name, "seq_length": w.seq_length,
           "global_batch_size": w.global_batch_size, "mode": w.mode, "precision": w.precision,
           "selective_modules": list(w.selective_modules())}
    if w.mode == "grpo":
        g = w.grpo or GrpoSizing()
        rollouts, prompt, response, _ = w.grpo_sizes()
        out["grpo"] = {"rollout_batch_size": rollouts, "max_prompt_length": prompt, "max_response_length": response,
                       "reference_model": g.reference_model,
                       "kv_cache_released_for_training": g.kv_cache_released_for_training,
                       "optimizer_offloaded_for_generation": g.optimizer_offloaded_for_generation}
    return out


def _rejections(outcome: SearchOutcome) -> dict[str, dict]:
    return {k: {"count": n, "example": outcome.examples[k]} for k, n in outcome.rejections.most_common()}


def _alternatives(best: Estimate, fitting: list[Estimate], top_k: int) -> tuple[Estimate, ...]:
    seen = {_parallel_key(best.layout)}
    alts = []
    for e in fitting:
        key = _parallel_key(e.layout)
        if key in seen:
            continue
        seen.add(key)
        alts.append(e)
        if len(alts) >= top_k:
            break
    return tuple(alts)


def _parallel_key(layout: Layout) -> tuple:
    return (layout.tp, layout.pp, layout.vpp, layout.cp, layout.ep)


def plan(shape: ModelShape, *, num_gpus: int, gpu_type: str, seq_length: int | None = None,
         global_batch_size: int, mode: str = "pretrain", precision: str = "bf16", grpo: GrpoSizing | None = None,
         top_k: int = 5, runtime: Runtime | None = None, fixed: Mapping[str, Any] | None = None,
         limits: Mapping[str, tuple[Any, str]] | None = None) -> PlanResult:
    """Search every legal layout and return the fastest that fits; NoFeasibleLayout (with the smallest GPU count
    that would fit) when none does. ``fixed``: layout keys (PLANNED_KEYS) the search keeps. ``limits``:
    key -> (value, why) for values the job can only run at (launcher.limits); held fixed like ``fixed``, which
    must agree with them, and reported by explain() and to_dict()."""
    limits = dict(limits or {})
    constraints = dict(fixed or {})
    check_limits(constraints, limits)
    held = {**{k: value for k, (value, _) in limits.items() if k in PLANNED_KEYS}, **constraints}
    w = _workload(shape, num_gpus=num_gpus, gpu_type=gpu_type, seq_length=seq_length,
                  global_batch_size=global_batch_size, mode=mode, precision=precision, grpo=grpo, runtime=runtime)
    start = time.perf_counter()
    outcome = search(w, held, keep_all=False)
    elapsed = time.perf_counter() - start
    if not outcome.fitting:
        smallest = smallest_fitting_gpus(w, held)
        reasons = "; ".join(f"{k}: {v['count']}" for k, v in _rejections(outcome).items()) or "no candidates"
        where = (f"the smallest GPU count that fits is {smallest} x {w.gpu.name}" if smallest else
                 f"no GPU count up to {_MAX_GPUS} fits" + (" while keeping those" if held else
                                                          "; shorten the sequence or the batch"))
        leanest = outcome.leanest
        needs = (f"; the leanest layout needs {leanest.total / GIB:.1f} of {leanest.capacity / GIB:.1f} GiB"
                 if leanest is not None else "")
        limited = {k: value for k, (value, _) in limits.items() if k not in constraints}
        kept = ((f", keeping {_pairs(constraints)}" if constraints else "")
                + (f", trainer limits {_pairs(limited)}" if limited else ""))
        raise NoFeasibleLayout(f"no layout of {shape.name} fits on {num_gpus} x {w.gpu.name} "
                               f"(seq {w.seq_length}, global batch {global_batch_size}, mode {mode}{kept}; "
                               f"ruled out: {reasons}){needs}; {where}", smallest_gpus=smallest, leanest=leanest)
    ranked = sorted(outcome.fitting, key=lambda e: (e.step_time_s, e.total))
    best = ranked[0]
    return PlanResult(layout=best.layout, estimate=best, alternatives=_alternatives(best, ranked, top_k),
                      rejections=_rejections(outcome), considered=outcome.considered, evaluated=outcome.evaluated,
                      search_seconds=elapsed, workload=_describe(w), constraints=constraints, limits=limits)


def _pairs(values: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={as_yaml(v)}" for k, v in values.items())


def evaluate(shape: ModelShape, layout_partial: dict | str, *, num_gpus: int, gpu_type: str,
             seq_length: int | None = None, global_batch_size: int, mode: str = "pretrain",
             precision: str = "bf16", grpo: GrpoSizing | None = None, top_k: int = 5,
             runtime: Runtime | None = None) -> PlanResult:
    """Evaluate a (partial) layout; the planner fills what it leaves out. Illegal -> ConfigError with the reason;
    legal but too big -> a result with fits False."""
    fixed = parse_layout(layout_partial) if isinstance(layout_partial, str) else dict(layout_partial)
    if "mbs" in fixed:
        fixed["micro_batch_size"] = fixed.pop("mbs")
    if "sp" in fixed:
        fixed["sequence_parallel"] = fixed.pop("sp")
    w = _workload(shape, num_gpus=num_gpus, gpu_type=gpu_type, seq_length=seq_length,
                  global_batch_size=global_batch_size, mode=mode, precision=precision, grpo=grpo, runtime=runtime)
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
    return PlanResult(layout=chosen.layout, estimate=chosen, alternatives=alts, rejections=_rejections(outcome),
                      considered=outcome.considered, evaluated=outcome.evaluated, search_seconds=elapsed,
                      workload=_describe(w))


_MAX_GPUS = 131072


def smallest_fitting_gpus(w: Workload, fixed: Mapping[str, Any] | None = None) -> int | None:
    """Smallest GPU count (same GPU type, model, sequence, batch, mode and ``fixed`` layout keys) with a layout
    that fits.

    Counts are whole nodes above one node. Doubling finds a count that fits, bisection narrows it assuming more
    GPUs never hurt, and a short scan below the answer catches batch-divisibility gaps."""
    from dataclasses import replace

    gpn = w.gpu.gpus_per_node

    def fits(count: int) -> bool:
        try:
            return bool(search(replace(w, num_gpus=count), fixed, first_fit=True).fitting)
        except ConfigError:  # the fixed keys cannot split this count
            return False

    floor = w.shape.num_params() * 6.0 / (w.gpu.memory_gib * 1024**3)  # bf16 weights + fp32 grads must fit
    small = [c for c in range(1, gpn + 1) if gpn % c == 0 and c > w.num_gpus and c >= floor]
    for c in small:
        if fits(c):
            return c
    lo = max(1, -(-max(w.num_gpus + 1, int(floor)) // gpn))  # in nodes
    hi = lo
    while not fits(hi * gpn):
        if hi * gpn >= _MAX_GPUS:
            return None
        lo, hi = hi + 1, min(hi * 2, _MAX_GPUS // gpn)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid * gpn):
            hi = mid
        else:
            lo = mid + 1
    best = hi
    for nodes in range(hi - 1, max(0, hi - 8), -1):
        if nodes * gpn > w.num_gpus and fits(nodes * gpn):
            best = nodes
    return best * gpn
