"""Pure-torch norms that work with Megatron sequence parallelism (the local spec's ``WrappedTorchNorm`` does not).

Megatron's local (no Transformer Engine, no Apex) layer spec uses ``WrappedTorchNorm``, which asserts
``not config.sequence_parallel``. Under sequence parallelism a norm outside attention/MLP sees only this TP rank's
slice of the sequence, so nothing in the forward changes; only the gradient of its weight is a partial sum over
the sequence. Megatron's ``finalize_model_grads`` all-reduces over the TP group the grads of every parameter
tagged ``sequence_parallel=True`` (``_allreduce_non_tensor_model_parallel_grads``), which is all the tag is for.

The QK norms (``q_layernorm``/``k_layernorm``, Qwen3) see whole sequences but only this rank's heads; their grads
are partial over heads and ``finalize_model_grads`` sums them over TP by name whenever ``config.qk_layernorm``,
with or without the tag (it is summed once either way).

``swap_norms`` puts ``SequenceParallelTorchNorm`` in every place of a layer/block spec (input, pre-MLP, QK and
final norms) where the local spec has ``WrappedTorchNorm``. Used by the training builder
(``megatron_rl.models.builder.layer_spec``) and, through it, by conversion.
"""

from __future__ import annotations

import dataclasses

import torch


class SequenceParallelTorchNorm:
    """torch RMSNorm/LayerNorm usable with sequence parallelism (parameters tagged ``sequence_parallel``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise NotImplementedError(f"normalization {config.normalization!r} under sequence parallelism")
        if config.layernorm_zero_centered_gamma:
            raise NotImplementedError("layernorm_zero_centered_gamma is not supported by the torch norms")
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def swap_norms(spec, old, new):
    """Replace ``old`` by ``new`` everywhere in a (copied) Megatron spec tree; returns the tree."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if spec is old:
        return new
    if isinstance(spec, ModuleSpec):
        if spec.module is old:
            spec.module = new
        if spec.submodules is not None:
            spec.submodules = swap_norms(spec.submodules, old, new)
        return spec
    if isinstance(spec, list):
        return [swap_norms(s, old, new) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, swap_norms(getattr(spec, f.name), old, new))
    return spec


def sequence_parallel_spec(spec):
    """A copy of a local-spec block/layer spec with its torch norms made sequence-parallel capable."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return swap_norms(copy.deepcopy(spec), WrappedTorchNorm, SequenceParallelTorchNorm)


def te_fused_norm(module):
    """The input norm a Transformer Engine LayerNorm-fused linear (``layer_norm_weight``) applies before its GEMM,
    as a function; None for any other module. GPU path, unverified on the CPU (TE does not run there)."""
    if not hasattr(module, "layer_norm_weight"):
        return None
    import torch.nn.functional as F

    def norm(x: torch.Tensor) -> torch.Tensor:
        weight = module.layer_norm_weight
        if getattr(module, "zero_centered_gamma", False):
            weight = weight + 1
        if getattr(module, "normalization", "LayerNorm") == "RMSNorm":
            return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype) * weight
        return F.layer_norm(x, x.shape[-1:], weight, getattr(module, "layer_norm_bias", None), module.eps)

    return norm
