"""``parallel.backend=gloo`` on GPUs: run every torch.distributed collective over gloo through CPU buffers.

For clusters without NCCL. Gloo has no CUDA path for most collectives Megatron Core issues on CUDA tensors
(reduce_scatter_tensor, all_gather_into_tensor, all_to_all_single, isend/irecv, ...). ``install()`` replaces
the torch.distributed functions Megatron Core (0.16.1, 0.19.2) and this project call with thin wrappers that copy each
CUDA tensor argument to a pinned CPU buffer, run the original op on the buffers over gloo, and copy the buffers
the op writes back into the original tensors. CPU tensors pass straight through, uncopied.

* Wrapped: every op in ``OUTPUTS`` (the keys), ``batch_isend_irecv`` with ``P2POp`` (whose op check would
  reject a wrapped isend/irecv), and ``_coalescing_manager``: torch's defers the ops inside it to one coalesced
  call at exit, after a wrapper would already have copied back; the stand-in lets each op run on its own and
  its handle waits for all of them. Module attributes bound before ``install`` (``dist_all_gather_func`` in
  param_and_grad_buffer, mappings, layers...; param_and_grad_buffer's ``_coalescing_manager``) are rebound in
  every loaded ``megatron*`` module; modules imported later read the patched torch.distributed.
* ``async_op=True`` (and isend/irecv) stays asynchronous: the op runs on gloo's own thread on the CPU buffers and
  the returned ``StagedWork``'s ``wait()`` waits for it and then copies back. The copies themselves are
  synchronous (``copy_`` with ``non_blocking=False`` on the caller's current stream), so the buffer is complete
  before gloo reads it and the CUDA tensor is complete when ``wait()`` returns.
* Every staged call is counted per op and call site (``op@file:function``, the first frame outside torch and
  this module): ``staged_counts()``; main.py writes them to ``run.dir/logs/gloo_staged_rank*.json``.

Launch (GPUs without NCCL): ``python launch.py parallel.backend=gloo ...``; ``runtime.distributed.initialize``
installs the wrappers when CUDA is available and the backend is gloo. The GPU path is unverified here (CPU-only
machine): ``bench/gpu_check.py``'s ``gloo_staging`` part compares a TP=2 step against NCCL on a GPU machine.

Test hook: ``MEGATRON_RL_GLOO_STAGING=1`` installs the wrappers on a CPU job too and stages every tensor, CPU ones
included, through a separate CPU buffer, so CI runs the copy-in, op and copy-back for real:
``.venv/bin/python -m pytest tests/test_gloo_staging.py -q``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

STAGE_EVERY_TENSOR_ENV = "MEGATRON_RL_GLOO_STAGING"
"""Set to 1: install the wrappers even on a CPU job and stage CPU tensors too (the CI hook)."""

OUTPUTS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("tensor",), "broadcast": ("tensor",), "reduce": ("tensor",),
    "all_gather": ("tensor_list",), "all_gather_into_tensor": ("output_tensor",),
    "_all_gather_base": ("output_tensor",),
    "reduce_scatter": ("output",), "reduce_scatter_tensor": ("output",), "_reduce_scatter_base": ("output",),
    "all_to_all_single": ("output",), "all_to_all": ("output_tensor_list",),
    "gather": ("gather_list",), "scatter": ("tensor",),
    "send": (), "recv": ("tensor",), "isend": (), "irecv": ("tensor",),
}
"""The staged torch.distributed ops and the arguments each writes (copied back to the original tensors); the
other tensor arguments are only read. An output aliasing an input (Megatron's in-place all-gather and
reduce-scatter of a bucket's shard) is therefore safe: only what the op writes goes back."""

_originals: dict[str, Callable] = {}
_unwrapped_by_id: dict[int, Callable] = {}
_counts: collections.Counter[str] = collections.Counter()
_open_coalescing: list["StagedWork"] = []
_stage_every_tensor = False
_SKIPPED_DIRS = (os.path.dirname(torch.__file__) + os.sep, __file__)
_SITE_ROOTS = (os.sep + "megatron_rl" + os.sep, os.sep + "megatron" + os.sep)


def requested_by_env() -> bool:
    """Whether the CI hook (``MEGATRON_RL_GLOO_STAGING=1``) asks for staging on this process."""
    return os.environ.get(STAGE_EVERY_TENSOR_ENV, "") not in ("", "0")


def is_installed() -> bool:
    return bool(_originals)


def staged_counts() -> dict[str, int]:
    """How often each op was staged, per call site: ``{"all_reduce@megatron/core/...py:fn": n}``."""
    return dict(_counts)


class StagedWork:
    """Work-like handle of staged ops: ``wait()`` waits for the gloo works, then copies the CPU buffers back
    into the original tensors (once; later calls return at once)."""

    def __init__(self, works: list, copy_back: list[tuple[torch.Tensor, torch.Tensor]],
                 keep_alive: tuple = ()) -> None:
        self._works = works
        self._copy_back = copy_back
        self._keep_alive = keep_alive  # sent buffers live until their send is done

    def append(self, work: Any) -> None:
        self._works.append(work)

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        _copy_back(self._copy_back)
        self._works, self._copy_back, self._keep_alive = [], [], ()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _needs_staging(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or _stage_every_tensor


# Outside autograd: a pipeline receive buffer is a leaf that requires grad, which an in-place copy_ rejects.
@torch.no_grad()
def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
    return buffer.copy_(tensor)


@torch.no_grad()
def _copy_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for original, buffer in pairs:
        original.copy_(buffer)


def _stage(value: Any) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """value with its tensors to stage (a tensor, or those of a list) replaced by CPU copies; (original, copy)."""
    if isinstance(value, torch.Tensor):
        if not _needs_staging(value):
            return value, []
        buffer = _cpu_copy(value)
        return buffer, [(value, buffer)]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        staged = [_stage(v) for v in value]
        pairs = [pair for _, ps in staged for pair in ps]
        return (type(value)(v for v, _ in staged), pairs) if pairs else (value, [])
    return value, []


def _call_site() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_DIRS):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    filename = frame.f_code.co_filename
    cut = max(filename.rfind(root) for root in _SITE_ROOTS)
    rel = filename[cut + 1:] if cut >= 0 else os.path.basename(filename)
    return f"{rel.replace(os.sep, '/')}:{frame.f_code.co_name}"


def _handed_back(result: Any, copy_back: list, keep_alive: tuple = ()) -> Any:
    """Complete a staged call: copy back now if the op finished, else hand out a handle that copies on wait()."""
    if result is not None and hasattr(result, "wait"):
        return StagedWork([result], copy_back, keep_alive)
    _copy_back(copy_back)
    return result


def _register(result: Any) -> Any:
    if _open_coalescing and result is not None and hasattr(result, "wait"):
        _open_coalescing[-1].append(result)
    return result


def _staged_op(name: str, original: Callable) -> Callable:
    signature = inspect.signature(original)
    outputs = OUTPUTS[name]

    @functools.wraps(original)
    def staged(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        copy_back, read_only = [], []
        for arg, value in bound.arguments.items():
            replaced, pairs = _stage(value)
            if pairs:
                bound.arguments[arg] = replaced
                (copy_back if arg in outputs else read_only).extend(pairs)
        if not copy_back and not read_only:
            return _register(original(*args, **kwargs))
        _counts[f"{name}@{_call_site()}"] += 1
        result = original(*bound.args, **bound.kwargs)
        return _register(_handed_back(result, copy_back, tuple(buffer for _, buffer in read_only)))

    return staged


class _P2POp(dist.P2POp):
    """torch's P2POp, accepting the wrapped isend/irecv (it checks ``op in [isend, irecv]`` on the originals)."""

    def __new__(cls, op: Callable, *args: Any, **kwargs: Any):
        return super().__new__(cls, _unwrapped(op), *args, **kwargs)

    def __init__(self, op: Callable, *args: Any, **kwargs: Any) -> None:
        super().__init__(_unwrapped(op), *args, **kwargs)


def _unwrapped(op: Callable) -> Callable:
    return _unwrapped_by_id.get(id(op), op)


def _batch_isend_irecv(p2p_op_list: list) -> list:
    """torch's batch_isend_irecv on CPU copies of the tensors to stage; one handle for the whole batch (Megatron
    waits for every handle of the list before it reads a received tensor)."""
    original = _originals["batch_isend_irecv"]
    staged_ops, copy_back, sent = [], [], []
    for p2p in p2p_op_list:
        buffer, pairs = _stage(p2p.tensor)
        (copy_back if p2p.op is _originals["irecv"] else sent).extend(pairs)
        staged_ops.append(dist.distributed_c10d.P2POp(p2p.op, buffer, group=p2p.group, tag=p2p.tag,
                                                      group_peer=p2p.group_peer) if pairs else p2p)
    if not copy_back and not sent:
        return original(p2p_op_list)
    _counts[f"batch_isend_irecv@{_call_site()}"] += 1
    return [StagedWork(list(original(staged_ops)), copy_back, tuple(buffer for _, buffer in sent))]


@contextlib.contextmanager
def _coalescing_manager(group: Any = None, device: Any = None, async_ops: bool = False):
    """Stand-in for torch's: the ops inside run one by one (each staged op copies back on its own) and the
    yielded handle waits for the asynchronous ones."""
    handle = StagedWork([], [])
    _open_coalescing.append(handle)
    try:
        yield handle
    finally:
        _open_coalescing.pop()
    if not async_ops:
        handle.wait()


def install(*, stage_every_tensor: bool = False) -> None:
    """Wrap the torch.distributed ops (once per process, after init_process_group). ``stage_every_tensor``: stage
    CPU tensors too (the CI hook)."""
    global _stage_every_tensor
    if dist.get_backend() != "gloo":
        raise RuntimeError(f"gloo staging runs collectives on CPU buffers: the process group must use gloo, not "
                           f"{dist.get_backend()} (parallel.backend=gloo; unset {STAGE_EVERY_TENSOR_ENV})")
    _stage_every_tensor = stage_every_tensor
    if _originals:
        return
    replacements = {name: _staged_op(name, getattr(dist, name)) for name in OUTPUTS if hasattr(dist, name)}
    replacements.update(batch_isend_irecv=_batch_isend_irecv, _coalescing_manager=_coalescing_manager, P2POp=_P2POp)
    _originals.update((name, getattr(dist, name)) for name in replacements)
    for name, replacement in replacements.items():
        _unwrapped_by_id[id(replacement)] = _originals[name]
        setattr(dist, name, replacement)
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("megatron"):
            continue
        for attr, value in list(vars(module).items()):
            for name, original in _originals.items():
                if value is original:
                    setattr(module, attr, replacements[name])
