"""One layout in, memory per GPU and step time out: the Layout type, Megatron's pipeline splits, one optimizer
step's estimate (training_estimate) and its time by part (TIME_PARTS, Estimate.breakdown_s). rl_step.py builds the
post-training modes on training_estimate, and its estimate() takes any mode.

The pipeline split follows Megatron-Core's rules (transformer_config.py): an even split; or the embedding and/or
the loss counted as one layer each (--account-for-embedding/loss-in-pipeline-split); or explicit first/last
stage sizes (--decoder-first/last-pipeline-num-layers) with the middle stages even. With interleaving (VPP)
every per-stage count must divide by VPP.

Check it: ``.venv/bin/python -m pytest tests/test_planner.py -q``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, NamedTuple

from megatron_rl.spec.parallel import ParallelDims, virtual_stage_layers

from launcher.planner.costs import (
    ADAM_BYTES_PER_PARAM,
    DP_BUCKET_BYTES,
    GIB,
    LAYER_PARTS,
    OVERLAP_CONTENTION,
    LayerCost,
    Workload,
    add_parts,
    scale_parts,
)

TRAINING_PARTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_all_to_all", "pp_p2p", "pp_bubble", "dp_comm",
                  "optimizer")
"""The TIME_PARTS of the optimizer steps (what ``plan --mode pretrain`` of the same layout and tokens prints)."""
RL_PARTS = ("logprob_passes", "generation_prefill", "generation_decode", "environment", "phase_switch",
            "reward_model", "teacher", "critic", "weight_sync", "rollout_wait")
"""The TIME_PARTS an RL step adds (rl_step.py; weight_sync and rollout_wait with split placement)."""
TIME_PARTS = {"compute": "compute", "recompute": "recompute", "tp_comm": "TP communication",
              "cp_comm": "CP communication", "ep_all_to_all": "EP all-to-all", "pp_p2p": "PP send/recv",
              "pp_bubble": "PP bubble", "dp_comm": "DP grad reduce/param gather", "optimizer": "optimizer step",
              "logprob_passes": "log-prob passes", "generation_prefill": "generation prefill",
              "generation_decode": "generation decode", "environment": "environment steps",
              "phase_switch": "phase switches (KV, offload)",
              "reward_model": "reward model scoring", "teacher": "teacher (distillation)",
              "critic": "critic (values + training)",
              "weight_sync": "weight sync to rollout GPUs", "rollout_wait": "waiting for rollouts"}
"""Estimate.breakdown_s's keys (the parts of a step's time) -> what the plan calls them. The training parts
(TRAINING_PARTS) are the slowest pipeline rank's, times its micro-batches, times the optimizer steps of the step;
pp_bubble is the pipeline fill and drain; dp_comm the exposed part of the data-parallel gradient reduce and
parameter all-gather. The RL modes add RL_PARTS: the log-prob forward passes (old policy, reference), the rollout's
prefill and decode, the phase switches (KV cache allocation, optimizer offload and reload), the colocated reward
model's scoring forward and PPO's critic. With split placement (rl_step.py) the trainer GPUs do not generate: the
generation parts are 0, weight_sync is the new policy's trip to the rollout GPUs and rollout_wait the time the trainer
waits for rollouts beyond its own work (all of the generation when max_staleness=0)."""


PLANNED_KEYS = ("tp", "pp", "vpp", "cp", "ep", "etp", "micro_batch_size", "recompute", "sequence_parallel",
                "first_stage_layers", "last_stage_layers", "account_for_embedding", "account_for_loss",
                "pipeline_layout", "recompute_num_layers")
"""The ``parallel:`` keys a Layout gives (the planner's --layout names; dp follows from them)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One candidate of the search: a ParallelDims (the job's own layout type, every size and the pipeline split)
    plus what the planner picks beside it, the micro-batch and recompute."""

    dims: ParallelDims
    """The parallel layout; ``dims.world_size`` is the training GPUs."""
    micro_batch_size: int
    """Sequences per micro-batch."""
    recompute: str
    """none | selective (Runtime.selective_modules) | full (uniform, 1 layer per checkpoint)."""
    recompute_num_layers: int | None = None
    """With recompute=full: only the first N decoder layers of each virtual stage are recomputed, the others keep
    their activations (Megatron's --recompute-method block); None = every layer (uniform, 1 per checkpoint).
    Never searched: kept when given."""

    @classmethod
    def of(cls, *, dp: int, micro_batch_size: int, recompute: str, sequence_parallel: bool = False,
           recompute_num_layers: int | None = None, **dims) -> "Layout":
        """From the sizes by their ``parallel:`` names (to_dict's keys): the world is tp·pp·cp·dp."""
        world = dims.get("tp", 1) * dims.get("pp", 1) * dims.get("cp", 1) * dp
        return cls(dims=ParallelDims(world_size=world, sp=sequence_parallel, **dims),
                   micro_batch_size=micro_batch_size, recompute=recompute, recompute_num_layers=recompute_num_layers)

    def split_name(self) -> str:
        """Short description of the pipeline split."""
        if self.dims.pipeline_layout is not None:
            return f"layout {self.dims.pipeline_layout}"
        if self.dims.first_stage_layers is not None or self.dims.last_stage_layers is not None:
            return f"uneven first={self.dims.first_stage_layers} last={self.dims.last_stage_layers}"
        tags = [t for t, on in (("embedding", self.dims.account_for_embedding), ("loss", self.dims.account_for_loss))
                if on]
        return "even" + (f" (+{'+'.join(tags)} as layers)" if tags else "")

    def value(self, key: str):
        """The value of one ``parallel:`` key (PLANNED_KEYS) or dp."""
        if key in ("micro_batch_size", "recompute", "recompute_num_layers"):
            return getattr(self, key)
        return self.dims.sp if key == "sequence_parallel" else getattr(self.dims, key)

    def to_dict(self) -> dict:
        """JSON-ready dict: the ``parallel:`` keys (PLANNED_KEYS) and dp."""
        return {key: self.value(key) for key in (*PLANNED_KEYS, "dp")}

    def megatron_args(self, selective_modules: tuple[str, ...] = ("layernorm",)) -> dict[str, object]:
        """Megatron-LM command-line arguments for this layout (keys without the leading dashes); pass
        Workload.selective_modules() (PlanResult.megatron_args does)."""
        args: dict[str, object] = {
            "tensor-model-parallel-size": self.dims.tp, "pipeline-model-parallel-size": self.dims.pp,
            "context-parallel-size": self.dims.cp, "expert-model-parallel-size": self.dims.ep,
            "micro-batch-size": self.micro_batch_size,
        }
        if self.dims.ep > 1 or self.dims.etp != self.dims.tp:
            args["expert-tensor-parallel-size"] = self.dims.etp
        if self.dims.vpp > 1:
            args["num-virtual-stages-per-pipeline-rank"] = self.dims.vpp
        if self.dims.sp:
            args["sequence-parallel"] = True
        if self.dims.first_stage_layers is not None:
            args["decoder-first-pipeline-num-layers"] = self.dims.first_stage_layers
        if self.dims.last_stage_layers is not None:
            args["decoder-last-pipeline-num-layers"] = self.dims.last_stage_layers
        if self.dims.account_for_embedding:
            args["account-for-embedding-in-pipeline-split"] = True
        if self.dims.account_for_loss:
            args["account-for-loss-in-pipeline-split"] = True
        if self.dims.pipeline_layout is not None:
            args["pipeline-model-parallel-layout"] = self.dims.pipeline_layout
            args.pop("num-virtual-stages-per-pipeline-rank", None)  # Megatron-LM reads it from the layout
        if self.recompute == "full" and self.recompute_num_layers is not None:
            args.update({"recompute-granularity": "full", "recompute-method": "block",
                         "recompute-num-layers": self.recompute_num_layers})
        elif self.recompute == "full":
            args.update({"recompute-granularity": "full", "recompute-method": "uniform", "recompute-num-layers": 1})
        elif self.recompute == "selective":
            args["recompute-granularity"] = "selective"
            args["recompute-modules"] = list(selective_modules)
        return args


class RankGroup(NamedTuple):
    """Pipeline ranks with the same contents; memory is worst at the lowest rank (most micro-batches in flight).
    A NamedTuple: cache keys hash it on every estimate."""

    rank: int  # lowest rank of the group
    count: int  # ranks in the group
    dense_layers: int
    moe_layers: int
    first: bool  # holds the embedding
    last: bool  # holds the output layer and loss


@lru_cache(maxsize=4096)
def rank_groups(moe_pattern: tuple[bool, ...], num_layers: int, pp: int, vpp: int, first, last, emb, loss,
                layout=None):
    """Group pipeline ranks by (dense layers, MoE layers, first, last)."""
    counts = virtual_stage_layers(num_layers, pp, vpp, first, last, emb, loss, layout)
    per_rank = [[0, 0] for _ in range(pp)]
    start = 0
    for vs, n in enumerate(counts):
        r = vs % pp
        moe = sum(moe_pattern[start:start + n]) if moe_pattern else 0
        per_rank[r][0] += n - moe
        per_rank[r][1] += moe
        start += n
    groups: dict[tuple, list[int]] = {}
    for r, (dense, moe) in enumerate(per_rank):
        groups.setdefault((dense, moe, r == 0, r == pp - 1), []).append(r)
    return tuple(RankGroup(rs[0], len(rs), k[0], k[1], k[2], k[3]) for k, rs in groups.items())


class TimeTerms(NamedTuple):
    """The terms of one layout's step time as estimate() adds them up, kept apart so that the breakdown by part
    is built only for the layouts a plan shows (a NamedTuple: the search makes one per estimate)."""

    slowest: RankGroup
    """The pipeline rank group with the longest time per micro-batch (it sets the pipeline's pace)."""
    dense: LayerCost
    """One dense layer's cost per micro-batch (on the slowest group; mixed under partial recompute)."""
    moe: LayerCost
    """One MoE layer's cost per micro-batch (the dense one for dense models)."""
    output_parts: dict[str, float]
    """The output layer and loss per micro-batch, by part (on the last rank)."""
    mtp_parts: dict[str, float]
    """Multi-token prediction per micro-batch, by part (on the last rank; empty without MTP)."""
    p2p_s: float
    """Pipeline sends and receives per micro-batch on a rank."""
    micro_batches: int
    """Micro-batches per pipeline per optimizer step."""
    pp_bubble: float
    """Pipeline fill and drain seconds."""
    dp_comm: float
    """Exposed data-parallel gradient reduce and parameter all-gather seconds."""
    optimizer: float
    """Optimizer step seconds."""
    steps: int = 1
    """Optimizer steps per step (RL: epochs x rollout / global batch; eval: 0)."""
    rl_parts: dict[str, float] = {}
    """RL_PARTS seconds per step (empty outside the RL modes)."""

    def training_step(self) -> dict[str, float]:
        """Seconds of ONE optimizer step by TRAINING_PARTS key."""
        g = self.slowest
        stage = {key: g.dense_layers * self.dense.parts_s[key] + g.moe_layers * self.moe.parts_s[key]
                 for key in LAYER_PARTS}
        if g.last:
            stage = add_parts(stage, self.output_parts, self.mtp_parts)
        stage["pp_p2p"] = self.p2p_s
        return {**scale_parts(stage, self.micro_batches), "pp_bubble": self.pp_bubble, "dp_comm": self.dp_comm,
                "optimizer": self.optimizer}

    def breakdown(self) -> dict[str, float]:
        """Seconds per step by TIME_PARTS key."""
        return {**dict.fromkeys(TIME_PARTS, 0.0), **scale_parts(self.training_step(), self.steps), **self.rl_parts}


@dataclass(frozen=True)
class KvPool:
    """The paged engine's KV pool on the generation ranks of one layout (megatron_rl/generation/engine.py;
    rl_step.kv_pool makes it)."""

    budget: float
    """Bytes per GPU on the pipeline rank with the most layers: generation.kv_memory_gib. Every pipeline rank holds
    as many blocks (the engine agrees on the fewest), of fewer bytes where it has fewer layers."""
    tokens: float
    """Tokens the pool holds."""
    rows: float
    """Rows decoding at once while rows wait: the batch that continuous admission keeps full."""
    source: str
    """given (generation.kv_memory_gib), chosen (the planner's pick: what the layout's memory leaves while
    generating, up to what the rank's share needs, KV_HEADROOM), or every row (the engine's default without a
    budget: each row's blocks at its longest)."""

    key = "generation.kv_memory_gib"
    """The generation key that sets this pool (and that launch.py writes when the planner chose it)."""

    @property
    def gib(self) -> float:
        """The budget in GiB, rounded down to the hundredth that launch.py writes into generation.kv_memory_gib."""
        return math.floor(self.budget / GIB * 100) / 100

    def to_dict(self) -> dict:
        """JSON-ready summary (GiB, tokens, rows)."""
        return {"gib": self.gib, "source": self.source, "tokens": round(self.tokens),
                "rows_at_once": round(self.rows, 1), "key": self.key}


@dataclass(frozen=True, kw_only=True)
class SplitStep:
    """One layout's step under split placement: both sides and how they combine (rl_step.split_step makes it)."""

    rollout_gpus: int
    """GPUs that only generate (cluster.rollout_tasks)."""
    replicas: int
    """Rollout replicas: rollout_gpus / (tp * pp)."""
    rollout_gpu: Estimate
    """Memory (one rollout GPU, fullest pipeline rank) and generation time (step_time_s) of the rollout replicas."""
    trainer_s: float
    """Seconds of the trainer GPUs' own work per step: optimizer steps, log-prob passes, reward model, weight sync."""
    weight_sync_s: float
    """Seconds to send one policy version to the rollout GPUs (part of trainer_s)."""
    weight_sync_bytes: float
    """Bytes sent per weight sync."""
    weight_sync: str
    """algorithm.weight_sync: gloo, files or nccl."""
    overlapped: bool
    """algorithm.max_staleness > 0: generation runs while the trainer trains."""

    @property
    def generation_s(self) -> float:
        """Seconds the rollout replicas take to generate one rollout."""
        return self.rollout_gpu.step_time_s

    @property
    def step_s(self) -> float:
        """The step: the longer side when generation overlaps training, else both in turn."""
        if self.overlapped:
            return max(self.trainer_s, self.generation_s)
        return self.trainer_s + self.generation_s

    @property
    def rollout_wait_s(self) -> float:
        """Seconds the trainer waits for rollouts beyond its own work."""
        return self.step_s - self.trainer_s

    def to_dict(self) -> dict:
        """JSON-ready summary (seconds, GiB, bytes)."""
        return {"rollout_gpus": self.rollout_gpus, "replicas": self.replicas, "overlapped": self.overlapped,
                "trainer_s": round(self.trainer_s, 4), "generation_s": round(self.generation_s, 4),
                "step_s": round(self.step_s, 4), "weight_sync": self.weight_sync,
                "weight_sync_s": round(self.weight_sync_s, 4), "weight_sync_bytes": self.weight_sync_bytes,
                "rollout_gpu_memory_gib": self.rollout_gpu.memory_gib(), "rollout_gpu_fits": self.rollout_gpu.fits}


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Predicted memory (bytes, worst pipeline rank) and speed of one layout."""

    layout: Layout
    """The layout estimated."""
    weights: float
    """bf16 (+fp8 copy) weight bytes on the fullest GPU."""
    gradients: float
    """Main-gradient bytes (Runtime.main_grad_bytes per parameter)."""
    optimizer: float
    """Adam master weights and moments (sharded with the distributed optimizer)."""
    activations: float
    """Activations kept for backward, micro-batches in flight included, plus logits on the last rank."""
    kv_cache: float
    """RL rollout KV cache bytes on top of the training phase (0 otherwise): all of it, or with
    GrpoSizing.kv_cache_released_for_training only what exceeds the memory that training alone holds
    (activations, plus grads and optimizer when GrpoSizing.optimizer_offloaded_for_generation)."""
    reference_model: float
    """Frozen bf16 reference model bytes (0 otherwise)."""
    kv_cache_generating: float
    """RL: the whole KV pool while generating, on this GPU (``kv_cache`` is what it adds to the training phase's
    peak): ``kv_pool``'s tokens on this rank's layers."""
    overhead: float
    """Runtime reserve: fixed overhead plus fragmentation."""
    capacity: float
    """Device memory bytes."""
    worst_rank: int
    """Pipeline rank these bytes belong to."""
    step_time_s: float
    """Predicted seconds per step (RL: rollout + log-prob passes + every optimizer step of the rollout)."""
    time_terms: TimeTerms
    """What step_time_s is made of, unsummed (breakdown_s adds it up by part)."""
    mfu: float
    """Model FLOPs of the whole step (generation and log-prob passes included) / (step time x GPUs x peak)."""
    tokens_per_s_per_gpu: float
    """Trained tokens per step / step time / GPUs (NeMo RL's definition for the RL modes; eval: generated)."""
    bubble_fraction: float
    """Share of the pipeline time lost to fill and drain."""
    stage_layers: tuple[int, ...]
    """Decoder layers per virtual stage, execution order."""
    inference_buffers: float = 0.0
    """RL: generation buffers beyond the KV cache on top of the training phase (live rows' logits and sampling
    tensors, the prefill forward's working set); shared with training memory like kv_cache."""
    reward_model: float = 0.0
    """Colocated reward model's bf16 weights (0 otherwise)."""
    teacher_model: float = 0.0
    """Distillation teacher's bf16 weights (0 otherwise); with its offload, only what its forward phase holds beyond
    training's activations."""
    critic: float = 0.0
    """PPO critic's weights, gradients and optimizer state (0 otherwise)."""
    training_mfu: float = 0.0
    """Model FLOPs of the optimizer steps over the training parts' time only (TRAINING_PARTS)."""
    margin: float = 0.0
    """Runtime.memory_margin as a fraction of capacity: what a fitting layout leaves free."""
    split: SplitStep | None = None
    """Split placement: the rollout GPUs' memory and generation time, the trainer's time and the weight sync, and
    how they make step_time_s (rl_step.py); None when generation is colocated. The other fields are the trainer
    GPUs'."""
    kv_pool: KvPool | None = None
    """RL modes, colocated: the paged engine's KV pool per GPU and the rows it decodes at once (rl_step.kv_pool;
    with split placement, ``split.rollout_gpu.kv_pool``)."""

    @property
    def total(self) -> float:
        """Bytes on the worst GPU."""
        return (self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache
                + self.inference_buffers + self.reference_model + self.reward_model + self.teacher_model + self.critic
                + self.overhead)

    @property
    def usable(self) -> float:
        """Device bytes a layout may fill: capacity less the safety margin."""
        return self.capacity * (1.0 - self.margin)

    @property
    def fits(self) -> bool:
        """Whether the worst GPU stays within device memory less the safety margin."""
        return self.total <= self.usable

    @property
    def breakdown_s(self) -> dict[str, float]:
        """step_time_s by part: every TIME_PARTS key, each >= 0, summing to step_time_s."""
        return self.time_terms.breakdown()

    def memory_gib(self) -> dict[str, float]:
        """Memory breakdown in GiB (the issue's JSON keys plus the RL ones), the total, capacity and margin."""
        keys = ("weights", "gradients", "optimizer", "activations", "kv_cache", "inference_buffers",
                "reference_model", "reward_model", "teacher_model", "critic", "overhead")
        out = {k: round(getattr(self, k) / GIB, 3) for k in keys}
        out["kv_cache_generating"] = round(self.kv_cache_generating / GIB, 3)  # not part of the total
        out["total"] = round(self.total / GIB, 3)
        out["capacity"] = round(self.capacity / GIB, 3)
        out["free"] = round((self.capacity - self.total) / GIB, 3)
        out["margin_required"] = round(self.capacity * self.margin / GIB, 3)
        return out


MEMORY_KEYS = ("weights", "gradients", "optimizer", "activations", "kv_cache", "inference_buffers",
               "reference_model", "reward_model", "teacher_model", "critic")
"""Estimate's memory parts (bytes) before the overhead; what a memory hook (training_estimate) may fill."""
_ZEROS = (0.0,) * len(MEMORY_KEYS)
_NO_MEMORY = dict.fromkeys(MEMORY_KEYS, 0.0)


def stage_params(w: Workload, group: RankGroup, layout: Layout) -> tuple[float, float]:
    """(non-expert, expert) parameters held by one GPU of this pipeline rank group (cached per workload)."""
    return w._cached(("stage params", group, layout.dims.tp, layout.dims.ep, layout.dims.pp > 1),
                     lambda: _stage_params(w, group, layout))


def _stage_params(w: Workload, group: RankGroup, layout: Layout) -> tuple[float, float]:
    s = w.shape
    dense = group.dense_layers * (s.attention_params() + s.dense_mlp_params())
    moe_other = s.attention_params() + s.moe_mlp_params() - s.expert_params_per_moe_layer() if s.is_moe else 0
    ne = dense + group.moe_layers * moe_other
    ex = group.moe_layers * s.expert_params_per_moe_layer() if s.is_moe else 0
    output = s.output_params() if w.mode != "rm" else s.hidden_size * 3
    if group.first:
        ne += s.embedding_params()
    if group.last:
        ne += output
        if s.tie_embeddings and layout.dims.pp > 1 and w.mode != "rm":
            ne += s.vocab_size * s.hidden_size
        if s.mtp_num_layers:
            last = s.num_layers - 1
            ne += s.mtp_num_layers * (s.layer_params(last) - (s.expert_params_per_moe_layer() if s.is_moe else 0)
                                      + 2 * s.hidden_size**2 + 2 * s.hidden_size)
            ex += s.mtp_num_layers * (s.expert_params_per_moe_layer() if s.is_moe else 0)
    return ne / layout.dims.tp, ex / (layout.dims.ep * layout.dims.etp)


def _overlapped(comm: float, window: float) -> float:
    """Time a collective adds when overlapped with `window` seconds of compute."""
    hidden = min(comm, window)
    return comm - hidden + OVERLAP_CONTENTION * hidden


def _mixed(full: LayerCost, none: LayerCost, f: float) -> LayerCost:
    """A layer that is fully recomputed a fraction ``f`` of the time (partial recompute averaged over a rank)."""
    if f >= 1.0:
        return full
    mix = lambda a, b: f * a + (1 - f) * b  # noqa: E731
    return LayerCost(fwd_s=mix(full.fwd_s, none.fwd_s), bwd_s=mix(full.bwd_s, none.bwd_s),
                     stored_bytes=mix(full.stored_bytes, none.stored_bytes), working_bytes=full.working_bytes,
                     hw_flops=mix(full.hw_flops, none.hw_flops),
                     parts_s={k: mix(full.parts_s[k], none.parts_s[k]) for k in full.parts_s})


def _recomputed_fraction(layout: Layout, stage_layers: tuple[int, ...], rank: int) -> float:
    """Share of a pipeline rank's layers that recompute=full recomputes (all, or the first recompute_num_layers
    of each of its virtual stages)."""
    n = layout.recompute_num_layers
    if layout.recompute != "full" or n is None:
        return 1.0
    chunks = [stage_layers[c * layout.dims.pp + rank] for c in range(layout.dims.vpp)]
    return sum(min(n, c) for c in chunks) / max(1, sum(chunks))


def _layer_costs(w: Workload, L: Layout) -> tuple[LayerCost, LayerCost, LayerCost, LayerCost]:
    """(dense, moe) layer costs at the layout's recompute, then the same without recompute (partial recompute; the
    first pair again without it)."""
    costs = []
    for recompute in (L.recompute, "none") if L.recompute_num_layers is not None else (L.recompute,):
        dense = w.layer_cost("dense", L.dims.tp, L.dims.cp, L.dims.sp, L.micro_batch_size, recompute, L.dims.ep)
        moe = (w.layer_cost("moe", L.dims.tp, L.dims.cp, L.dims.sp, L.micro_batch_size, recompute, L.dims.ep)
               if w.shape.is_moe else dense)
        costs += [dense, moe]
    if len(costs) == 2:
        costs += costs
    return costs[0], costs[1], costs[2], costs[3]


def _pipeline_ranks(w: Workload, L: Layout) -> tuple[tuple[RankGroup, ...], tuple[int, ...], tuple]:
    """(rank groups, decoder layers per virtual stage, each group's (non-expert, expert) parameters per GPU) of the
    layout's parallel sizes and split, made once per workload: every micro-batch size and recompute mode shares
    them."""
    key = ("pipeline ranks", L.dims.tp, L.dims.pp, L.dims.vpp, L.dims.ep, *L.dims.split())
    made = w._cost_cache.get(key)
    if made is None:
        s = w.shape
        groups = rank_groups(s.moe_layers, s.num_layers, L.dims.pp, L.dims.vpp, *L.dims.split())
        stage_layers = L.dims.stage_layers(s.num_layers)
        made = w._cost_cache[key] = (groups, stage_layers, tuple(stage_params(w, gr, L) for gr in groups))
    return made


Finish = Callable[[float, "TimeTerms", float], dict]
"""(the worst rank's optimizer-state bytes, the optimizer step's TimeTerms, its model FLOPs) -> the Estimate fields
the mode restates (step time, terms, MFUs, tokens/s): how rl_step turns one optimizer step into an RL step."""
MemoryHook = Callable[[RankGroup, float, float, dict], dict]
"""(rank group, its non-expert and expert parameters per GPU, its training-phase MEMORY_KEYS bytes) -> the MEMORY_KEYS
bytes of the mode (RL: KV cache, buffers, frozen models); the worst rank is chosen on their sum."""


def training_estimate(w: Workload, layout: Layout, memory: MemoryHook | None = None,
                      finish: Finish | None = None, *, only_if_fits: bool = False) -> Estimate | float:
    """Memory and time of one optimizer step of ``w`` on a legal layout (legality is checked by the search);
    ``memory`` lets a mode (rl_step) restate each rank's memory, ``finish`` its time. With ``only_if_fits`` a
    layout over the usable memory returns its total bytes (Estimate.total) and skips the rest of the time model
    (the search's shortcut: most candidates do not fit)."""
    s, L = w.shape, layout
    m = w.global_batch_size // (L.dims.dp * L.micro_batch_size)
    groups, stage_layers, group_params = _pipeline_ranks(w, L)
    dense_r, moe_r, dense_n, moe_n = _layer_costs(w, L)
    out_parts, logits_b = w.output_cost(L.dims.tp, L.dims.cp, L.dims.sp, L.micro_batch_size)
    mtp_parts, mtp_b = w.mtp_cost(L.dims.tp, L.dims.cp, L.dims.sp, L.micro_batch_size, L.recompute, L.dims.ep)
    end_t = sum(out_parts.values()) + sum(mtp_parts.values())
    tokens = L.micro_batch_size * w.seq_length / L.dims.cp
    rep = L.dims.tp if L.dims.sp else 1
    gpn = w.gpu.gpus_per_node
    p2p_bw = w.ib if L.dims.tp * L.dims.cp * L.dims.dp >= gpn else w.nvlink
    p2p = (tokens * s.hidden_size * 2 / rep / p2p_bw + w.ib_latency) if L.dims.pp > 1 else 0.0
    dp_shard = L.dims.dp * L.dims.cp
    wb, gb, _ = w.weight_bytes_per_param(1)
    opt_ne = ADAM_BYTES_PER_PARAM / dp_shard if w.runtime.distributed_optimizer else ADAM_BYTES_PER_PARAM
    opt_ex = ADAM_BYTES_PER_PARAM / L.dims.edp if w.runtime.distributed_optimizer else ADAM_BYTES_PER_PARAM

    worst = None
    t_max = t_sum = 0.0
    worst_bwd = worst_fwd = 0.0
    slowest = (groups[0], dense_r, moe_r)
    max_params = (0.0, 0.0)
    for gr, (ne, ex) in zip(groups, group_params):
        if L.recompute_num_layers is None:
            dense_c, moe_c = dense_r, moe_r
        else:
            f = _recomputed_fraction(L, stage_layers, gr.rank)
            dense_c, moe_c = _mixed(dense_r, dense_n, f), _mixed(moe_r, moe_n, f)
        t_fwd = gr.dense_layers * dense_c.fwd_s + gr.moe_layers * moe_c.fwd_s
        t_bwd = gr.dense_layers * dense_c.bwd_s + gr.moe_layers * moe_c.bwd_s
        t = t_fwd + t_bwd + 2 * L.dims.vpp * p2p
        if gr.last:
            t += end_t
        t_sum += t * gr.count
        if t > t_max:
            t_max, worst_fwd, worst_bwd, slowest = t, t_fwd, t_bwd, (gr, dense_c, moe_c)
        if ne + ex > sum(max_params):
            max_params = (ne, ex)
        stored = gr.dense_layers * dense_c.stored_bytes + gr.moe_layers * moe_c.stored_bytes
        if L.dims.vpp > 1:
            pp, vpp = L.dims.pp, L.dims.vpp
            inflight = min((pp - gr.rank - 1) * 2 + (vpp - 1) * pp + 1, m * vpp) / vpp
        else:
            inflight = min(L.dims.pp - gr.rank, m)
        act = stored * inflight + max(dense_c.working_bytes, moe_c.working_bytes)
        if gr.first and s.hidden_dropout > 0:
            # the embedding's dropout mask; its output is the first layer's input, stored (or checkpointed) there
            act += tokens * s.hidden_size / rep * inflight
        if gr.last:
            act += logits_b + mtp_b
        trained = w.runtime.trainable_fraction  # LoRA: grads and Adam state of the adapters only
        parts = {"weights": (ne + ex) * wb, "gradients": (ne + ex) * gb * trained,
                 "optimizer": (ne * opt_ne + ex * opt_ex) * trained if gb else 0.0, "activations": act}
        if memory is not None:
            parts = memory(gr, ne, ex, parts)
        base = sum(map(parts.get, MEMORY_KEYS, _ZEROS))
        overhead = w.runtime.overhead_gib * GIB + w.runtime.fragmentation * base
        if worst is None or base + overhead > worst[0]:
            worst = (base + overhead, gr.rank, parts, overhead)
    if only_if_fits and worst[0] > w.gpu.memory_gib * GIB * (1.0 - w.runtime.memory_margin):
        return worst[0]

    bubble_s = (t_sum - t_max) / L.dims.vpp
    step_pp = m * t_max + bubble_s
    bubble = 1.0 - m * t_max / step_pp if step_pp else 0.0
    t_dp = _dp_time(w, L, max_params, worst_fwd, worst_bwd)
    ne, ex = max_params
    shard_ne = ne / dp_shard if w.runtime.distributed_optimizer else ne
    shard_ex = ex / L.dims.edp if w.runtime.distributed_optimizer else ex
    t_opt = ((shard_ne + shard_ex) * 28 + (ne + ex) * 2) / w.hbm
    parts = {**_NO_MEMORY, **worst[2]}
    optimizer = parts["optimizer"]
    step = step_pp + t_dp + t_opt
    flops = w.model_flops_per_token() * w.global_batch_size * w.seq_length
    gr, dense_c, moe_c = slowest
    terms = TimeTerms(gr, dense_c, moe_c, out_parts, mtp_parts, 2 * L.dims.vpp * p2p, m, bubble_s, t_dp, t_opt)
    mfu = flops / (step * w.num_gpus * w.bf16_peak)
    timing = {"step_time_s": step, "time_terms": terms, "mfu": mfu, "training_mfu": mfu,
              "tokens_per_s_per_gpu": w.global_batch_size * w.seq_length / step / w.num_gpus}
    if finish is not None:
        timing = finish(optimizer, terms, flops)
    return Estimate(layout=layout, weights=parts["weights"], gradients=parts["gradients"],
                    optimizer=parts["optimizer"], activations=parts["activations"], kv_cache=parts["kv_cache"],
                    inference_buffers=parts["inference_buffers"], reference_model=parts["reference_model"],
                    reward_model=parts["reward_model"], teacher_model=parts["teacher_model"], critic=parts["critic"],
                    overhead=worst[3],
                    capacity=w.gpu.memory_gib * GIB, kv_cache_generating=parts.get("kv_cache_generating", 0.0),
                    worst_rank=worst[1], bubble_fraction=bubble, stage_layers=stage_layers,
                    margin=w.runtime.memory_margin, **timing)


def _dp_time(w: Workload, L: Layout, max_params: tuple[float, float], fwd: float, bwd: float) -> float:
    """Exposed data-parallel gradient reduce (and distributed-optimizer parameter all-gather) seconds."""
    t_dp = 0.0
    for t_red, t_ag in _dp_collectives(w, L, max_params):
        t_dp += _overlapped(t_red, bwd) if w.runtime.overlap_grad_reduce else t_red
        if t_ag is not None:
            t_dp += _overlapped(t_ag, fwd) if w.runtime.overlap_param_gather else t_ag
    return t_dp


def _dp_collectives(w: Workload, L: Layout, max_params: tuple[float, float]) -> tuple:
    """(gradient reduce seconds, parameter all-gather seconds or None) of the non-expert and the expert
    data-parallel groups that have any, before overlap; made once per parallel sizes and parameters."""
    key = ("dp collectives", L.dims.tp, L.dims.cp, L.dims.dp, L.dims.ep, max_params)
    made = w._cost_cache.get(key)
    if made is not None:
        return made
    ne, ex = max_params
    gpn = w.gpu.gpus_per_node
    rs_frac = 1.0 if w.runtime.distributed_optimizer else 2.0
    out = []
    for params, group, stride in ((ne, L.dims.dp * L.dims.cp, L.dims.tp), (ex, L.dims.edp, L.dims.ep)):
        if group <= 1 or params <= 0:
            continue
        bw = w.nvlink if stride * group <= gpn else w.ib
        lat = (w.nvlink_latency if bw == w.nvlink else w.ib_latency) * 2 * int(group).bit_length()
        grad_bytes = params * w.runtime.wire_grad_bytes
        t_red = rs_frac * grad_bytes * (group - 1) / group / bw + lat * (grad_bytes / DP_BUCKET_BYTES + 1)
        t_ag = params * 2 * (group - 1) / group / bw if w.runtime.distributed_optimizer else None
        out.append((t_red, t_ag))
    made = w._cost_cache[key] = tuple(out)
    return made
