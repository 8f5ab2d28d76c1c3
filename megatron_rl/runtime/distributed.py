"""Process-group and Megatron parallel-state setup for one training process.

``read_dist_env()`` finds rank, world size and rendezvous from whichever launcher started the process:
torchrun / our local executor (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), or Slurm ``srun`` and submitit
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``...). ``initialize()`` then starts
torch.distributed (NCCL on GPUs, gloo on CPU or when asked), Megatron's parallel state and its RNG trackers.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, TypeVar

import torch

from megatron_rl.spec.parallel import ParallelDims
from megatron_rl.spec.ports import rendezvous_port

T = TypeVar("T")
JOB_RANK_ENV = "MEGATRON_RL_JOB_RANK"
"""This process's rank in the whole job, when its world is only part of it (split placement)."""
INIT_METHOD_ENV = "MEGATRON_RL_INIT_METHOD"
"""A torch.distributed init_method that replaces tcp://MASTER_ADDR:MASTER_PORT (``DistEnv.init_method``)."""
RANK_ZERO_WORK_TIMEOUT_S = 24 * 3600
"""How long the other ranks wait in ``on_rank_zero`` (a Hugging Face export of a 1 TB model takes many
minutes): far beyond parallel.timeout_s, which stays short so that a hung collective is found quickly."""
COLLECTIVE_DEVICE_TYPES = {"nccl": "cuda", "gloo": "cpu"}
"""A process-group backend -> the device type its collectives take tensors on (``collective_device``)."""
_rank_zero_wait: dict[str, object] = {}
_pipeline_return: dict[str, object] = {}


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    master_addr: str
    """Host of rank 0, for the TCP rendezvous."""
    master_port: int
    """Rendezvous port."""
    init_method: Optional[str] = None
    """A torch.distributed init_method in place of tcp://master_addr:master_port (a split-placement rollout
    world meets through a file: ``megatron_rl.rollout.placement``)."""


def read_dist_env(env: Optional[Mapping[str, str]] = None) -> DistEnv:
    """Rank, world size and rendezvous from torchrun-style or Slurm variables; a single process otherwise."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", "29500")),
            init_method=env.get(INIT_METHOD_ENV) or None)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
            master_port=int(env.get("MASTER_PORT")
                            or rendezvous_port(job_id, int(env.get("SLURM_RESTART_COUNT", "0")))))
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                   master_port=int(env.get("MASTER_PORT", "29500")))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``n[3-5,7],m1`` -> ``n3``; ``gpu-[001-004]`` -> ``gpu-001``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def current_dims() -> ParallelDims:
    """The parallel sizes this process runs at, read from Megatron's parallel state (after ``initialize``)."""
    from megatron.core import parallel_state as ps

    return ParallelDims(
        world_size=torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1, cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size())


def job_dims(**sizes) -> ParallelDims:
    """ParallelDims of ``sizes`` (tp=, pp=, ...) over this job's processes (the launcher's world size)."""
    return ParallelDims(world_size=read_dist_env().world_size, **sizes)


def prepare_megatron_import() -> None:
    """What a process does before Megatron's first import, on every device (the Megatron patches, the deferred
    imports) and on a CPU (the CPU redirections); each step once, so a second call is a no-op. ``initialize``
    calls it; the test zygote calls it before it imports Megatron for its children."""
    from megatron_rl.runtime import cpu_compat, lazy_imports, megatron_patches

    lazy_imports.defer()
    megatron_patches.apply()
    if not torch.cuda.is_available():
        cpu_compat.apply()


def initialize(dims: ParallelDims, *, seed: int, backend: str = "auto", timeout_s: int = 1800) -> DistEnv:
    """Start torch.distributed and Megatron parallel state for this process; seed Megatron's RNG trackers.

    ``timeout_s`` bounds every collective (``parallel.timeout_s``): a rank waits that long for the others."""
    from megatron_rl.runtime import gloo_staging

    dist_env = read_dist_env()
    if dims.world_size != dist_env.world_size:
        raise RuntimeError(f"the layout is for {dims.world_size} processes but {dist_env.world_size} were started")
    on_gpu = torch.cuda.is_available()
    prepare_megatron_import()
    from megatron.core import parallel_state, tensor_parallel
    if backend == "auto":
        backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(dist_env.local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend, init_method=dist_env.init_method or f"tcp://{dist_env.master_addr}:{dist_env.master_port}",
            rank=dist_env.rank, world_size=dist_env.world_size, timeout=datetime.timedelta(seconds=timeout_s))
    stage_every_tensor = gloo_staging.requested_by_env()  # the CI hook: the GPU path's wrappers on a CPU job
    if (on_gpu and backend == "gloo") or stage_every_tensor:
        gloo_staging.install(stage_every_tensor=stage_every_tensor)
    # A CPU group for waiting on rank 0's long single-rank I/O; gloo exists wherever torch does (no NCCL needed).
    _rank_zero_wait["group"] = torch.distributed.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=max(timeout_s, RANK_ZERO_WORK_TIMEOUT_S)))
    # Megatron's groups wait as long as the default group: its own default (30 minutes) would let a hung rank
    # (stopped, deadlocked) hold every other one that long
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        context_parallel_size=dims.cp, expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=dims.etp,
        distributed_timeout_minutes=timeout_s / 60)
    if dims.pp > 1:
        _pipeline_return["group"] = _new_pipeline_return_group(datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return dist_env


def shutdown() -> None:
    """Tear down Megatron's parallel state and the process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _rank_zero_wait.clear()
    _pipeline_return.clear()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _new_pipeline_return_group(timeout: datetime.timedelta):
    """A second group over every pipeline's ranks (made by every rank, in the same order); this rank's."""
    from megatron.core import parallel_state

    mine = torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    found = None
    for ranks in sorted({tuple(r) for r in every}):
        group = torch.distributed.new_group(list(ranks), timeout=timeout)
        if torch.distributed.get_rank() in ranks:
            found = group
    return found


def pipeline_return_group():
    """The group for point-to-point messages to an earlier pipeline stage (generation's token choices and the
    last stage's hand-over to stage 0's next virtual stage), beside Megatron's pipeline group for those to a
    later one. NCCL orders a rank pair's sends and receives in one stream per communicator, and a send blocks
    until its receive is posted, so two stages sending to each other on one communicator can wait on each
    other; with one group per direction every communicator carries messages one way, in the order both ends
    post them."""
    if "group" not in _pipeline_return:
        raise RuntimeError("no pipeline return group: the parallel state was not set up by "
                           "megatron_rl.runtime.distributed.initialize")
    return _pipeline_return["group"]


def collective_device(group=None) -> torch.device:
    """The device a tensor made for a collective over ``group`` goes on: the current GPU for NCCL, the CPU for
    gloo (an NCCL group has no CPU backend: a CPU tensor fails with "No backend type associated with device type
    cpu"). ``group``: a group of this world (None: the default one, or the CPU without a process group) or a
    standalone backend such as ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` (a weight bridge). The one rule for every
    counter, flag and metric the job reduces; model outputs are on the model's device already."""
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup) or (group is None and dist.is_initialized()):
        backend = str(dist.get_backend(group))
    elif group is not None:
        backend = group.name()
    else:
        return torch.device("cpu")
    # a group of several backends ("cpu:gloo,cuda:nccl") takes the accelerator's tensors
    types = [COLLECTIVE_DEVICE_TYPES.get(part.rpartition(":")[2], "cpu") for part in backend.split(",")]
    device_type = next((kind for kind in types if kind != "cpu"), "cpu")
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def global_rank() -> int:
    """This process's rank in the job (0 without a process group)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def job_rank() -> int:
    """This process's rank in the whole job (its world's rank, except under split placement)."""
    return int(os.environ.get(JOB_RANK_ENV) or os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def on_rank_zero(fn: Callable[[], T]) -> Optional[T]:
    """Run ``fn`` on global rank 0 only (shared-file writes, a Hugging Face export), then hold every rank until
    it is done: for up to RANK_ZERO_WORK_TIMEOUT_S after ``initialize``, not the short collective timeout.

    Returns fn's result on rank 0 and None elsewhere.
    """
    result = fn() if global_rank() == 0 else None
    if torch.distributed.is_initialized():
        torch.distributed.barrier(group=_rank_zero_wait.get("group"))
    return result
