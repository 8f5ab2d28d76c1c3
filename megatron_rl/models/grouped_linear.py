"""Megatron's grouped expert linears in plain torch: ``TEGroupedMLP``'s fc1/fc2 where Transformer Engine is absent.

Megatron Core runs an MoE layer's routed experts either one by one (``SequentialMLP``, a parallel linear per
expert) or grouped (``TEGroupedMLP``: one module per linear holding every local expert's weight as ``weight0`` ..
``weight{n-1}``, called as ``linear(tokens, tokens_per_expert)``), the second through Transformer Engine's
``GroupedLinear`` on GPUs. ``TorchColumnGroupedLinear`` / ``TorchRowGroupedLinear`` take the same builder protocol
(``GroupedLinearFc1Builder`` / ``Fc2Builder``), parameter names, expert-parallel attributes and sharded state dict
(keys interchangeable with the sequential experts', as TE's are), with one ``F.linear`` per expert, so the grouped
layout runs where TE does not: what is built on it (LoRA on grouped experts, models/lora.py) is tested on the
CPU against the sequential experts, and checkpoints move between the two.

    spec = with_torch_grouped_experts(spec)   # a local-spec block whose MoE layers run TEGroupedMLP on these

Used by ``layer_spec`` for ``ModelOptions.grouped_experts`` without TE. Not a fast path: TE's grouped GEMM is.
Test: ``.venv/bin/python -m pytest tests/test_lora.py -q -k grouped``
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.nn.functional as F


class TorchGroupedLinear(torch.nn.Module):
    """``num_gemms`` expert linears (``weight{i}`` [out, in] on this rank), applied to consecutive runs of tokens."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, parallel_mode: str, config,
                 init_method, bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name=None,
                 pg_collection=None, name=None) -> None:
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name

        super().__init__()
        if bias:
            raise NotImplementedError("the torch grouped expert linears have no bias: build the model with "
                                      "add_bias_linear=False, or with Transformer Engine")
        if not is_expert:
            raise ValueError("grouped linears hold routed experts only")
        self._pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        self._tp_group = self._pg_collection.expt_tp
        tp = self._tp_group.size()
        expert_parallel = config.expert_model_parallel_size > 1
        self.explicit_expert_comm = tp > 1 or expert_parallel  # the token dispatcher does the expert-TP exchange
        self.parallel_mode, self.num_gemms, self.config = parallel_mode, num_gemms, config
        if parallel_mode == "column":
            output_size //= tp
        else:
            input_size //= tp
        expert_groups = expert_parallel or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        device = torch.cuda.current_device() if torch.cuda.is_available() and not config.use_cpu_initialization \
            else "cpu"
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype,
                                                    device=device))
            # each rank draws its own shards (not the sequential experts' layout-free draws: load a checkpoint
            # to start two layouts alike); on the GPU from the expert-parallel RNG tracker, as TE's
            with contextlib.nullcontext() if device == "cpu" else \
                    get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                init_method(weight)
            weight.allreduce = not expert_groups  # reduced over the expert-data-parallel group, as TE's
            if tp > 1:
                set_tensor_model_parallel_attributes(weight, True, 0 if parallel_mode == "column" else 1, 1)
            self.register_parameter(f"weight{i}", weight)

    def forward(self, x: torch.Tensor, m_splits) -> tuple:
        """``x`` [tokens, in] sorted by expert, ``m_splits`` tokens per local expert -> ([tokens, out], None)."""
        parts = torch.split(x, [int(m) for m in m_splits])
        return torch.cat([F.linear(part, getattr(self, f"weight{i}")) for i, part in enumerate(parts)]), None

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: the gradients were computed in the backward pass already."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Per local expert, its weight under the key a sequential expert's has (the expert index as the expert-
        parallel axis, the TP axis of the parallel mode), as Transformer Engine's grouped linears do."""
        return expert_sharded_tensors(self, [{f"weight{i}": ("weight", getattr(self, f"weight{i}"))}
                                             for i in range(self.num_gemms)],
                                      {"weight": 0 if self.parallel_mode == "column" else 1},
                                      prefix, sharded_offsets, metadata)


def expert_sharded_tensors(module, experts: list, axes: dict, prefix: str, sharded_offsets: tuple, metadata,
                           gated: tuple = ()) -> dict:
    """The sharded state of the grouped linear ``module``'s local experts: ``experts`` lists per local expert (in
    order) ``{state key: (the sequential experts' key, tensor)}``; each tensor is stored under ``prefix`` + that
    key with the global expert index on the expert-parallel axis, its ``axes`` TP axis over the expert-TP group,
    and replicas counted over the expert-data-parallel group, as Transformer Engine's grouped linears do; the
    ``gated`` keys split into gate and up halves (a gated fc1's output rows)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton = metadata.get("singleton_local_shards", False)
    ep, edp = module._pg_collection.ep, module._pg_collection.expt_dp
    num_global, first = ep.size() * module.num_gemms, ep.rank() * module.num_gemms
    state = {}
    for i, local in enumerate(experts):
        offsets = sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), first + i, num_global))
        key_prefix = f"{first + i}.{prefix}" if singleton else prefix
        sharded = make_sharded_tensors_for_checkpoint(dict(local.values()), key_prefix, axes, offsets,
                                                      tp_group=module._tp_group, dp_cp_group=metadata["dp_cp_group"])
        for state_key, (key, _) in local.items():
            tensor = sharded[key_prefix + key]
            tensor.replica_id = (*tensor.replica_id[:2], edp.rank())
            state[prefix + state_key] = apply_swiglu_sharded_factory(tensor, offsets, singleton) if key in gated \
                else tensor
    return state


class TorchColumnGroupedLinear(TorchGroupedLinear):
    """fc1 of grouped experts: each expert's output features split over the expert-TP group."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)


class TorchRowGroupedLinear(TorchGroupedLinear):
    """fc2 of grouped experts: each expert's input features split over the expert-TP group."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)


def with_torch_grouped_experts(spec):
    """A copy of the decoder block ``spec`` whose MoE layers' routed experts are ``TEGroupedMLP`` over the torch
    grouped linears."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    spec = copy.deepcopy(spec)
    grouped = functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=TorchColumnGroupedLinear, linear_fc2=TorchRowGroupedLinear))
    for layer in spec.layer_specs:
        mlp = layer.submodules.mlp
        submodules = getattr(mlp, "keywords", {}).get("submodules") if isinstance(mlp, functools.partial) \
            else getattr(mlp, "submodules", None)
        if isinstance(submodules, MoESubmodules):
            submodules.experts = grouped
    return spec
