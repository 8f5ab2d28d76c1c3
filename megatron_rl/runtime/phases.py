"""Colocation made explicit: the same processes and weights switch between generation and training.

    with generation_phase(engine, offload_optimizer=True):   # eval mode; optimizer state and grads off the device
        rollouts = generate(...)                             # the KV cache lives only inside this block
    with training_phase(engine):                             # train mode
        engine.train_step(...)

With ``offload_optimizer`` (``generation.offload_optimizer``) the optimizer's state (Adam moments, fp32 main copies
of bf16 weights) is copied to host memory and its device storage freed, and the DDP grad buffers are freed.
Everything waits in one host buffer per engine (pinned on GPUs; ``Engine.host_offload``), allocated once and reused
at every phase, filled and emptied by ``non_blocking`` copies on a side stream, waited for once per direction; each
step logs the bytes moved and the seconds spent (``offload_metrics``). On exit the storages are reallocated in
place and refilled, so every existing view (``param.main_grad``, the distributed optimizer's shards, bucket views)
is valid again. Optimizer state comes back bit-exact; grads come back as zeros unless ``keep_grads``
(``Engine.train_step`` zeroes them first anyway, so copying them would only cost transfer time). Storages shared
with model weights are never touched (an fp32 model's distributed optimizer keeps views of the weights as its main
params).

On a CPU-only machine offloading moves host memory to host memory: useless for speed, but it runs the same
code, which is how the tests check the round trip. On GPUs the CUDA cache is emptied once per generation
phase, after the offload, for the KV pool (``generation_phase`` says why only then).

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q -k offload``
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

from megatron_rl.models import unwrap
from megatron_rl.runtime.memory import peak_memory_of


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Tensors owned by a Megatron optimizer (chained or not): per-parameter state and main params."""
    found = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            found.extend(p for p in group["params"] if isinstance(p, torch.Tensor))
        for state in inner.state.values():
            found.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return found


def grad_buffer_tensors(chunks: list) -> list[torch.Tensor]:
    """The contiguous grad buffers of Megatron DDP-wrapped chunks (``param.main_grad`` views live in them)."""
    found = []
    for chunk in chunks:
        for buffer in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            if getattr(buffer, "grad_data", None) is not None:
                found.append(buffer.grad_data)
    return found


def weight_storages(chunks: list) -> set[int]:
    """Storage addresses holding model weights (parameters and DDP param buffers): never offloaded."""
    ptrs = {p.untyped_storage().data_ptr() for chunk in chunks for p in unwrap(chunk).parameters()}
    for chunk in chunks:
        for buffer in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            if getattr(buffer, "param_data", None) is not None:
                ptrs.add(buffer.param_data.untyped_storage().data_ptr())
    return ptrs


def _bytes_of(storage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (for device-to-host copies with the tensor API)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


HOST_ALIGNMENT = 512
"""Each storage's place in the host buffer starts at a multiple of this many bytes (aligned copies)."""


def _copy_stream(device: torch.device):
    """A side CUDA stream for the offload copies on GPUs; None on the CPU, where copies run in order anyway."""
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None


def _on(stream) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory (uint8); ``pinned``: page-locked for asynchronous copies to and from the GPU.

    Pinned by ``cudaHostRegister`` on plain memory, exactly ``nbytes``, and unregistered when the tensor is freed:
    PyTorch's own pinned allocations (``pin_memory=True``) come from a cache that rounds each block up to a power of
    two and never returns it, up to twice the optimizer state per GPU held for the whole job. Where registering
    fails, the cache's allocation serves."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if not pinned or not nbytes:
        return buffer
    cudart, address = torch.cuda.cudart(), buffer.data_ptr()
    if cudart.cudaHostRegister(address, nbytes, 0) != 0:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(buffer.untyped_storage(), cudart.cudaHostUnregister, address)
    return buffer


@dataclass(kw_only=True)
class OffloadFigures:
    """Host offload traffic summed over offloads and restores (``offload_metrics`` logs and resets it)."""

    bytes_moved: int = 0
    """Bytes copied to the host (each comes back once more on restore)."""
    offload_s: float = 0.0
    """Seconds from the start of each offload until its storages were freed."""
    restore_s: float = 0.0
    """Seconds from the start of each restore until its copies had landed."""

    def add(self, *, bytes_moved: int = 0, offload_s: float = 0.0, restore_s: float = 0.0) -> None:
        self.bytes_moved += bytes_moved
        self.offload_s += offload_s
        self.restore_s += restore_s


def offload_metrics(*engines) -> dict[str, float]:
    """Step metrics of the engines' optimizer offloads since the last call (``generation.offload_optimizer``): bytes
    moved to the host (``offload_bytes``; the same come back), seconds offloading and restoring
    (``offload_s``, ``offload_restore_s``); zeros without offloading. Resets the engines' figures."""
    total = OffloadFigures()
    for engine in engines:
        figures = engine.host_offload.figures
        total.add(bytes_moved=figures.bytes_moved, offload_s=figures.offload_s, restore_s=figures.restore_s)
        engine.host_offload.figures = OffloadFigures()
    return {"offload_bytes": float(total.bytes_moved), "offload_s": total.offload_s,
            "offload_restore_s": total.restore_s}


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    offset: Optional[int]
    """Where its bytes wait in the host buffer; None: not copied (it comes back zero-filled)."""


@dataclass
class HostOffload:
    """Device storages moved to host memory and freed; ``restore`` reallocates them in place.

    Every copied storage waits in ONE host buffer (pinned on GPUs), each at an aligned offset. The buffer outlives
    the offload: kept by its owner (``Engine.host_offload``, a ``Teacher``) and reused by every later offload, it is
    allocated once (pinned to its exact size: ``host_buffer``) and grown only when an offload needs more. A pinned
    buffer per tensor per offload would leave PyTorch's pinned-memory cache, which rounds each block up to a power
    of two and never frees it, holding up to twice the state. The copies are ``non_blocking`` on a side stream,
    waited for once per direction."""

    keep_values: bool = True
    """Copy contents to the host and back (else the storage returns zero-filled)."""
    parked: list[_Parked] = field(default_factory=list)
    """Each freed storage, in offload order."""
    device_bytes_freed: int = 0
    """Device bytes released by the last ``offload``."""
    bytes_moved: int = 0
    """Bytes the last ``offload`` copied to the host buffer (``restore`` copies the same back)."""
    host_buffer: Optional[torch.Tensor] = None
    """The host buffer (uint8), kept across offloads."""
    figures: OffloadFigures = field(default_factory=OffloadFigures)
    """Bytes and seconds of the moves since the trainer last logged them (``offload_metrics``)."""

    def offload(self, tensors: list[torch.Tensor], *, device: torch.device, protected: set[int],
                zeroed: Iterable[torch.Tensor] = ()) -> None:
        """Free the device storages of ``tensors`` (their contents kept in the host buffer, with ``keep_values``)
        and of ``zeroed`` (whose contents are dropped), leaving out storages on other devices, empty ones and
        those in ``protected`` (addresses)."""
        start = time.perf_counter()
        seen = set(protected)
        parked, end = [], 0  # end: of the bytes copied so far in the host buffer
        for group, keep in ((tensors, self.keep_values), (zeroed, False)):
            for tensor in group:
                storage = tensor.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if tensor.device != device or nbytes == 0 or ptr in seen:
                    continue
                seen.add(ptr)
                offset = -(-end // HOST_ALIGNMENT) * HOST_ALIGNMENT if keep else None
                parked.append(_Parked(storage, nbytes, offset))
                end = offset + nbytes if keep else end
        if end:
            if self.host_buffer is None or self.host_buffer.numel() < end:
                self.host_buffer = None  # unpinned and freed before the larger one is taken
                self.host_buffer = host_buffer(end, pinned=device.type == "cuda")
            stream = _copy_stream(device)
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(device))  # the state is final
            with _on(stream):
                for p in parked:
                    if p.offset is not None:
                        self.host_buffer[p.offset:p.offset + p.nbytes].copy_(_bytes_of(p.storage), non_blocking=True)
            if stream is not None:
                stream.synchronize()  # the storages are freed next: their bytes must have left
        for p in parked:
            p.storage.resize_(0)
        self.parked = parked
        self.device_bytes_freed = sum(p.nbytes for p in parked)
        self.bytes_moved = sum(p.nbytes for p in parked if p.offset is not None)
        self.figures.add(bytes_moved=self.bytes_moved, offload_s=time.perf_counter() - start)

    def restore(self) -> None:
        """Reallocate every parked storage in place (views of it are valid again) and refill it from the host
        buffer, or with zeros; the copies have landed when it returns."""
        start = time.perf_counter()
        device = self.parked[0].storage.device if self.parked else None
        stream = _copy_stream(device) if device is not None and self.bytes_moved else None
        for p in self.parked:
            p.storage.resize_(p.nbytes)
            if p.offset is None:
                _bytes_of(p.storage).zero_()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))  # the reallocated memory is free to write
        with _on(stream):
            for p in self.parked:
                if p.offset is not None:
                    _bytes_of(p.storage).copy_(self.host_buffer[p.offset:p.offset + p.nbytes], non_blocking=True)
        if stream is not None:
            stream.synchronize()
        if self.parked:
            self.figures.add(restore_s=time.perf_counter() - start)
        self.parked = []


@contextlib.contextmanager
def generation_phase(engine, *, offload_optimizer: bool = False,
                     keep_grads: bool = False) -> Iterator[Optional[HostOffload]]:
    """Eval mode and no autograd for sampling; with ``offload_optimizer`` optimizer state and grads wait in host
    memory (``engine.host_offload``, whose buffer serves every phase). Yields that ``HostOffload`` when offloading
    (for the freed and moved bytes), else None.

    The CUDA cache is emptied once, after offloading: generation then allocates its KV pool, large tensors the
    freed optimizer blocks (segments of their own sizes in the cache) cannot serve, so they go back to the driver
    for the pool's cudaMalloc. It is not emptied after the restore: the KV pool's freed segments stay cached, where
    the restored state and the next training step's activations are carved from them; emptying would hand them
    back only for the training step to cudaMalloc them again. ``torch.cuda.empty_cache`` does nothing where CUDA
    was never initialised (CPU jobs)."""
    chunks = engine.chunks
    was_training = [chunk.training for chunk in chunks]
    engine.train(False)
    parked = None
    try:
        if offload_optimizer:
            device = next(unwrap(chunks[0]).parameters()).device
            grads = grad_buffer_tensors(chunks)
            engine.host_offload.offload(optimizer_tensors(engine.optimizer) + (grads if keep_grads else []),
                                        zeroed=[] if keep_grads else grads, device=device,
                                        protected=weight_storages(chunks))
            parked = engine.host_offload
            torch.cuda.empty_cache()
        with torch.no_grad(), peak_memory_of(engine.peak_memory, "generate"):  # after the offload
            yield parked
    finally:
        if parked is not None:
            parked.restore()
        for chunk, mode in zip(chunks, was_training):
            chunk.train(mode)


@contextlib.contextmanager
def training_phase(engine) -> Iterator[None]:
    """Train mode for the optimizer steps of one rollout batch."""
    engine.train(True)
    try:
        yield
    finally:
        engine.train(False)
