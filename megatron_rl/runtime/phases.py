"""Colocation made explicit: the same processes and weights switch between generation and training.

    with generation_phase(engine, offload_optimizer=True):   # eval mode; optimizer state and grads off the device
        rollouts = generate(...)                             # the KV cache lives only inside this block
    with training_phase(engine):                             # train mode
        engine.train_step(...)

With ``offload_optimizer`` (``generation.offload_optimizer``) the optimizer's state (Adam moments, fp32 main
copies of bf16 weights) is copied to host memory (pinned on GPUs) and its device storage freed, and the DDP
grad buffers are freed. On exit the storages are reallocated in place and refilled, so every existing view
(``param.main_grad``, the distributed optimizer's shards, bucket views) is valid again. Optimizer state comes
back bit-exact; grads come back as zeros unless ``keep_grads`` (``Engine.train_step`` zeroes them first
anyway, so copying them would only cost transfer time). Storages shared with model weights are never touched
(an fp32 model's distributed optimizer keeps views of the weights as its main params).

On a CPU-only machine offloading moves host memory to host memory: useless for speed, but it runs the same
code, which is how the tests check the round trip. On GPUs each phase change also empties the CUDA cache, so
the KV cache's memory is free for activations.

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q -k offload``
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

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


@dataclass
class HostOffload:
    """Device storages moved to host memory and freed; ``restore`` reallocates them in place."""

    keep_values: bool
    """Copy contents to the host and back (else the storage returns zero-filled)."""
    parked: list = field(default_factory=list)
    """(storage, nbytes, host copy or None) per freed storage."""
    device_bytes_freed: int = 0
    """Device bytes released by the last ``offload``."""

    def offload(self, tensors: list[torch.Tensor], *, device: torch.device, protected: set[int]) -> None:
        seen = set(protected)
        for tensor in tensors:
            storage = tensor.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if tensor.device != device or nbytes == 0 or ptr in seen:
                continue
            seen.add(ptr)
            host = None
            if self.keep_values:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
                host.copy_(_bytes_of(storage))
            storage.resize_(0)
            self.parked.append((storage, nbytes, host))
            self.device_bytes_freed += nbytes

    def restore(self) -> None:
        for storage, nbytes, host in self.parked:
            storage.resize_(nbytes)
            if host is not None:
                _bytes_of(storage).copy_(host)
            else:
                _bytes_of(storage).zero_()
        self.parked = []


@contextlib.contextmanager
def generation_phase(engine, *, offload_optimizer: bool = False,
                     keep_grads: bool = False) -> Iterator[Optional[tuple[HostOffload, HostOffload]]]:
    """Eval mode and no autograd for sampling; with ``offload_optimizer`` optimizer state and grads wait in host
    memory. Yields ``(optimizer_offload, grad_offload)`` when offloading (for the freed bytes), else None."""
    chunks = engine.chunks
    was_training = [chunk.training for chunk in chunks]
    engine.train(False)
    offloads = None
    try:
        if offload_optimizer:
            device = next(unwrap(chunks[0]).parameters()).device
            if device.type == "cuda":
                torch.cuda.synchronize()
            protected = weight_storages(chunks)
            offloads = (HostOffload(keep_values=True), HostOffload(keep_values=keep_grads))
            offloads[0].offload(optimizer_tensors(engine.optimizer), device=device, protected=protected)
            offloads[1].offload(grad_buffer_tensors(chunks), device=device, protected=protected)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        with torch.no_grad(), peak_memory_of(engine.peak_memory, "generate"):  # after the offload
            yield offloads
    finally:
        if offloads is not None:
            for offload in offloads:
                offload.restore()
        for chunk, mode in zip(chunks, was_training):
            chunk.train(mode)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@contextlib.contextmanager
def training_phase(engine) -> Iterator[None]:
    """Train mode for the optimizer steps of one rollout batch."""
    engine.train(True)
    try:
        yield
    finally:
        engine.train(False)
