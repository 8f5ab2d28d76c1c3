"""Distributed checkpoints with ``megatron.core.dist_checkpointing``, published atomically.

Layout of ``checkpoint.dir``::

    step_00000010/      a complete checkpoint (model, optimizer, scheduler, step, data position, RNG states)
    step_00000020/
    latest              text file naming the newest complete step folder, written last
    .tmp-step_...       a save in progress (or one a crash interrupted; removed on the next start)

A save writes into a ``.tmp-`` folder, then rank 0 renames it to ``step_N`` and rewrites ``latest`` with an
atomic replace: a checkpoint that looks complete is complete. The last ``keep_last`` are kept. Model and
optimizer tensors are stored by their global (layout-free) keys, so a checkpoint loads at any TP/PP/DP.
RNG states are per rank and are restored only when the layout is unchanged.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d{8})$")
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``ckpt_dir``, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(ckpt_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint: the ``latest`` pointer if it names one, else the highest step folder."""
    root = Path(ckpt_dir)
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named.is_dir() and STEP_DIR.match(named.name):
            return named
    found = complete_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder from either a step folder or a checkpoint root holding ``latest``."""
    path = Path(path)
    if STEP_DIR.match(path.name) and path.is_dir():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path} holds no complete checkpoint (no step_* folder)")
    return found


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def remove_partial_saves(ckpt_dir: str | Path) -> None:
    """Delete ``.tmp-`` folders left by a save that was killed (rank 0 only)."""
    root = Path(ckpt_dir)
    if _rank() == 0 and root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)
    _barrier()


def layout_signature() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1}


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def unwrap(chunk):
    """The GPTModel inside a DDP (or other) wrapper."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_sharded_state_dict(chunks: list) -> dict:
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def _rng_sharded_object(state: Any):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return ShardedObject("rng_state", state, (world,), (_rank(),), replica_id=0)


def save_checkpoint(ckpt_dir: str | Path, *, step: int, chunks: list, optimizer=None, scheduler=None,
                    extra: Optional[dict] = None, keep_last: int = 2, save_optimizer: bool = True) -> Path:
    """Save a checkpoint of ``step`` and publish it atomically; returns the published folder."""
    from megatron.core import dist_checkpointing

    root = Path(ckpt_dir)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    model_sd = _model_sharded_state_dict(chunks)
    state: dict[str, Any] = {**model_sd, "step": step, "layout": layout_signature(), "extra": extra or {},
                             "rng_state": _rng_sharded_object(_rng_state())}
    if optimizer is not None and save_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, str(tmp))
    _barrier()
    if os.environ.get("MEGATRON_RL_FAULT") == f"kill-during-save:{step}":  # fault injection for the crash tests
        os.kill(os.getpid(), 9)
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / ".latest.tmp"
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, root / "latest")
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | Path, *, chunks: list, optimizer=None, scheduler=None,
                    load_optimizer: bool = True) -> dict[str, Any]:
    """Load model (and optimizer, scheduler, RNG when present and compatible) from a step folder.

    Returns ``{"step": int, "extra": dict, "layout_changed": bool}``.
    """
    from megatron.core import dist_checkpointing

    folder = resolve_checkpoint(path)
    common = dist_checkpointing.load_common_state_dict(str(folder))
    same_layout = common.get("layout") == layout_signature()
    model_sd = _model_sharded_state_dict(chunks)
    request: dict[str, Any] = dict(model_sd)
    if optimizer is not None and load_optimizer and "optimizer" in common:
        _allocate_optimizer_state(optimizer)
        _skip_step_in_reshardable_load()
        request["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIMIZER_METADATA)
    if same_layout:
        request["rng_state"] = _rng_sharded_object(None)
    loaded = dist_checkpointing.load(request, str(folder))
    for i, chunk in enumerate(chunks):
        unwrap(chunk).load_state_dict(loaded[f"model{i}"])
    if "optimizer" in request:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    if scheduler is not None and "scheduler" in common:
        scheduler.load_state_dict(common["scheduler"])
    if same_layout and loaded.get("rng_state") is not None:
        _set_rng_state(loaded["rng_state"])
    return {"step": int(common["step"]), "extra": common.get("extra", {}), "layout_changed": not same_layout,
            "folder": folder}



def _allocate_optimizer_state(optimizer) -> None:
    """Give a fresh torch Adam its (zero) state, as a first step would.

    Without Apex/TE, Megatron's distributed optimizer reads the step count from the torch optimizer's
    per-parameter state when building the loading state dict, and a never-stepped optimizer has none.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param.data)
                    state["exp_avg_sq"] = torch.zeros_like(param.data)


def _skip_step_in_reshardable_load() -> None:
    """Let Megatron's fully_reshardable load work with torch's Adam (no Apex/TE), whose state holds "step".

    megatron-core 0.16.1 copies every key of the per-parameter state from the checkpoint tensors, which
    hold only param/exp_avg/exp_avg_sq; the step is restored from the param groups instead.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_skips_step", False):
        return

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    set_states._skips_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam step tensor after a load.

    Without Apex/TE, megatron-core 0.16.1 puts ONE step tensor into every parameter's state; torch's Adam
    then increments it once per parameter per step and the bias correction goes wrong after a resume.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in sub.optimizer.state.values():
            if "step" in state and torch.is_tensor(state["step"]):
                state["step"] = state["step"].clone()
