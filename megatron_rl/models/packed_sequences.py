"""Packed sequences: several rows in one ``[1, T]`` micro-batch, each attending only to itself.

A packed micro-batch (``megatron_rl.rollout.packing``) holds the rows' tokens one after another, then padding up
to T, and two views of the rows:

* ``cu_seqlens`` [segments + 1]: where each segment starts in the packed stream, the padding tail (if any) being
  the last segments (``with_padding_segments``), so the last entry is T. The collate step builds them on the host
  and the model sees them through ``attention_inputs``: as Megatron's ``PackedSeqParams(qkv_format="thd")`` with
  ``max_seqlen`` known on the host, which Megatron's per-sequence RoPE and the core attention take, where the core
  attention runs one attention per sequence (``thd``: Transformer Engine's fused attention on GPUs, or
  SDPADotProductAttention's ``packed_context``, megatron_rl/models/sdpa_attention.py, on CPUs and GPUs without TE);
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
from dataclasses import dataclass

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


def with_padding_segments(starts: list[int], packed_length: int) -> list[int]:
    """The boundaries ``starts`` of a packed micro-batch's rows (0, ..., the rows' end) followed by its padding tail
    up to ``packed_length``, cut into segments no longer than the longest row: per-sequence attention pads every
    segment to the longest (``sdpa_attention.packed_context``), and a micro-batch's tail can be most of it (every
    micro-batch of a mini-batch has the same length)."""
    longest = max((b - a for a, b in zip(starts[:-1], starts[1:])), default=0) or packed_length
    return [*starts, *range(starts[-1] + longest, packed_length, longest),
            *([packed_length] if starts[-1] < packed_length else [])]


@dataclass(frozen=True)
class PaddedSegments:
    """How ``sdpa_attention.packed_context`` attends the segments of a THD pack without a varlen kernel, worked out
    on the host at collate time: the segments grouped by length class (lengths in (2^(c-1), 2^c]), each class one
    causal SDPA over its segments padded to its longest, so the padded tokens are fewer than twice the real ones
    and the launches per layer are the classes present (at most 1 + log2 of the longest), not the segments."""

    shapes: tuple[tuple[int, int], ...]
    """(segments, padded length) of each class, in order."""
    gather: torch.Tensor
    """[sum of segments x padded length] int64: the packed token each padded slot reads (a segment's padding reads
    its own last token: only its padded queries, which are dropped, attend to it)."""
    scatter: torch.Tensor
    """[T] int64: each packed token's slot in the classes' outputs laid end to end."""


def padded_segments(starts: list[int], *, device: torch.device | str = "cpu") -> PaddedSegments:
    """``PaddedSegments`` for the segment boundaries ``starts`` (0, ..., T), worked out in Python on the host list;
    its indices are copied to ``device`` from pinned memory (on GPUs) without a sync."""
    lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
    classes: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        if length:
            classes.setdefault((length - 1).bit_length(), []).append(i)
    shapes, gather, scatter = [], [], [0] * starts[-1]
    for c in sorted(classes):
        padded = max(lengths[i] for i in classes[c])
        for i in classes[c]:
            first, length = starts[i], lengths[i]
            scatter[first:first + length] = range(len(gather), len(gather) + length)
            gather.extend(range(first, first + length))
            gather.extend([first + length - 1] * (padded - length))
        shapes.append((len(classes[c]), padded))
    indices = torch.tensor(gather + scatter, dtype=torch.long)
    if torch.device(device).type == "cuda":
        indices = indices.pin_memory().to(device, non_blocking=True)
    return PaddedSegments(shapes=tuple(shapes), gather=indices[:len(gather)], scatter=indices[len(gather):])


def attention_inputs(starts: list[int], *, thd: bool, device: torch.device | str = "cpu") -> dict:
    """What the model's forward takes for the segment boundaries ``starts`` (cu_seqlens, on the host:
    0, ..., T): ``packed_seq_params`` (``thd``: the core attention runs one attention per sequence) or
    ``attention_mask``, on ``device``. ``max_seqlen_q``/``max_seqlen_kv`` come from the host list, so neither
    this nor the attention (SDPA's padded batch, Transformer Engine's THD kernels, Megatron's THD RoPE, which
    would otherwise compute them from the device tensor) reads the device for them."""
    cu_seqlens = torch.tensor(starts, dtype=torch.int32)
    if torch.device(device).type == "cuda":
        cu_seqlens = cu_seqlens.pin_memory().to(device, non_blocking=True)
    total = starts[-1]
    if thd:
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = max(b - a for a, b in zip(starts[:-1], starts[1:]))
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        params.padded_segments = padded_segments(starts, device=device)  # for layers without Transformer Engine
        return {"packed_seq_params": params}
    segment = torch.repeat_interleave(torch.arange(len(starts) - 1, device=cu_seqlens.device),
                                      cu_seqlens[1:] - cu_seqlens[:-1], output_size=total)
    position = torch.arange(total, device=cu_seqlens.device)
    masked = (segment[:, None] != segment[None, :]) | (position[None, :] > position[:, None])
    return {"attention_mask": masked[None, None]}
