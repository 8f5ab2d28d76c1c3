"""Core attention by torch's ``scaled_dot_product_attention`` for the layers built without Transformer Engine
(``runtime.attention=flash``): the same maths as Megatron's local ``DotProductAttention`` (causal
softmax(q k^T * scale) v, grouped keys and values), without the s x s scores kept for the backward pass.

On GPUs without TE, torch picks its flash or memory-efficient kernel; on the CPU its flash kernel. Megatron's
``DotProductAttention`` materialises grouped keys per query head, runs ``baddbmm`` and a masked softmax, and
stores the scores; this module keeps only the output and the log-sum-exp, which is what the planner's
``flash_attention`` memory and time assume.

It covers what ``eligible`` accepts (vanilla softmax, no sliding window, no query-key layer scaling, no attention
bias). Packed sequences (``PackedSeqParams`` in THD format, megatron_rl/models/packed_sequences.py) run a causal
attention per sequence, not a block-diagonal mask over the whole pack, as one SDPA per length class over the
sequences padded to the class's longest (``packed_context``), with no host sync: torch's varlen kernel
(``torch.nn.attention.varlen``) would skip the padding on GPUs, but it is not in every torch and is not used here. At cp > 1, ``SDPACPAttention`` is
``CPDotProductAttention`` (keys and values gathered over the CP group, an explicit causal mask of the local
queries) with this module's kernel; packing is refused at cp > 1 (``spec.parallel.packing_error``).

Tests: ``tests/test_cp_attention.py`` (outputs and gradients equal ``DotProductAttention``'s to 1e-5 in fp32,
causal and with a padding mask, GQA and dropout off, at cp 1, 2 and 4) and ``tests/test_packing.py`` (packed
attention equals one attention per sequence, without host syncs and with one SDPA launch).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_rl.models.cp_attention import CPDotProductAttention
from megatron_rl.models.packed_sequences import PaddedSegments


def eligible(config) -> bool:
    """Whether SDPA reproduces the local core attention for ``config`` (a TransformerConfig)."""
    return (getattr(config, "softmax_type", "vanilla") == "vanilla"
            and getattr(config, "window_size", None) is None
            and not getattr(config, "apply_query_key_layer_scaling", False))


def sdpa_context(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
                 attention_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention in Megatron's layout: [sq, b, np, hn] queries, [sk, b, ng, hn] keys, [sk, b, ng, hv]
    values -> [sq, b, np * hv]. ``attention_mask`` (True = masked, [b or 1, 1, sq, sk]) replaces the causal
    mask, as in ``DotProductAttention``. Without it the queries are the last sq positions of the sk keys: the
    whole sequence (sq = sk), one decode step (sq = 1) or a chunk after a cached prefix."""
    sq, batch, sk = query.shape[0], query.shape[1], key.shape[0]
    causal, mask = False, None
    if attention_mask is not None:
        mask = ~attention_mask
    elif sq == sk:
        causal = sq > 1
    elif sq > 1:  # queries at positions sk - sq .. sk - 1 (top-left alignment of is_causal would be wrong)
        q_pos = torch.arange(sk - sq, sk, device=query.device).unsqueeze(1)
        mask = torch.arange(sk, device=query.device).unsqueeze(0) <= q_pos
    context = F.scaled_dot_product_attention(
        query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), attn_mask=mask,
        dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=query.shape[2] != key.shape[2])
    return context.permute(2, 0, 1, 3).reshape(sq, batch, -1)


def packed_context(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: PaddedSegments, *,
                   scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of each packed sequence over itself: THD [t, np, hn] queries ([t, ng, hn] keys and values,
    as Megatron's attention squeezes them under THD) -> [t, np * hv], the sequences grouped by length class
    (``packed_sequences.PaddedSegments``, worked out on the host at collate time).

    One causal SDPA per class over its sequences padded to the class's longest, [n, heads, L, d], gathered and
    scattered back by the plan's indices: no host sync and no launch per sequence, forward or backward. A
    sequence's padding lies after its tokens, so the causal mask alone keeps its queries off the padded keys, and
    the padded query rows are dropped. Within a class lengths differ by less than 2x, so the padded q, k, v and
    output (kept for the backward pass) are less than twice the packed tokens, whatever the mix of lengths. A
    varlen kernel would not pad at all."""
    outputs, start = [], 0
    for count, length in segments.shapes:
        slots = segments.gather[start:start + count * length]
        start += count * length

        def padded(x: torch.Tensor) -> torch.Tensor:  # [t, heads, d] -> [n, heads, L, d]
            return x.index_select(0, slots).view(count, length, *x.shape[1:]).transpose(1, 2)

        context = F.scaled_dot_product_attention(padded(query), padded(key), padded(value), dropout_p=dropout_p,
                                                 is_causal=True, scale=scale, enable_gqa=query.size(1) != key.size(1))
        outputs.append(context.transpose(1, 2).reshape(count * length, -1))  # [n * L, np * hv]
    return torch.cat(outputs).index_select(0, segments.scatter)


class SDPADotProductAttention(DotProductAttention):
    """``DotProductAttention`` (same constructor and forward contract) computed by ``sdpa_context``."""

    def __init__(self, config, *args, **kwargs):
        if not eligible(config):
            raise NotImplementedError("runtime.attention=flash without Transformer Engine covers vanilla causal "
                                      "attention only (no sliding window, softmax offset or query-key layer "
                                      "scaling); set runtime.attention=unfused")
        super().__init__(config, *args, **kwargs)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert attention_bias is None, "attention bias needs Transformer Engine attention"
        assert packed_seq_params is None or packed_seq_params.qkv_format == "thd", "packed sequences: THD only"
        dropout_p = self.attention_dropout.p if self.training else 0.0

        def attend():
            if packed_seq_params is not None:
                segments = getattr(packed_seq_params, "padded_segments", None)
                if segments is None:
                    raise ValueError("packed sequences without Transformer Engine need the pack's padded segments, "
                                     "worked out on the host (packed_sequences.attention_inputs)")
                return packed_context(query, key, value, segments, scale=self.softmax_scale, dropout_p=dropout_p)
            return sdpa_context(query, key, value, scale=self.softmax_scale, attention_mask=attention_mask,
                                dropout_p=dropout_p)

        if dropout_p and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return attend()
        return attend()


class SDPACPAttention(CPDotProductAttention, SDPADotProductAttention):
    """``CPDotProductAttention`` whose attention of the local queries over the gathered keys is SDPA's (its
    ``super().forward`` resolves to ``SDPADotProductAttention.forward`` in this class's method order)."""
