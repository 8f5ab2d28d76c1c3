"""Tensor arithmetic of the Megatron <-> Hugging Face map: fused QKV per query group, [gate; up], vocab padding.

Every function is pure (tensors in, tensors out) and exact: conversions only move and copy elements, so a round
trip is bit-identical. Rotary embeddings need no permutation: Megatron's default (``rotary_interleaved=False``)
rotates halves exactly like HF's ``rotate_half``, and HF Llama checkpoints already hold the half-split layout.

Check it: ``.venv/bin/python -m pytest tests/test_conversion_mapping.py -q``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron_rl.conversion.names import TensorMap, is_model_key, parse_megatron_key, row_pieces, tensor_maps
from megatron_rl.spec.model_shape import ModelShape


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_groups: int, head_dim: int) -> torch.Tensor:
    """Megatron's fused QKV from HF q/k/v (weights [rows, hidden] or biases [rows]):
    [q heads of group 0; k_0; v_0; q heads of group 1; k_1; v_1; ...]."""
    rest = q.shape[1:]
    q = q.reshape(num_groups, -1, *rest)
    k = k.reshape(num_groups, head_dim, *rest)
    v = v.reshape(num_groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, *, num_heads: int, num_groups: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``: HF q_proj, k_proj, v_proj (contiguous)."""
    rest = fused.shape[1:]
    per_group = num_heads // num_groups * head_dim
    grouped = fused.reshape(num_groups, per_group + 2 * head_dim, *rest)
    q, k, v = grouped.split([per_group, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Megatron's global linear_fc1 of a SwiGLU MLP: [gate; up] on dim 0."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def merge_fc1_tp_shards(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Global [gate; up] from per-TP-rank fc1 shards, each [gate_i; up_i]. (A plain concat would interleave
    gate and up blocks: the bug some converters have at TP>1.)"""
    gates, ups = zip(*(shard.chunk(2, dim=0) for shard in shards), strict=True)
    return torch.cat([*gates, *ups], dim=0)


def split_fc1_tp_shards(fc1: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Per-TP-rank fc1 shards [gate_i; up_i] of a global [gate; up]."""
    gate, up = fc1.chunk(2, dim=0)
    return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0), strict=True)]


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows up to the padded vocabulary (padding rows give logit 0; samplers must mask them)."""
    if padded_rows < weight.shape[0]:
        raise ValueError(f"padded vocab {padded_rows} < vocab {weight.shape[0]}")
    pad = weight.new_zeros((padded_rows - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, pad], dim=0)


def cut_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return weight[:vocab_size].contiguous()


def megatron_from_hf(tm: TensorMap, shape: ModelShape, hf: dict[str, torch.Tensor],
                     padded_rows: Optional[int] = None) -> torch.Tensor:
    """The whole global Megatron tensor of ``tm`` from its HF tensors."""
    parts = [hf[name] for name in tm.hf]
    if tm.kind == "copy":
        return parts[0].clone()
    if tm.kind == "vocab":
        return pad_vocab(parts[0], padded_rows or parts[0].shape[0])
    if tm.kind == "gate_up":
        return fuse_gate_up(*parts)
    if tm.kind == "qkv":
        return fuse_qkv(*parts, num_groups=shape.num_query_groups, head_dim=shape.kv_channels)
    raise ValueError(tm.kind)


def hf_from_megatron(tm: TensorMap, shape: ModelShape, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF tensors of ``tm`` from its global Megatron tensor (padding rows cut)."""
    if tm.kind == "copy":
        return {tm.hf[0]: tensor.reshape(tm.hf_shapes[0]).contiguous()}
    if tm.kind == "vocab":
        return {tm.hf[0]: cut_vocab(tensor, tm.hf_shapes[0][0])}
    if tm.kind == "gate_up":
        return dict(zip(tm.hf, split_gate_up(tensor), strict=True))
    if tm.kind == "qkv":
        return dict(zip(tm.hf, split_qkv(tensor, num_heads=shape.num_attention_heads,
                                         num_groups=shape.num_query_groups, head_dim=shape.kv_channels), strict=True))
    raise ValueError(tm.kind)


# read_rows(hf_name, first_row, last_row_exclusive, column_slices) -> tensor
RowReader = Callable[[str, int, int, tuple[slice, ...]], torch.Tensor]


def megatron_region_from_hf(tm: TensorMap, shape: ModelShape, padded_rows: int, offsets: Sequence[int],
                            sizes: Sequence[int], read_rows: RowReader, dtype: torch.dtype) -> torch.Tensor:
    """One block (``offsets``/``sizes`` in the global Megatron tensor, e.g. a TP shard) read straight from the HF
    files: only the rows this block needs are read, so each rank of a conversion reads its own share."""
    first, last = offsets[0], offsets[0] + sizes[0]
    cols = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:], strict=True))
    out, row = [], 0
    for name, hf_row, rows in row_pieces(tm, shape, padded_rows):
        lo, hi = max(first, row), min(last, row + rows)
        if lo < hi:
            if name is None:
                out.append(torch.zeros((hi - lo, *sizes[1:]), dtype=dtype))
            else:
                out.append(read_rows(name, hf_row + lo - row, hf_row + hi - row, cols).to(dtype))
        row += rows
    if row < last:
        raise ValueError(f"{tm.ref}: block rows {first}:{last} exceed the tensor's {row} rows")
    return torch.cat(out, dim=0) if len(out) > 1 else out[0]


def hf_tensors_from_state_dict(state_dict: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Every HF tensor of a whole model held in one process (TP = PP = EP = 1): its ``state_dict`` keys (TE or
    local spec) folded to Megatron refs, then each ``TensorMap`` split into its HF tensors (padding rows cut)."""
    by_ref = {parse_megatron_key(key): value for key, value in state_dict.items() if is_model_key(key)}
    hf: dict[str, torch.Tensor] = {}
    for tm in tensor_maps(shape):
        if tm.ref not in by_ref:
            raise KeyError(f"the model has no {tm.ref} (is it split over TP/PP/EP ranks?)")
        hf.update(hf_from_megatron(tm, shape, by_ref[tm.ref]))
    return hf
