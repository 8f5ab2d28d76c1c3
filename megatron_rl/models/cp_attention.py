"""Context-parallel core attention for Megatron's local (pure torch) layer spec, plus the CP batch helpers.

Megatron Core 0.16.1's local ``DotProductAttention`` asserts ``context_parallel_size == 1`` ("Context
parallelism is only supported by TEDotProductAttention!"), and Transformer Engine does not run on the CPU.
``CPDotProductAttention`` is a drop-in replacement for the local spec's ``core_attention``:

* cp == 1: it *is* ``DotProductAttention`` (the parent's forward runs unchanged), so results are bit-identical.
* cp > 1: this rank holds 2 of the 2*cp sequence chunks in Megatron's load-balanced order (rank r: chunks r and
  2*cp-1-r, see ``megatron.core.utils.get_batch_on_this_cp_rank``). K and V are all-gathered over the CP group
  (``_AllGatherSeq``: all-gather forward, reduce-scatter of the K/V gradients backward), put back into natural
  sequence order, and the parent's forward runs on the local queries against the whole sequence with a causal
  mask built from the queries' global positions. Memory is O(s_local * s) per head: meant for CPU tests and small
  runs; GPUs use Transformer Engine's CP attention (p2p / a2a).

Helpers: ``with_cp_core_attention(spec)`` swaps the module into any local GPT layer/block spec (a copy; the
argument is not modified); ``slice_batch_for_cp(batch)`` gives this CP rank's part of a micro-batch through
Megatron's own ``get_batch_on_this_cp_rank``; ``gather_from_cp(x, seq_dim)`` is its inverse for outputs
(per-token log-probs, logits) and ``cp_global_positions`` names the global positions a rank holds.

Rotary embeddings: ``RotaryEmbedding.forward`` slices the table per CP rank with Megatron's
``get_pos_emb_on_this_cp_rank``, which builds its index with ``pin_memory=True`` and fails on a CPU-only
machine; ``megatron_rl.runtime.cpu_compat`` routes it through the same slicing without pinned memory.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Iterable, Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import attention_mask_func

__all__ = [
    "CPDotProductAttention", "with_cp_core_attention", "slice_batch_for_cp", "gather_from_cp",
    "all_gather_sequence", "cp_global_positions",
]


# ----------------------------------------------------------------------------------------------------------
# Collectives and sequence order.

def _all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    fn = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    fn(output, tensor, group=group)


def _reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    fn = getattr(torch.distributed, "reduce_scatter_single", None) or torch.distributed.reduce_scatter_tensor
    try:
        fn(output, tensor, group=group)
    except RuntimeError:
        # a backend without reduce-scatter: all-reduce, keep this rank's block (twice the traffic, same sum)
        total = tensor.clone()
        torch.distributed.all_reduce(total, group=group)
        output.copy_(total.chunk(torch.distributed.get_world_size(group), dim=0)[torch.distributed.get_rank(group)])


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 in group-rank order; backward reduce-scatters (sums) the gradient to each rank's
    block: every rank's queries used every rank's K/V, so each block's gradient is the sum over the group."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = torch.distributed.get_world_size(group)
        tensor = tensor.contiguous()
        output = torch.empty((world * tensor.size(0), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        _all_gather_into(output, tensor, group)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = torch.distributed.get_world_size(ctx.group)
        grad = grad.contiguous()
        output = torch.empty((grad.size(0) // world, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        _reduce_scatter_into(output, grad, ctx.group)
        return output, None


def all_gather_sequence(tensor: torch.Tensor, group=None, seq_dim: int = 0) -> torch.Tensor:
    """Differentiable all-gather of CP-local ``tensor`` (Megatron's load-balanced layout along ``seq_dim``) into
    the whole sequence in natural order. The backward reduce-scatters the gradient back to the CP ranks."""
    group = parallel_state.get_context_parallel_group() if group is None else group
    cp = torch.distributed.get_world_size(group)
    if cp == 1:
        return tensor
    if tensor.size(seq_dim) % 2:
        raise ValueError(f"CP-local sequence length {tensor.size(seq_dim)} is odd: each rank holds 2 chunks")
    moved = tensor.movedim(seq_dim, 0)
    gathered = _AllGatherSeq.apply(moved, group)  # [cp * s_local, ...], rank-major: (chunk r, chunk 2cp-1-r)
    chunk = moved.size(0) // 2
    # natural chunk j < cp is rank j's first chunk; chunk j >= cp is rank (2cp-1-j)'s second chunk
    order = [2 * j for j in range(cp)] + [2 * (2 * cp - 1 - j) + 1 for j in range(cp, 2 * cp)]
    blocks = gathered.view(2 * cp, chunk, *moved.shape[1:])
    index = torch.tensor(order, dtype=torch.long, device=tensor.device)
    natural = blocks.index_select(0, index).reshape(cp * moved.size(0), *moved.shape[1:])
    return natural.movedim(0, seq_dim)


def gather_from_cp(tensor: torch.Tensor, seq_dim: int = 1, group=None) -> torch.Tensor:
    """The inverse of ``slice_batch_for_cp`` for an output (e.g. per-token log-probs [b, s/cp] -> [b, s]):
    every CP rank gets the whole sequence in natural order. Differentiable."""
    return all_gather_sequence(tensor, group=group, seq_dim=seq_dim)


def cp_global_positions(local_length: int, cp_size: Optional[int] = None, cp_rank: Optional[int] = None,
                        device: Any = None) -> torch.Tensor:
    """Global positions of the ``local_length`` tokens this CP rank holds (chunks r and 2*cp-1-r)."""
    cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
    if cp_size == 1:
        return torch.arange(local_length, device=device)
    if local_length % 2:
        raise ValueError(f"CP-local sequence length {local_length} is odd: each rank holds 2 chunks")
    chunk = local_length // 2
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


# ----------------------------------------------------------------------------------------------------------
# Core attention.

class CPDotProductAttention(DotProductAttention):
    """``DotProductAttention`` (same constructor and forward signature) that also runs at cp > 1.

    forward(query [sq, b, np, hn], key/value [sq, b, ng, hn], attention_mask, attn_mask_type=None,
    attention_bias=None, packed_seq_params=None) -> [sq, b, np * hn], where sq is this CP rank's part of the
    sequence. ``attention_mask`` (optional, True = masked) must then be [b or 1, 1, sq, s]: local queries against
    the whole sequence in natural order, which is what ``slice_batch_for_cp`` makes of a [b, 1, s, s] mask. Like
    the parent, an explicit mask replaces the causal one. Packed sequences and attention bias are not supported
    (the parent asserts), nor sliding-window attention at cp > 1.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        cp_size = config.context_parallel_size
        # The parent only refuses cp > 1; everything else it derives from the config holds for any cp.
        parent_config = config
        if cp_size > 1:
            parent_config = copy.copy(config)
            parent_config.context_parallel_size = 1
        super().__init__(config=parent_config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.config = config
        self.cp_size = cp_size
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_size > 1:
            if self.scale_mask_softmax.window_size is not None:
                raise NotImplementedError("sliding-window attention is not supported at context_parallel_size > 1")
            # Local queries against the gathered sequence: sq != sk, so the mask is always explicit, and the
            # fused causal kernel (which assumes sq == sk) must not be picked.
            self.scale_mask_softmax = FusedScaleMaskSoftmax(
                input_in_fp16=config.fp16, input_in_bf16=config.bf16, attn_mask_type=AttnMaskType.padding,
                scaled_masked_softmax_fusion=False, mask_func=attention_mask_func,
                softmax_in_fp32=config.attention_softmax_in_fp32, scale=self.scale_mask_softmax.scale,
                window_size=None)

    def _group(self):
        if self.cp_group is None:
            self.cp_group = parallel_state.get_context_parallel_group()
        return self.cp_group

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self.cp_size == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        assert packed_seq_params is None, "packed sequences are not supported by CPDotProductAttention"
        group = self._group()
        if torch.distributed.get_world_size(group) != self.cp_size:
            raise RuntimeError(f"CP group has {torch.distributed.get_world_size(group)} ranks, config says "
                               f"context_parallel_size={self.cp_size}")
        sq = query.size(0)
        # [sq, b, ng, hn] -> [s, b, ng, hn], natural order (gathered before the GQA repeat: cp x fewer bytes)
        key = all_gather_sequence(key, group)
        value = all_gather_sequence(value, group)
        if attention_mask is None:
            if self.attn_mask_type != AttnMaskType.causal:
                raise NotImplementedError(f"attn_mask_type {self.attn_mask_type} without a mask at cp > 1")
            q_pos = cp_global_positions(sq, self.cp_size, torch.distributed.get_rank(group), device=query.device)
            k_pos = torch.arange(key.size(0), device=query.device)
            attention_mask = (k_pos.unsqueeze(0) > q_pos.unsqueeze(1)).view(1, 1, sq, key.size(0))
        elif attention_mask.size(-2) != sq or attention_mask.size(-1) != key.size(0):
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must be [.., {sq}, {key.size(0)}] at "
                             "cp > 1 (local queries x whole sequence; see slice_batch_for_cp)")
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=None)


# ----------------------------------------------------------------------------------------------------------
# Spec and batch helpers.

def _swap_core_attention(node: Any, module: type) -> Any:
    if isinstance(node, ModuleSpec) and node.module is DotProductAttention:
        return dataclasses.replace(node, module=module)
    if node is DotProductAttention:
        return module
    if isinstance(node, (list, tuple)):
        return type(node)(_swap_core_attention(item, module) for item in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {}
        for f in dataclasses.fields(node):
            if not f.init:
                continue
            value = getattr(node, f.name)
            new = _swap_core_attention(value, module)
            if new is not value:
                changes[f.name] = new
        return dataclasses.replace(node, **changes) if changes else node
    return node


def with_cp_core_attention(spec: Any, module: type = CPDotProductAttention) -> Any:
    """A copy of a local GPT layer spec (``get_gpt_layer_local_spec``) or block spec
    (``get_gpt_decoder_block_spec(..., use_transformer_engine=False)``) whose ``core_attention`` is ``module``
    wherever it was Megatron's ``DotProductAttention``; Transformer Engine specs come back unchanged. The copied
    objects are new; everything else is shared with ``spec``."""
    return _swap_core_attention(spec, module)


def _sequence_keys(batch: dict, seq_length: int) -> list[str]:
    keys = []
    for key, val in batch.items():
        if not torch.is_tensor(val):
            continue
        if key == "attention_mask":
            if val.dim() >= 3 and val.size(2) == seq_length:
                keys.append(key)
        elif val.dim() >= 2 and val.size(1) == seq_length:
            keys.append(key)
    return keys


def slice_batch_for_cp(batch: Mapping, keys: Optional[Iterable[str]] = None, seq_key: str = "tokens") -> Mapping:
    """This CP rank's part of a micro-batch in Megatron's load-balanced order, via Megatron's own
    ``get_batch_on_this_cp_rank``: a new batch of the argument's type (a dict, or a typed batch such as
    ``megatron_rl.rollout.batch.RolloutBatch``, a dataclass), which is not modified. At cp == 1 the batch itself.

    ``keys``: the per-token entries to slice along dim 1 (``attention_mask`` [b, 1, s, s] along dim 2, its query
    dim). Default: every tensor whose dim 1 (``attention_mask``: dim 2) has ``batch[seq_key]``'s length, e.g.
    tokens, labels, loss_mask, position_ids, behav_logp, ref_logp; per-sequence entries ([b] advantages,
    last_index) stay whole. The sequence length must be divisible by 2 * cp.
    """
    from megatron.core.utils import get_batch_on_this_cp_rank

    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return batch
    seq_length = batch[seq_key].size(1)
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 * cp = {2 * cp}")
    keys = _sequence_keys(batch, seq_length) if keys is None else list(keys)
    sliced = get_batch_on_this_cp_rank({key: batch[key] for key in keys}, is_hybrid_cp=False,
                                       cp_group=parallel_state.get_context_parallel_group())
    return dataclasses.replace(batch, **sliced) if dataclasses.is_dataclass(batch) else {**batch, **sliced}
