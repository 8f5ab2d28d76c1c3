"""Attention over a paged KV cache: flash-attn's two kernels on GPUs, a torch reference with their semantics on CPUs.

The paged cache of one layer is ``[num_blocks, block_size, kv_heads, head_dim]`` for K and for V; a row's keys lie
in the blocks its ``block_table`` row lists (int32, in order). Causality is bottom-right aligned: query i of a row
with Lq queries and Lk keys sees keys ``0 .. Lk - Lq + i``. GQA repeats each KV head over ``heads / kv_heads``
query heads. The two entry points take flash-attn's signatures, as Megatron's ``Attention.flash_decode_and_prefill``
calls them:

* ``varlen_attention`` (prefill and mixed steps; flash-attn's ``flash_attn_varlen_func``): ``q`` ``[tokens, heads,
  dim]`` packed row after row, ``cu_seqlens_q`` / ``cu_seqlens_k`` ``[rows + 1]`` int32 cumulative lengths; tokens
  past ``cu_seqlens_q[-1]`` belong to no row and come back as zeros.
* ``kvcache_attention`` (decode steps; ``flash_attn_with_kvcache``): ``q`` ``[rows, 1, heads, dim]``,
  ``cache_seqlens`` ``[rows]`` int32 keys per row (the new token's included: the cache is appended first); rows with
  no keys are padding and come back as zeros.

* ``reference_mla`` (multi-latent attention, paged_mla.py): absorbed queries against the latent cache. FlashMLA
  (decode only, 64-token blocks) is not wired in: every device runs this torch version for MLA.

``kernels(device, dtype)`` picks the implementation: flash-attn's when it is installed, the tensors are on a GPU and
the KV cache is fp16 or bf16, else the torch reference. The reference gathers each row's blocks over the table's
width (not the longest row's keys: no host sync; the engine cuts the table to the longest row's blocks) and makes
one SDPA call with an additive bottom-right mask, each KV head's query heads folded into the query length (MLA: all
heads against the one latent "head"): its memory is the K/V it reads plus the scores, never K/V copied per query
head, and it runs no host sync (no boolean indexing, no lengths read back). Both go through ``check_paged`` first,
which refuses what the GPU kernels refuse (block sizes that are not a multiple of 256 when flash-attn runs, head
sizes above 256 or not a multiple of 8, KV heads that do not divide the query heads, tables that are not int32), so
CI refuses what a GPU would; the reference's one extension is dtype: it runs fp32, which CPU tests use and
flash-attn does not.

Test: ``.venv/bin/python -m pytest tests/test_paged_engine.py -q -k attention``; on a GPU, ``bench/gpu_check.sh``
runs flash-attn's kernels against this reference where flash-attn is installed.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

FLASH_BLOCK_MULTIPLE = 256
"""flash-attn 2's paged KV needs ``block_size % 256 == 0``."""
FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""What flash-attn computes in (an fp32 model gets the reference on every device)."""


class PagedKernels(NamedTuple):
    """The two attention kernels of one implementation (``kernels``), with flash-attn's signatures."""

    varlen: Callable
    kvcache: Callable
    mla: Callable
    """Multi-latent attention over a latent cache (``reference_mla``: the torch reference on every device)."""
    name: str
    """"flash-attn" or "torch" (the reference)."""


def check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, *,
                flash: bool) -> None:
    """Raise ``ValueError`` for what flash-attn's paged kernels refuse (``flash``: also the block size)."""
    heads, dim = q.shape[-2], q.shape[-1]
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"paged K/V caches must be [blocks, block_size, kv_heads, dim], got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{kv_heads} KV heads do not divide {heads} query heads")
    if dim > 256 or dim % 8:
        raise ValueError(f"head size {dim} is not supported by the paged kernels (at most 256, a multiple of 8)")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be a 2-D int32 tensor, got {block_table.dtype} {tuple(block_table.shape)}")
    if flash and k_cache.shape[1] % FLASH_BLOCK_MULTIPLE:
        raise ValueError(f"flash-attn's paged KV cache needs a block size that is a multiple of "
                         f"{FLASH_BLOCK_MULTIPLE}, got {k_cache.shape[1]} (generation.kv_block_tokens)")


def check_full_attention(window_size=(-1, -1), return_attn_probs: bool = False,
                         return_softmax_lse: bool = False) -> None:
    """Raise ``ValueError`` for the flash-attn options the engine does not serve (megatron-core 0.19 passes them to
    every call): a sliding window, and the log-sum-exp that attention sinks need."""
    if tuple(window_size) != (-1, -1):
        raise ValueError(f"sliding-window attention (window_size {tuple(window_size)}) is not supported by the paged "
                         f"engine; use a model without config.window_size")
    if return_attn_probs or return_softmax_lse:
        raise ValueError("attention sinks (softmax_offset) are not supported by the paged engine")


def _gathered(cache: torch.Tensor, block_table: torch.Tensor, keys: int) -> torch.Tensor:
    """``[rows, keys, kv_heads, dim]``: each row's first ``keys`` cached positions (unused table entries may hold
    any block id: the positions past a row's length are masked)."""
    blocks = -(-keys // cache.shape[1])
    table = block_table[:, :blocks].clamp_min(0).long()
    rows = cache[table]  # [rows, blocks, block_size, kv_heads, dim]
    return rows.flatten(1, 2)[:, :keys]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: torch.Tensor, k_lens: torch.Tensor,
            scale: float) -> torch.Tensor:
    """``q`` ``[rows, kv_heads, group, max_q, dim]`` (the query heads of each KV head, GQA folded) against
    ``k``/``v`` ``[rows, max_k, kv_heads, dim]`` (``v``'s dim may differ) with the bottom-right causal mask per row
    -> ``[rows, kv_heads, group, max_q, value dim]``; query slots past a row's ``q_lens`` attend to key 0 (their
    output is dropped by the caller). SDPA sees ``kv_heads`` heads of ``group * max_q`` queries, so it never copies
    K or V per query head (``enable_gqa`` does on SDPA's math backend, CUDA's choice for a boolean mask); the mask
    is additive (0 / -inf), which CUDA's memory-efficient and cuDNN backends take."""
    rows, kv_heads, group, max_q, dim = q.shape
    max_k = k.shape[1]
    qi = torch.arange(max_q, device=q.device).view(1, max_q, 1)
    kj = torch.arange(max_k, device=q.device).view(1, 1, max_k)
    limit = (k_lens - q_lens).view(-1, 1, 1) + qi  # the last key query i may see
    allowed = (kj <= limit) & (kj < k_lens.view(-1, 1, 1))
    allowed = allowed | (kj == 0)  # no fully masked softmax (padding queries, rows without keys: dropped later)
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    if max_q > 1:  # query i of head g sits at g * max_q + i (one query per row: the mask broadcasts)
        bias = bias.repeat(1, group, 1)
    out = F.scaled_dot_product_attention(q.reshape(rows, kv_heads, group * max_q, dim), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=bias.unsqueeze(1), scale=scale)
    return out.view(rows, kv_heads, group, max_q, -1)


def reference_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: Optional[float] = None, causal: bool = True,
                     block_table: Optional[torch.Tensor] = None, window_size=(-1, -1),
                     return_attn_probs: bool = False) -> torch.Tensor:
    """``flash_attn_varlen_func`` over a paged cache, in torch: ``q`` ``[tokens, heads, dim]`` -> same shape."""
    check_full_attention(window_size, return_attn_probs)
    if not causal or block_table is None:
        raise ValueError("the paged reference implements causal attention over a block_table only")
    check_paged(q, k_cache, v_cache, block_table, flash=False)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    return _attend_packed(q, k_cache, v_cache, cu_seqlens_q, k_lens, max_seqlen_q, max_seqlen_k, block_table, scale)


def _attend_packed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
                   k_lens: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, block_table: torch.Tensor, scale: float,
                   value_dim: Optional[int] = None) -> torch.Tensor:
    """Rows packed in ``q`` ``[tokens, heads, dim]`` (``cu_seqlens_q``) against their rows' paged keys and values
    -> ``[tokens, heads, value dim]``, zeros for tokens past the last row. ``v_cache`` None: the values are the
    first ``value_dim`` entries of the keys (the MLA latent)."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    rows, tokens = q_lens.numel(), q.shape[0]
    # one row past the tokens: where the padding query slots are written (no boolean indexing: no host sync)
    out = q.new_zeros(tokens + 1, *q.shape[1:-1], v_cache.shape[-1] if v_cache is not None else value_dim)
    if rows == 0 or max_seqlen_q == 0:
        return out[:tokens]
    keys = _gathered(k_cache, block_table[:rows], max_seqlen_k)
    values = keys[..., :value_dim] if v_cache is None else _gathered(v_cache, block_table[:rows], max_seqlen_k)
    kv_heads = keys.shape[2]
    group = q.shape[1] // kv_heads
    slot = torch.arange(max_seqlen_q, device=q.device)
    index = cu_seqlens_q[:-1].long().view(-1, 1) + slot.view(1, -1)  # [rows, max_q]
    # [rows, kv_heads, group, max_q] indices into [tokens, kv_heads, group]: the queries gathered already folded
    kv_head = torch.arange(kv_heads, device=q.device).view(1, -1, 1, 1)
    in_group = torch.arange(group, device=q.device).view(1, 1, -1, 1)
    queries = q.view(tokens, kv_heads, group, -1)[index.clamp_max(tokens - 1).view(rows, 1, 1, -1), kv_head, in_group]
    attended = _attend(queries, keys, values, q_lens, k_lens, scale)
    target = torch.where(slot.view(1, -1) < q_lens.view(-1, 1), index, tokens).view(rows, 1, 1, -1)
    out.view(tokens + 1, kv_heads, group, -1).index_put_((target, kv_head, in_group), attended)
    return out[:tokens]


def reference_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cache_seqlens: torch.Tensor, causal: bool = True, block_table: Optional[torch.Tensor] = None,
                      softmax_scale: Optional[float] = None, num_splits: int = 0, window_size=(-1, -1),
                      return_softmax_lse: bool = False, **unused) -> torch.Tensor:
    """``flash_attn_with_kvcache`` over a paged cache (no new K/V passed: the cache is appended first), in torch:
    ``q`` ``[rows, q_len, heads, dim]`` -> same shape."""
    check_full_attention(window_size, return_softmax_lse=return_softmax_lse)
    if unused.get("k") is not None or unused.get("v") is not None:
        raise ValueError("the paged reference reads the cache only; append K/V before calling it")
    if block_table is None:
        raise ValueError("the paged reference needs a block_table")
    check_paged(q, k_cache, v_cache, block_table, flash=False)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    k_lens = cache_seqlens.long()
    rows, q_len = q.shape[0], q.shape[1]
    # the longest row's keys where the host knows them (PagedContext.set_step marks an eager step's lengths with
    # ``host_max``), else the table's whole width (a graph step's fixed table: a replay and its eager run read the
    # same keys); never a read of the lengths themselves (a host sync on every layer)
    longest = block_table.shape[1] * k_cache.shape[1]
    longest = min(longest, getattr(cache_seqlens, "host_max", longest))
    if rows == 0 or longest == 0:
        return torch.zeros_like(q)
    keys = _gathered(k_cache, block_table[:rows], longest)
    values = _gathered(v_cache, block_table[:rows], longest)
    q_lens = torch.full_like(k_lens, q_len)
    kv_heads, dim = k_cache.shape[2], q.shape[-1]
    folded = q.view(rows, q_len, kv_heads, -1, dim).permute(0, 2, 3, 1, 4)  # a view: decode steps have one query
    out = _attend(folded, keys, values, q_lens, k_lens, scale).permute(0, 3, 1, 2, 4).reshape(q.shape)
    return out.masked_fill((k_lens == 0).view(-1, 1, 1, 1), 0.0)


def capturing() -> bool:
    """Whether this thread's CUDA stream is capturing a graph (never without a GPU)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def reference_mla(q: torch.Tensor, latent_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, cache_seqlens: torch.Tensor,
                  max_seqlen_q: int, max_seqlen_k: int, *, block_table: torch.Tensor, head_dim_v: int,
                  softmax_scale: float) -> torch.Tensor:
    """Absorbed multi-latent attention over a paged latent cache, in torch: every query head attends to the one
    latent "head" (keys: the whole latent, values: its first ``head_dim_v`` entries), as FlashMLA's
    ``flash_mla_with_kvcache`` does, but for mixed steps too (``q`` ``[tokens, heads, latent dim]`` packed row after
    row as in ``reference_varlen``, ``cache_seqlens`` ``[rows]`` keys per row) -> ``[tokens, heads, head_dim_v]``.
    Causality is bottom-right aligned as in the other kernels."""
    if latent_cache.dim() != 4 or latent_cache.shape[2] != 1 or latent_cache.shape[3] != q.shape[-1]:
        raise ValueError(f"the latent cache must be [blocks, block_size, 1, {q.shape[-1]}], got "
                         f"{tuple(latent_cache.shape)}")
    if head_dim_v > q.shape[-1]:
        raise ValueError(f"head_dim_v {head_dim_v} exceeds the latent's {q.shape[-1]}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be a 2-D int32 tensor, got {block_table.dtype} {tuple(block_table.shape)}")
    return _attend_packed(q, latent_cache, None, cu_seqlens_q, cache_seqlens.long(), max_seqlen_q, max_seqlen_k,
                          block_table, softmax_scale, value_dim=head_dim_v)


def _flash_kernels() -> Optional[PagedKernels]:
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError:
        return None

    def varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
               causal=True, block_table=None, window_size=(-1, -1), return_attn_probs=False):
        check_full_attention(window_size, return_attn_probs)
        check_paged(q, k_cache, v_cache, block_table, flash=True)
        return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal, block_table=block_table)

    def kvcache(q, k_cache, v_cache, cache_seqlens, causal=True, block_table=None, softmax_scale=None,
                num_splits=0, window_size=(-1, -1), return_softmax_lse=False, **kwargs):
        check_full_attention(window_size, return_softmax_lse=return_softmax_lse)
        check_paged(q, k_cache, v_cache, block_table, flash=True)
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=causal,
                                       block_table=block_table, softmax_scale=softmax_scale, num_splits=num_splits,
                                       **kwargs)

    return PagedKernels(varlen=varlen, kvcache=kvcache, mla=reference_mla, name="flash-attn")


REFERENCE = PagedKernels(varlen=reference_varlen, kvcache=reference_kvcache, mla=reference_mla, name="torch")


def kernels(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> PagedKernels:
    """flash-attn's kernels on a GPU where flash-attn is installed, for a KV cache of ``dtype`` it computes in
    (fp16, bf16; the engine passes the model's params dtype, bf16 when not given as on GPU runs), else the torch
    reference."""
    if device.type == "cuda" and dtype in FLASH_DTYPES:
        found = _flash_kernels()
        if found is not None:
            return found
    return REFERENCE
