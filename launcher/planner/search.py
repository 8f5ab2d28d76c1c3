"""Enumerate every legal Megatron-Core layout for a GPU count, estimate each, keep the fastest that fit.

Legality (Megatron-Core 0.16 rules): TP inside one node; heads and query groups divisible by TP; sequence
divisible by 2*CP (load-balanced causal CP) and by TP under sequence parallelism; TP*CP*PP divides the world;
the pipeline split is one Megatron accepts (megatron_rl.spec.parallel.split_error); the global batch divides into DP*MBS
micro-batches, and interleaving needs the micro-batch count divisible by PP (default group size); experts
divisible by EP and EP dividing TP*CP*DP (expert tensor parallelism 1). With split placement (Workload.split) the
world is the training GPUs, TP*PP divides the rollout GPUs, EP is 1 and a rollout GPU must fit
(megatron_rl.spec.parallel.rollout_replica_error, split.rollout_memory_error). Fixed keys are kept and the rest searched:
a pipeline-split key (SPLIT_KEYS) without pp searches the pp values whose split Megatron accepts; a split that no pp
accepts, or none at a fixed pp, is a ConfigError.

Pruning that does not change the answer: a layout whose weights and optimizer alone overflow skips its
micro-batch and recompute variants; for one parallel layout and micro-batch size, the first recompute mode
that fits (none < selective < full in time) dominates the slower ones; a recompute mode that overflowed at a
smaller micro-batch is not estimated at larger ones (memory never falls with the micro-batch: activations grow
with it, the micro-batches in flight times its size never shrink); the time model runs only for layouts that fit
(estimate(only_if_fits=True)), and the leanest misfit is estimated in full once, at the end.

Time it: ``.venv/bin/python bench/plan_speed.py``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from launcher.planner.costs import ADAM_BYTES_PER_PARAM, GIB, Workload
from launcher.planner.estimate import Estimate, Layout, rank_groups, stage_params
from launcher.planner.rl_step import RL_MODES, estimate, generation_floor, packed_micro_batch, rollout_memory_error
from megatron_rl.spec.config.schema import RECOMPUTE_MODES
from megatron_rl.spec.errors import ConfigError, as_yaml
from megatron_rl.spec.parallel import (
    ParallelDims,
    attention_split_error,
    default_etp,
    expert_split_error,
    layout_vpp,
    microbatch_error,
    mla_error,
    mlp_split_error,
    moe_sequence_parallel_error,
    rollout_replica_error,
    sequence_error,
    split_error,
    uneven_splits,
)
from megatron_rl.spec.pipeline_layout import format_layout, layout_from_counts

MAX_CP = 64
MAX_MBS = 16
SPLIT_KEYS = ("vpp", "first_stage_layers", "last_stage_layers", "account_for_embedding", "account_for_loss",
              "pipeline_layout")
"""Layout keys that shape the pipeline split (with pp)."""


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small, large = [], []
    for i in range(1, int(math.isqrt(n)) + 1):
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
    return small + large[::-1]


@dataclass
class SearchOutcome:
    """What a search saw: fitting estimates, the leanest legal estimate, rejections, counts."""

    fitting: list[Estimate] = field(default_factory=list)
    leanest: Estimate | None = None
    rejections: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    considered: int = 0
    evaluated: int = 0
    legal_splits: int = 0
    """(pp, split) pairs that Megatron accepts, over every pp tried."""
    split_errors: dict[int, str] = field(default_factory=dict)
    """pp -> why Megatron refused every split tried at that pp."""

    def reject(self, constraint: str, count: int, example: str) -> None:
        """Count `count` candidate layouts ruled out by `constraint`."""
        self.rejections[constraint] += count
        self.examples.setdefault(constraint, example)


LAYOUT_VPPS = (1, 2, 4, 8)
"""Virtual stages per rank the search tries as pipeline layouts where no other split is legal."""
STAGE_WEIGHTS = ((0, 1), (1, 1), (0, 2))
"""(embedding, loss) weights in decoder layers that balanced_layout tries: the output layer and loss cost one or two
layers' time, the embedding next to nothing or a layer's memory."""


def pipeline_splits(num_layers: int, pp: int, vpp_fixed: int | None, fixed: dict) -> list[tuple]:
    """Candidate (first, last, emb, loss, vpp, layout) splits for `pp`, with the planner choosing what is not fixed:
    Megatron's even and uneven splits, then, at each virtual size none of them reaches, pipeline layouts that
    balance the ranks with the embedding and loss weighed as STAGE_WEIGHTS (61 layers at pp 8 x vpp 4)."""
    keys = ("first_stage_layers", "last_stage_layers", "account_for_embedding", "account_for_loss")
    if "pipeline_layout" in fixed:
        layout = fixed["pipeline_layout"]
        return [(None, None, False, False, vpp_fixed or layout_vpp(layout, pp), layout)]
    if any(k in fixed for k in keys):
        base = [(fixed.get(keys[0]), fixed.get(keys[1]), bool(fixed.get(keys[2], False)),
                 bool(fixed.get(keys[3], False)))]
    elif pp == 1:
        base = [(None, None, False, False)]
    else:
        base = [(None, None, False, False), (None, None, False, True), (None, None, True, True)]
        if num_layers % pp:
            base.extend((f, l, False, False) for f, l in uneven_splits(num_layers, pp))
    out = []
    for first, last, emb, loss in base:
        if first is None and last is None:
            total = num_layers + emb + loss
            per_rank = total // pp if total % pp == 0 else 1
        else:
            middle = pp - (first is not None) - (last is not None)
            rest = num_layers - (first or 0) - (last or 0)
            per_rank = math.gcd(math.gcd(first or 0, last or 0), rest // middle if middle and rest % middle == 0 else 0)
            per_rank = per_rank or 1
        vpps = [vpp_fixed] if vpp_fixed else (divisors(per_rank) if pp > 1 else [1])
        out.extend((first, last, emb, loss, v, None) for v in vpps)
    if pp == 1 or any(k in fixed for k in keys):
        return out
    reached = {c[4] for c in out if split_error(num_layers, pp, *c[4:5], *c[:4]) is None}
    for vpp in [vpp_fixed] if vpp_fixed else LAYOUT_VPPS:
        if vpp in reached or pp * vpp > num_layers + 2:
            continue
        layouts = dict.fromkeys(balanced_layout(num_layers, pp, vpp, emb, loss) for emb, loss in STAGE_WEIGHTS)
        out.extend((None, None, False, False, vpp, layout) for layout in layouts)
    return out


@lru_cache(maxsize=1024)
def balanced_layout(num_layers: int, pp: int, vpp: int, emb: int, loss: int) -> str:
    """A pipeline layout of ``num_layers`` decoder layers on pp x vpp stages, each layer placed on the stage whose rank
    (then the stage itself) carries the least so far, the embedding and the loss counted as ``emb`` and ``loss``
    layers; Megatron's syntax (megatron_rl/spec/pipeline_layout.py)."""
    stages = pp * vpp
    rank_load, stage_load = [0] * pp, [0] * stages
    for stage, weight in ((0, emb), (stages - 1, loss)):
        rank_load[stage % pp] += weight
        stage_load[stage] += weight
    counts = [0] * stages
    for _ in range(num_layers):
        stage = min(range(stages), key=lambda i: (rank_load[i % pp], stage_load[i], i))
        counts[stage] += 1
        rank_load[stage % pp] += 1
        stage_load[stage] += 1
    return format_layout(layout_from_counts(tuple(counts)))


class _FirstFit(Exception):
    pass


def search(w: Workload, fixed: dict | None = None, *, keep_all: bool = True, first_fit: bool = False,
           prune: bool = True) -> SearchOutcome:
    """All legal layouts for `w` consistent with `fixed` (a partial layout); raises ConfigError if a fixed
    field is itself illegal. keep_all=False keeps only the fastest recompute mode per layout and micro-batch;
    first_fit stops at the first layout that fits; prune=False estimates every candidate (the brute-force
    reference that bench/plan_speed.py times)."""
    fixed = dict(fixed or {})
    out = SearchOutcome()
    leanest: list = []  # [total bytes, layout] of the leanest layout that does not fit
    try:
        _search(w, fixed, out, keep_all and not first_fit, first_fit, prune, leanest)
    except _FirstFit:
        pass
    if leanest:
        out.leanest = estimate(w, leanest[1])
    if not out.legal_splits and out.split_errors and any(k in fixed for k in SPLIT_KEYS):
        pp = max(out.split_errors)
        raise ConfigError(f"--layout {_given(fixed, SPLIT_KEYS)}: no pp gives a legal pipeline split of "
                          f"{w.shape.num_layers} layers (at pp={pp}: {out.split_errors[pp]})")
    return out


def _given(fixed: dict, keys: tuple[str, ...]) -> str:
    """The fixed ``keys`` as the --layout text that gave them."""
    return ",".join(f"{k}={as_yaml(fixed[k])}" for k in keys if k in fixed)


def _search(w: Workload, fixed: dict, out: SearchOutcome, keep_all: bool, first_fit: bool, prune: bool,
            leanest: list) -> None:
    s, world, gpn = w.shape, w.num_gpus, w.gpu.gpus_per_node
    gpus = f"{world} training GPUs" if w.split is not None else f"{world} GPUs"
    capacity = w.gpu.memory_gib * GIB * (1.0 - w.runtime.memory_margin)
    overhead = w.runtime.overhead_gib * GIB

    def bad(fields: tuple[str, ...], constraint: str, example: str, count: int = 1) -> None:
        # a constraint decided only by fixed --layout fields is the user's error: say why, stop
        if all(f in fixed for f in fields):
            given = ",".join(f"{f}={fixed[f]}" for f in fields)
            raise ConfigError(f"--layout {example}" if example.startswith(given) else f"--layout {given}: {example}")
        out.reject(constraint, count, example)

    tps = [fixed["tp"]] if "tp" in fixed else divisors(gpn)
    for tp in tps:
        if tp < 1 or tp > gpn:
            bad(("tp",), "TP within a node", f"tp={tp} exceeds the {gpn} GPUs of one NVLink node")
            continue
        why = attention_split_error(s, tp, key="")
        if why:
            bad(("tp",), "heads or query groups % tp", why)
            continue
        if w.split is not None:  # tp divides the rollout tasks whatever pp is: say so before the world's sizes
            why = rollout_replica_error(w.split.rollout_gpus, *w.split.replica(tp, fixed.get("pp", 1)), 1)
            if why:
                bad(("tp", "pp") if "pp" in fixed else ("tp",), "rollout_tasks % (tp*pp)", why)
                continue
        sps = [fixed["sequence_parallel"]] if "sequence_parallel" in fixed else [tp > 1]
        cps = [fixed["cp"]] if "cp" in fixed else [c for c in (1, 2, 4, 8, 16, 32, MAX_CP) if c * tp <= world]
        for sp in sps:
            if sp and tp == 1:
                sp = False
            why = moe_sequence_parallel_error(s, tp, sp, key="")
            if why:
                bad(("tp", "sequence_parallel"), "MoE needs SP with TP", why)
                continue
            for cp in cps:
                if cp < 1:
                    bad(("cp",), "cp >= 1", f"cp={cp} must be a positive integer")
                    continue
                why = sequence_error(w.seq_length, tp=tp, cp=cp, sp=sp, pads=w.pads_sequences, key="")
                if why:
                    bad(("tp", "cp"), "sequence % (2*cp, tp*cp with SP)", why)
                    continue
                why = mla_error(s, tp=tp, cp=cp, sp=sp, transformer_engine=w.runtime.transformer_engine, key="")
                if why:
                    bad(("tp", "cp", "sequence_parallel"), "MLA without TE", why)
                    continue
                if world % (tp * cp):
                    bad(("tp", "cp"), "world % (tp*cp*pp)", f"{gpus} not divisible by tp*cp={tp * cp}")
                    continue
                rest = world // (tp * cp)
                pps = [fixed["pp"]] if "pp" in fixed else [p for p in divisors(rest) if p <= s.num_layers + 2]
                for pp in pps:
                    if pp < 1 or rest % pp:
                        bad(("tp", "cp", "pp"), "world % (tp*cp*pp)", f"{gpus} not divisible by tp*cp*pp={tp * cp * pp}")
                        continue
                    why = (rollout_replica_error(w.split.rollout_gpus, *w.split.replica(tp, pp), 1)
                           if w.split is not None else None)
                    if why:
                        bad(("tp", "pp"), "rollout_tasks % (tp*pp)", why)
                        continue
                    _search_pp(w, fixed, out, tp, sp, cp, pp, world // (tp * cp * pp), capacity, overhead, bad,
                               keep_all, first_fit, prune, leanest)


def _search_pp(w, fixed, out, tp, sp, cp, pp, dp, capacity, overhead, bad, keep_all, first_fit, prune, leanest):
    s = w.shape
    if "dp" in fixed and fixed["dp"] != dp:
        bad(("dp", "tp", "cp", "pp"), "dp = gpus/(tp*cp*pp)", f"{w.num_gpus} GPUs give dp = {w.num_gpus}/(tp*cp*pp) "
            f"= {dp}, not {fixed['dp']}")
        return
    if w.global_batch_size % dp:
        bad(("tp", "cp", "pp"), "global batch % dp", f"global batch {w.global_batch_size} not divisible by dp={dp}")
        return
    per_dp = w.global_batch_size // dp
    if "micro_batch_size" in fixed:
        mbss = [fixed["micro_batch_size"]]
    elif w.mode in RL_MODES and w.grpo is not None and w.grpo.packed:  # the rows a micro_batch_tokens batch holds
        mbss = [packed_micro_batch(w, per_dp)]
    else:
        mbss = [b for b in divisors(per_dp) if b <= MAX_MBS]
    modes = [fixed["recompute"]] if "recompute" in fixed else list(RECOMPUTE_MODES)
    partial = fixed.get("recompute_num_layers")
    if partial is not None:
        if modes != ["full"] and "recompute" in fixed:
            raise ConfigError(f"--layout recompute_num_layers={partial} needs recompute=full (it is {modes[0]})")
        modes = ["full"]
    inner = len(mbss) * len(modes)
    overflow = (f"needs more than {capacity / GIB:.1f} GiB per GPU (capacity {w.gpu.memory_gib:.1f} less the "
                f"{100 * w.runtime.memory_margin:.0f}% margin)")
    if s.is_moe and w.split is None:
        eps = [fixed["ep"]] if "ep" in fixed else [e for e in divisors(s.num_experts) if (tp * cp * dp) % e == 0]
    else:
        eps = [fixed.get("ep", 1)]
    splits, whys = [], []
    for cand in pipeline_splits(s.num_layers, pp, fixed.get("vpp"), fixed):
        why = split_error(s.num_layers, pp, cand[4], *cand[:4], cand[5])
        (whys if why else splits).append(why or cand)
    if not splits and "pp" in fixed:
        raise ConfigError(f"--layout {_given(fixed, (*SPLIT_KEYS, 'pp'))}: no legal pipeline split for "
                          f"{s.num_layers} layers: {whys[0]}")
    out.legal_splits += len(splits)
    if not splits:
        out.split_errors[pp] = whys[0]
    for why in whys:
        out.reject("pipeline split", inner * len(eps), why)
        out.considered += inner * len(eps)
    for first, last, emb, loss, vpp, layout in splits:
        for ep in eps:
            out.considered += inner
            why = f"ep={ep} must be a positive integer" if ep < 1 else expert_split_error(s, ep, key="")
            if why:
                bad(("ep",), "experts % ep", why, inner)
                continue
            etp = fixed.get("etp") or default_etp(tp=tp, ep=ep)
            why = mlp_split_error(s, tp, etp, key="")
            if why:
                bad(("tp", "ep", "etp"), "MLP sizes % tp", why, inner)
                continue
            if (tp * cp * dp) % (ep * etp):
                bad(("ep", "etp", "tp", "cp", "pp"), "ep*etp | tp*cp*dp",
                    f"ep*etp={ep}*{etp} does not divide tp*cp*dp={tp * cp * dp}", inner)
                continue
            if w.split is not None and ep != 1:
                bad(("ep",), "split placement at ep=1",
                    rollout_replica_error(w.split.rollout_gpus, *w.split.replica(tp, pp), ep), inner)
                continue
            dims = ParallelDims(world_size=w.num_gpus, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, sp=sp,
                                first_stage_layers=first, last_stage_layers=last, account_for_embedding=emb,
                                account_for_loss=loss, pipeline_layout=layout,
                                **w.split.dims_keys() if w.split is not None else {})
            probe = Layout(dims=dims, micro_batch_size=1, recompute="full")
            why = rollout_memory_error(w, probe) if w.split is not None else None
            if why:
                out.reject("rollout GPU memory", inner, why)
                continue
            if prune and not fixed and _static_bytes(w, probe) + overhead > capacity:
                out.reject("memory", inner, f"weights+grads+optimizer alone exceed {w.gpu.memory_gib:.0f} GiB")
                continue
            if prune and not fixed and w.mode in RL_MODES and _generation_bytes(w, probe, overhead) > capacity:
                out.reject("memory", inner, "the generation phase alone (weights, frozen models, KV cache, buffers) "
                           f"exceeds {capacity / GIB:.0f} GiB")
                continue
            overflowed = set()  # recompute modes that overflowed at a smaller micro-batch: they do at larger ones
            for mbs in mbss:
                if mbs < 1 or per_dp % mbs:
                    bad(("micro_batch_size", "tp", "cp", "pp"), "global batch % (dp*mbs)",
                        f"global batch {w.global_batch_size} not divisible by dp*mbs={dp * mbs}", len(modes))
                    continue
                why = microbatch_error(w.global_batch_size, micro_batch=mbs, dp=dp, pp=pp, vpp=vpp, key="")
                if why:
                    bad(("vpp", "micro_batch_size", "tp", "cp", "pp"), "micro-batches % pp (VPP)", why, len(modes))
                    continue
                for mode in modes:
                    if mode not in RECOMPUTE_MODES:
                        raise ConfigError(f"--layout recompute={mode}: use one of {', '.join(RECOMPUTE_MODES)}")
                    if prune and mode in overflowed:
                        out.reject("memory", 1, overflow)
                        continue
                    lay = Layout(dims=dims, micro_batch_size=mbs, recompute=mode, recompute_num_layers=partial)
                    est = estimate(w, lay, only_if_fits=prune)
                    out.evaluated += 1
                    if isinstance(est, float) or not est.fits:
                        total = est if isinstance(est, float) else est.total
                        out.reject("memory", 1, overflow)
                        overflowed.add(mode)
                        if not leanest or total < leanest[0]:
                            leanest[:] = (total, lay)
                    else:
                        out.fitting.append(est)
                        if first_fit:
                            raise _FirstFit
                        if not keep_all:
                            break


def _generation_bytes(w: Workload, layout: Layout, overhead: float) -> float:
    """rl_step.generation_floor with the overhead it would get: a lower bound of any variant's total."""
    return generation_floor(w, layout) * (1 + w.runtime.fragmentation) + overhead


def _static_bytes(w: Workload, layout: Layout) -> float:
    """Weights + grads + optimizer bytes on the fullest pipeline rank."""
    s = w.shape
    groups = rank_groups(s.moe_layers, s.num_layers, layout.dims.pp, layout.dims.vpp, *layout.dims.split())
    wb, gb, _ = w.weight_bytes_per_param(1)
    opt = ADAM_BYTES_PER_PARAM if gb else 0.0  # eval holds no optimizer
    dist = w.runtime.distributed_optimizer
    shard, edp = layout.dims.dp * layout.dims.cp, layout.dims.edp
    worst = 0.0
    for gr in groups:
        ne, ex = stage_params(w, gr, layout)
        optimizer = ne * (opt / shard if dist else opt) + ex * (opt / edp if dist else opt)
        worst = max(worst, (ne + ex) * (wb + gb) + optimizer)
    return worst
