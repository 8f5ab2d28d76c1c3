"""Parallel state and model building for conversion processes (CPU, gloo), including MoE with TP > 1.

Conversion only builds the model to reuse Megatron's own sharded state dict (the exact keys, offsets and
[gate; up] factories the trainers save and load), so it always runs on the CPU (or, for an import, on the meta
device: no weight is allocated) and keeps experts whole per rank (expert tensor parallel size 1). That lets
TP=2 x PP=2 x EP=2 run on 4 processes: the world size of a layout is ``pp * lcm(tp, ep)``.

MoE (and, on the local spec, MLA) with TP > 1 needs sequence parallelism (Megatron refuses MoE otherwise); the
training builder's ``layer_spec`` then puts ``megatron_rl.models.norms.SequenceParallelTorchNorm`` in place of the
local spec's torch norms, which refuse sequence parallelism, so conversion builds exactly the modules (and keys)
training builds. Pipeline splits follow ``names.conversion_dims`` (uneven when pp does not divide the layers).
"""

from __future__ import annotations

import contextlib
import datetime

import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.conversion.names import layout_world_size  # noqa: F401 (re-exported)
from megatron_rl.models.norms import SequenceParallelTorchNorm  # noqa: F401 (re-exported; lives in models)
from megatron_rl.spec.model_shape import ModelShape


def init_parallel(tp: int, pp: int, ep: int, *, seed: int = 0) -> None:
    """Start gloo (once) and (re)initialise Megatron's parallel state for this layout."""
    from megatron_rl.runtime import cpu_compat, lazy_imports
    from megatron_rl.runtime.distributed import read_dist_env

    lazy_imports.defer()  # before Megatron's first import, as the next line
    cpu_compat.apply()
    from megatron.core import parallel_state, tensor_parallel
    env = read_dist_env()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                             rank=env.rank, world_size=env.world_size,
                                             timeout=datetime.timedelta(seconds=1800))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    tensor_parallel.get_cuda_rng_tracker().reset()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


class _FactoriesOnMeta(TorchFunctionMode):
    """``with torch.device("meta")`` for tensor factories called without a device. torch's own device context
    matches factories by identity, so it misses them once ``runtime.cpu_compat`` has wrapped them; this one
    matches the functions the wrappers call."""

    def __init__(self):
        super().__init__()
        from torch.utils._device import _device_constructors

        self.factories = {getattr(f, "__wrapped__", f) for f in _device_constructors()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def build_conversion_model(shape: ModelShape, *, tp: int, pp: int, ep: int, dtype: torch.dtype,
                           initialize: bool = False, meta: bool = False):
    """The GPTModel chunk of this rank (no virtual pipeline), on the CPU. Without ``initialize`` the weights are
    left uninitialised (they are about to be overwritten; Megatron's CPU init builds every full matrix); with
    ``meta`` they are meta tensors (shapes and dtypes only: what a streamed save needs)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.conversion.names import conversion_dims
    from megatron_rl.models.builder import ModelOptions, layer_spec, padded_vocab_size, transformer_config

    dims = conversion_dims(shape, tp, pp, ep)
    config = transformer_config(shape, ModelOptions(dims=dims, dtype=dtype))
    config.perform_initialization = initialize
    spec = layer_spec(shape, config)  # sequence-parallel torch norms when sequence_parallel
    rope_scaling = shape.rope_scaling or {}
    with _FactoriesOnMeta() if meta else contextlib.nullcontext():
        return GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=padded_vocab_size(shape.vocab_size, tp),
            max_sequence_length=shape.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=shape.tie_embeddings,
            position_embedding_type=shape.position_embedding_type, rotary_base=int(shape.rotary_base),
            rope_scaling=rope_scaling.get("rope_type") == "llama3",
            rope_scaling_factor=float(rope_scaling.get("factor", 8.0)))
