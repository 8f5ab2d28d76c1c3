"""Run Megatron Core on a CPU-only machine: redirect its CUDA-only call sites to the CPU.

Applied by ``megatron_rl.runtime.distributed.initialize`` only when ``torch.cuda.is_available()`` is false;
GPU runs never get its redirections. What it does:

* ``torch.cuda`` helpers Megatron calls unconditionally (current_device, synchronize, Event, streams, nvtx,
  RNG seeding) become CPU stand-ins;
* torch's tensor factories (``torch.zeros(..., device="cuda")`` and kin, ``Tensor.new_empty(...)`` and kin),
  ``Tensor.cuda()`` and ``Tensor.to("cuda")`` put tensors on the CPU, and ``Tensor.type()`` answers with the
  ``torch.cuda.*`` name that Megatron's optimizer asserts on. These are thin wrappers on a handful of functions,
  not a ``TorchFunctionMode``: a mode intercepts every op and cost ~60% of a tiny model's training step here;
* Megatron's RNG tracker saves and restores the CPU generator instead of a CUDA one;
* MoE routing without Transformer Engine gets ``te_general_gemm = None`` (0.16.1 leaves it undefined), and the
  all-to-all token dispatcher gets its split sizes on the host as numpy arrays, as its copy from a GPU makes them;
* ``megatron_patches.apply()`` first: the Megatron changes every device gets (eager fusions, one-pass THD RoPE).

Every redirection is counted per call site (``file:function`` inside megatron). ``KNOWN_SITES`` lists the
sites someone has looked at; ``unreviewed_sites()`` names any other, so a Megatron upgrade that adds CUDA-only
code fails a test instead of failing mysteriously.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
from typing import Any

import torch

from megatron_rl.runtime import megatron_patches

# Seen redirected (tests and the default jobs) with megatron-core 0.16.1 and 0.19.2 on CPU and reviewed: each only
# places a buffer, a mask, an RNG state or a norm/step scalar, or asks for the current stream (to wait on CUDA
# graph events the CPU never records); on the CPU that is the right place. Besides, core/jit.py:jit_fuser counts
# the fusion functions left uncompiled (EAGER_FUSIONS).
KNOWN_SITES = frozenset({
    "core/dist_checkpointing/strategies/filesystem_async.py:preload_tensors",
    "core/dist_checkpointing/strategies/state_dict_saver.py:save_state_dict_async_finalize",
    "core/distributed/param_and_grad_buffer.py:__init__",
    "core/distributed/param_and_grad_buffer.py:start_grad_sync",
    "core/jit.py:jit_fuser",
    "core/models/common/embeddings/rotary_pos_embedding.py:get_emb",
    "core/models/gpt/gpt_model.py:_preprocess",
    "core/optimizer/clip_grads.py:clip_grad_by_total_norm_fp32",
    "core/optimizer/clip_grads.py:get_grad_norm_fp32",
    "core/optimizer/distrib_optimizer.py:<listcomp>",
    "core/optimizer/distrib_optimizer.py:get_parameter_state_dp_zero",
    "core/optimizer/optimizer.py:__init__",
    "core/optimizer/optimizer.py:has_grad_norm_group",
    "core/pipeline_parallel/p2p_communication.py:_communicate",
    "core/pipeline_parallel/p2p_communication.py:create_tensor_recv_next",
    "core/pipeline_parallel/p2p_communication.py:create_tensor_recv_prev",
    "core/pipeline_parallel/schedules.py:forward_backward_no_pipelining",
    "core/pipeline_parallel/schedules.py:forward_backward_pipelining_without_interleaving",
    "core/pipeline_parallel/schedules.py:forward_backward_pipelining_with_interleaving",
    "core/tensor_parallel/mappings.py:_gather_along_last_dim",
    "core/tensor_parallel/mappings.py:forward",  # the all-to-all token dispatcher's receive buffer
    "core/tensor_parallel/random.py:add",
    "core/tensor_parallel/random.py:fork",
    "core/tensor_parallel/random.py:model_parallel_cuda_manual_seed",
    "core/transformer/attention.py:_allocate_memory",
    "core/transformer/moe/router.py:gating",
    "core/transformer/moe/token_dispatcher.py:_maybe_dtoh_and_synchronize",  # its DtoH stream; split sizes
    "core/transformer/utils.py:get_default_causal_mask",
    "core/utils.py:get_tensor",
    "core/utils.py:local_multi_tensor_l2_norm",
})

EAGER_FUSIONS = megatron_patches.EAGER_FUSIONS

_redirects: collections.Counter[str] = collections.Counter()
_applied = False
_MEGATRON_MARK = os.sep + "megatron" + os.sep


def redirect_counts() -> dict[str, int]:
    """How often each Megatron call site was redirected to the CPU in this process, and (under EAGER_FUSIONS,
    once applied) how many Megatron fusions ``megatron_patches`` left uncompiled."""
    counts = dict(_redirects)
    if _applied and megatron_patches.eager_fusions():
        counts[EAGER_FUSIONS] = megatron_patches.eager_fusions()
    return counts


def unreviewed_sites() -> list[str]:
    """Redirected sites that are not in KNOWN_SITES: new CUDA-only code nobody has looked at."""
    return sorted(site for site in _redirects if site not in KNOWN_SITES)


def _record() -> None:
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if _MEGATRON_MARK in filename and __file__ != filename:
            rel = filename.split(_MEGATRON_MARK, 1)[1].replace(os.sep, "/")
            _redirects[f"{rel}:{frame.f_code.co_name}"] += 1
            return
        frame = frame.f_back
    _redirects["<outside megatron>"] += 1


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor", torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor", torch.bool: "torch.cuda.BoolTensor",
}


FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
             "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "eye", "linspace")
TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")
"""Tensor methods that make a tensor on a given device (the all-to-all dispatcher's ``new_empty(device=...)``)."""


def _factory_on_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = "cpu"
            _record()
        return fn(*args, **kwargs)
    return wrapper


def _patch_tensor_methods() -> None:
    original_to, original_type = torch.Tensor.to, torch.Tensor.type

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        _record()
        return self

    @functools.wraps(original_to)
    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]) and not isinstance(args[0], torch.dtype):
            _record()
            args = ("cpu", *args[1:])
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            _record()
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    @functools.wraps(original_type)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = _CUDA_TYPE_NAMES.get(self.dtype)
            if name is not None:
                return name
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.cuda = cuda
    torch.Tensor.to = to
    torch.Tensor.type = type_
    for name in FACTORIES:
        setattr(torch, name, _factory_on_cpu(getattr(torch, name)))
    for name in TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _factory_on_cpu(getattr(torch.Tensor, name)))


class _CpuEvent:
    """Stand-in for torch.cuda.Event: timing is wall-clock, synchronisation is a no-op on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._time = 0.0

    def record(self, stream: Any = None) -> None:
        import time
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._time - self._time) * 1000.0


class _CpuStream:
    """Stand-in for torch.cuda.Stream: the CPU has one stream of execution."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event or _CpuEvent()


def _counted(fn):
    def wrapper(*args: Any, **kwargs: Any):
        _record()
        return fn(*args, **kwargs)
    return wrapper


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = _counted(lambda: 0)
    cuda.set_device = _counted(lambda device: None)
    cuda.synchronize = _counted(lambda device=None: None)
    cuda.Event = _CpuEvent
    cuda.Stream = _CpuStream
    cuda.current_stream = _counted(lambda device=None: _CpuStream())
    cuda.default_stream = _counted(lambda device=None: _CpuStream())
    cuda.stream = _counted(lambda stream=None: contextlib.nullcontext())
    cuda.manual_seed = _counted(lambda seed: torch.manual_seed(seed))
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it; the CPU generator is already seeded
    cuda.get_rng_state = _counted(lambda device="cuda": torch.get_rng_state())
    cuda.set_rng_state = _counted(lambda state, device="cuda": torch.set_rng_state(state))
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda device=None: 0)
    cuda.empty_cache = lambda: None
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.nvtx.range_push = lambda *args, **kwargs: None
    cuda.nvtx.range_pop = lambda *args, **kwargs: None
    cuda.nvtx.range = lambda *args, **kwargs: contextlib.nullcontext()


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's ``rope_utils.get_pos_emb_on_this_cp_rank`` without ``pin_memory=True`` (which needs an
    accelerator): the rotary table of this CP rank's two chunks, r and 2*cp-1-r."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], dtype=torch.long, device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _split_sizes_on_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's ``moe_utils.maybe_move_tensor_to_cpu`` for a tensor already on the CPU: with ``as_numpy``, the
    numpy copy a GPU gets (the all-to-all dispatcher's split sizes, which ``all_to_all_single`` takes as a
    sequence, not a tensor); else the tensor, as Megatron leaves a CPU tensor."""
    if as_numpy and torch.is_tensor(tensor):
        _record()
        return tensor.numpy().copy()
    return tensor


def _patch_megatron() -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):  # each imports it by name
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank

    mcore_random._get_cuda_rng_state = _counted(lambda device="cuda", clone=False, graph_safe=False:
                                                torch.get_rng_state())
    mcore_random._set_cuda_rng_state = _counted(lambda new_state, device=-1, graph_safe=False:
                                                torch.set_rng_state(new_state))
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    for module in (moe_utils, token_dispatcher):  # the dispatcher imports it by name
        if hasattr(module, "maybe_move_tensor_to_cpu"):
            module.maybe_move_tensor_to_cpu = _split_sizes_on_host


def apply() -> bool:
    """Install the CPU redirections once per process, only when CUDA is absent. Returns whether active.
    Call it before anything imports Megatron (see the module docstring); ``megatron_patches.apply()`` runs
    first on every device."""
    global _applied
    megatron_patches.apply()
    if torch.cuda.is_available():
        return False
    if not _applied:
        _patch_torch_cuda()
        _patch_tensor_methods()
        _patch_megatron()
        _applied = True
    return True


def is_active() -> bool:
    return _applied
