"""Expert-parallel all-to-all time by the real topology (pure arithmetic).

Megatron's all-to-all token dispatcher (``--moe-token-dispatcher-type alltoall``) sends every routed copy of a
token (top-k copies) to the EP rank holding its expert, and the combine sends them back. Of an EP group of size
``ep`` spread over ``ceil(ep / gpus_per_node)`` nodes, a rank's copies go, evenly (balanced routing):
``1/ep`` to itself (no traffic), ``(min(ep, gpn) - 1)/ep`` to GPUs of its node over NVLink and the rest to other
nodes. DGX/HGX H100 and A100 clusters are rail-optimized, one NIC per GPU (``GpuSpec.internode_gb_s``), so the
inter-node share leaves over the GPU's own NIC while the intra-node share crosses NVLink at the same time: the
transfer takes the longer of the two. The inter-node all-to-all reaches ``A2A_NIC_EFFICIENCY`` of the NIC's
nominal bandwidth (fitted, calibration.md).

Inputs, not assumptions (``Runtime``): the busiest rank's load (``moe_capacity_factor`` for token dropping, else
the dropless allowance ``moe_dropless_imbalance``), ``moe_a2a_overlap`` (Megatron's
``--overlap-moe-expert-parallel-comm``, which hides the dispatch/combine of one micro-batch behind the compute
of another) and ``moe_deepep``. DeepEP (node-deduplicated dispatch, ``deepep_inter_share``) is NOT something the
trainers here run: it is off by default and ``plan()`` refuses it (``check_runtime``), so no plan assumes it; only
``evaluate()`` of a published layout that used it (the calibration rows) models it, and says so.
"""

from __future__ import annotations

from megatron_rl.spec.errors import ConfigError

A2A_NIC_EFFICIENCY = 0.78
"""Achieved inter-node all-to-all bandwidth over the NIC's nominal per-GPU bandwidth (fitted on the Qwen3-235B
EP32 row, calibration.md; NCCL all-to-all across nodes runs below the ring collectives' 0.8)."""
A2A_OVERLAP_CONTENTION = 0.2
"""Each second of all-to-all hidden behind compute still costs this much compute (the kernels share SMs)."""
NVLINK_LATENCY_S = 8e-6
"""Latency of one NVLink collective step."""
IB_LATENCY_S = 15e-6
"""Latency of one inter-node collective step."""


def check_runtime(runtime) -> None:
    """Refuse runtime settings no trainer here can run (DeepEP), or that the planner does not model."""
    if getattr(runtime, "comm_backend", "nccl") not in ("nccl", "gloo"):
        raise ConfigError(f"runtime comm_backend {runtime.comm_backend!r}: use nccl or gloo")
    if getattr(runtime, "moe_deepep", False):
        raise ConfigError("runtime moe_deepep: DeepEP dispatch is not supported by the trainers here "
                          "(megatron_rl uses Megatron's all-to-all dispatcher); plan without it")


def a2a_shares(ep: int, gpus_per_node: int) -> tuple[float, float]:
    """(intra-node, inter-node) fractions of a rank's routed copies that leave it, balanced routing."""
    local = min(ep, gpus_per_node)
    return (local - 1) / ep, (ep - local) / ep


def deepep_inter_share(*, ep: int, gpus_per_node: int, topk: int, group_topk: int) -> float:
    """Inter-node share of the routed copies under DeepEP-style node deduplication: a token crosses to each
    remote node it routes to once, whatever the number of its experts there. With group-limited routing
    (moe_router_group_topk groups, one per node) a token reaches at most that many nodes."""
    nodes = -(-ep // gpus_per_node)
    if nodes <= 1:
        return 0.0
    reach = min(nodes, group_topk or nodes)
    distinct = reach * (1 - (1 - 1 / reach) ** topk)
    return distinct * (nodes - 1) / nodes / topk


def dispatch_s(*, routed_bytes: float, ep: int, gpus_per_node: int, nvlink_bytes_s: float,
               nic_bytes_s: float, inter_share: float | None = None) -> float:
    """Seconds for one dispatch (or one combine) of `routed_bytes` (all top-k copies of the rank's tokens);
    `inter_share` overrides the inter-node share (DeepEP)."""
    if ep <= 1:
        return 0.0
    intra, inter = a2a_shares(ep, gpus_per_node)
    if inter_share is not None:
        inter = inter_share
    t_nvlink = routed_bytes * intra / nvlink_bytes_s
    t_nic = routed_bytes * inter / (nic_bytes_s * A2A_NIC_EFFICIENCY) if inter else 0.0
    return max(t_nvlink, t_nic) + (IB_LATENCY_S if inter else NVLINK_LATENCY_S)


def ep_time_s(*, routed_bytes: float, ep: int, gpus_per_node: int, nvlink_bytes_s: float, nic_bytes_s: float,
              overlap: bool, hideable_s: float, inter_share: float | None = None) -> float:
    """Exposed dispatch + combine seconds per layer and direction; with `overlap`, up to `hideable_s` of compute
    (of the other micro-batch) hides it, at A2A_OVERLAP_CONTENTION."""
    t = 2 * dispatch_s(routed_bytes=routed_bytes, ep=ep, gpus_per_node=gpus_per_node,
                       nvlink_bytes_s=nvlink_bytes_s, nic_bytes_s=nic_bytes_s, inter_share=inter_share)
    if overlap:
        hidden = min(t, hideable_s)
        t = t - hidden + A2A_OVERLAP_CONTENTION * hidden
    return t
