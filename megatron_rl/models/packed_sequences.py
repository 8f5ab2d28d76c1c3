"""Packed sequences: several rows in one ``[1, T]`` micro-batch, each attending only to itself.

A packed micro-batch (``megatron_rl.rollout.packing``) holds the rows' tokens one after another, then padding up
to T, and two views of the rows:

* ``cu_seqlens`` [segments + 1]: where each segment starts in the packed stream, the padding tail (if any) being
  the last segment, so the last entry is T. The model sees the boundaries through ``attention_inputs``: as
  Megatron's ``PackedSeqParams(qkv_format="thd")``, which Megatron's per-sequence RoPE and the core attention
  take, where the core attention runs one attention per sequence (``thd``: Transformer Engine's fused attention on
  GPUs, or SDPADotProductAttention's loop, megatron_rl/models/sdpa_attention.py, on CPUs and GPUs without TE);
  on Megatron's local kernel (runtime.attention=unfused, and MLA without TE) as a block-diagonal causal mask
  ``[1, 1, T, T]`` (True = masked), the same boundaries. Position ids restart at 0 in every row. The mask path
  applies RoPE at the packed positions, which changes no attention score (RoPE's scores depend on the distance
  between positions only) beyond float rounding.
* ``row_index`` / ``row_valid`` [rows, L]: for each row, the packed positions of its labels, so per-token results
  of the forward (log-probs, entropy, values) come back as ``[rows, L]`` by ``as_rows`` and the losses, written
  for padded rows, run unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def is_packed(batch: Mapping) -> bool:
    return "row_index" in batch


def packed_forward_kwargs(batch: Mapping) -> dict:
    """A packed micro-batch's sequence boundaries for Transformer Engine, as a model forward takes them."""
    return {"packed_seq_params": batch["packed_seq_params"]} if "packed_seq_params" in batch else {}


def as_rows(values: torch.Tensor, batch: Mapping) -> torch.Tensor:
    """``values`` [1, T, ...] of a packed micro-batch as [rows, L, ...] (zeros past each row's end); a padded
    micro-batch's ``values`` [rows, S, ...] are returned as they are."""
    if not is_packed(batch):
        return values
    index, valid = batch["row_index"], batch["row_valid"]
    flat = values.reshape(values.shape[1], *values.shape[2:])
    rows = flat[index.reshape(-1)].reshape(*index.shape, *flat.shape[1:])
    keep = valid.reshape(*valid.shape, *([1] * (rows.dim() - 2)))
    return torch.where(keep, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def attention_inputs(cu_seqlens: torch.Tensor, *, thd: bool) -> dict:
    """What the model's forward takes for these boundaries: ``packed_seq_params`` (``thd``: the core attention runs
    one attention per sequence) or ``attention_mask``."""
    total = int(cu_seqlens[-1])
    if thd:
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        cu = cu_seqlens.to(torch.int32)
        return {"packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                     max_seqlen_q=longest, max_seqlen_kv=longest)}
    segment = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device),
                                      cu_seqlens[1:] - cu_seqlens[:-1])
    position = torch.arange(total, device=cu_seqlens.device)
    masked = (segment[:, None] != segment[None, :]) | (position[None, :] > position[:, None])
    return {"attention_mask": masked[None, None]}
