"""Split placement (``cluster.rollout_tasks`` = R > 0): the last R processes only generate, the others train.

The trainer GPUs run the training layout (``parallel.*``) over world - R processes (``Workload.num_gpus``, with
``Workload.split`` set); they hold no KV cache and generate nothing (rl_step._rl_memory, rl_step._rl_timing). The R
rollout GPUs form R / (tp*pp) replicas at the training layout's tp x pp and pipeline split (vpp included), or at
parallel.rollout_tp x rollout_pp (``SplitPlacement.replica``), cp=1 and ep=1
(``launcher.parallel.rollout_replica_error``; megatron_rl/rollout/worker.py's ``rollout_config``). A rollout GPU
holds its bf16 weight shard (no gradients or optimizer state) and the KV cache of generation.max_concurrent rows
(its whole share when that is null); its memory and generation time are ``plan --mode eval``'s of the rollout on
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

Check it: ``.venv/bin/python -m pytest tests/test_planner_split_placement.py -q``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from launcher.parallel import uneven_splits
from launcher.planner.costs import GIB, TCP_LATENCY_S, GrpoSizing, Workload
from launcher.planner.estimate import Estimate, Layout
from launcher.planner.rl_step import mode_estimate, rollout

SYNC_BYTES_PER_PARAM = 2
"""The trainer publishes bf16 weights."""
SUGGESTION_SLACK = 0.05
"""When no rollout GPU count keeps up with training, the suggestion is the fewest whose generation is within this
fraction of the fastest (one sequence per replica): more replicas would gain less than that."""


@dataclass(frozen=True, kw_only=True)
class SplitStep:
    """One layout's step under split placement: both sides and how they combine."""

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
    tp, pp = w.split.replica(layout.tp, layout.pp)
    if pp == layout.pp:
        split = dict(vpp=layout.vpp, first_stage_layers=layout.first_stage_layers,
                     last_stage_layers=layout.last_stage_layers, account_for_embedding=layout.account_for_embedding,
                     account_for_loss=layout.account_for_loss)
    else:
        first, last = (uneven_splits(w.shape.num_layers, pp) or [(None, None)])[0] \
            if w.shape.num_layers % pp else (None, None)
        split = dict(vpp=1, first_stage_layers=first, last_stage_layers=last, account_for_embedding=False,
                     account_for_loss=False)
    return Layout(tp=tp, pp=pp, cp=1, ep=1, dp=replicas, micro_batch_size=1, recompute="none",
                  sequence_parallel=False, **split)


def replica_size(w: Workload, layout: Layout) -> int:
    """GPUs of one rollout replica beside ``layout``."""
    tp, pp = w.split.replica(layout.tp, layout.pp)
    return tp * pp


def replicas_of(w: Workload, layout: Layout) -> int:
    """Rollout replicas of the split workload ``w`` beside ``layout``."""
    return w.split.rollout_gpus // replica_size(w, layout)


def rollout_estimate(w: Workload, layout: Layout, replicas: int | None = None) -> Estimate:
    """Memory of one rollout GPU and the generation time of the rollout on ``replicas`` replicas (default: the
    workload's) at ``layout``'s tp x pp: ``plan --mode eval`` of the rollout on those GPUs, no frozen models."""
    replicas = replicas or replicas_of(w, layout)
    key = ("rollout estimate", replicas, layout.tp, layout.pp, layout.vpp, layout.first_stage_layers,
           layout.last_stage_layers, layout.account_for_embedding, layout.account_for_loss)
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
    tp, pp = w.split.replica(layout.tp, layout.pp)
    return (f"a rollout GPU (tp={tp} x pp={pp} replica, {replicas_of(w, layout)} replicas) needs "
            f"{mem['total']:.1f} GiB of {e.usable / GIB:.1f} (bf16 weights {mem['weights']:.1f}, KV cache "
            f"{mem['kv_cache']:.1f}); lower generation.max_concurrent, or use more rollout tasks or a larger tp*pp")


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
