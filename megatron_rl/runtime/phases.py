"""Colocation made explicit: the same processes and weights switch between generation and training.

    with generation_phase(engine):     # eval mode; optionally grads freed and (GPUs) Adam state in host memory
        rollouts = generate(...)       # the KV cache lives only inside this block
    with training_phase(engine):       # train mode; optimizer state back on the device
        engine.train_step(...)

On GPUs each phase change also empties the CUDA cache, so the KV cache's memory is free for activations.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _move_optimizer_state(engine, device: str) -> None:
    for sub in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for state in sub.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = value.to(device, non_blocking=True)


def _grad_storages(engine) -> list:
    storages = []
    for chunk in engine.chunks:
        for buffer in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            storages.append((buffer.grad_data.untyped_storage(), buffer.grad_data))
    return storages


def _free_grad_buffers(engine) -> list:
    """Release the (already consumed) gradient buffers' memory; param.main_grad views come back on restore."""
    freed = []
    for storage, tensor in _grad_storages(engine):
        freed.append((storage, storage.nbytes(), tensor))
        storage.resize_(0)
    return freed


def _restore_grad_buffers(freed: list) -> None:
    for storage, nbytes, tensor in freed:
        storage.resize_(nbytes)
        tensor.zero_()


@contextlib.contextmanager
def generation_phase(engine, *, offload_optimizer: bool = False) -> Iterator[None]:
    """Eval mode for sampling. With ``offload_optimizer`` the gradient buffers (zero between steps) are freed
    and, on GPUs, Adam's state waits in host memory until training resumes."""
    engine.train(False)
    freed = []
    if offload_optimizer:
        freed = _free_grad_buffers(engine)
        if torch.cuda.is_available():
            _move_optimizer_state(engine, "cpu")
            torch.cuda.empty_cache()
    try:
        with torch.no_grad():
            yield
    finally:
        if offload_optimizer:
            if torch.cuda.is_available():
                _move_optimizer_state(engine, "cuda")
            _restore_grad_buffers(freed)
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
