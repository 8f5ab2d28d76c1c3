"""The paged KV cache: a pool of fixed-size blocks, and the per-step context Megatron's attention reads it through.

``BlockPool`` holds, for every attention layer of this rank, K and V as ``[num_blocks, block_tokens, kv_heads,
head_dim]`` (the layout flash-attn's paged kernels take). Blocks are handed to rows as their tokens are written and
returned when a row ends; a block is reference counted, so a GRPO group's completions hold their prompt's full
blocks once (only the last, partial block is copied per completion).

``PagedContext`` is one forward's view of it, in the interface Megatron Core's attention (0.19) calls for dynamic
batching (``Attention._adjust_key_value_for_inference`` and ``flash_decode_and_prefill``): the forward feeds the
rows' new tokens packed into one sequence (``[1, tokens]``), each token's K/V goes to its row's block and offset
(``append_key_value_cache``), RoPE rotates each token at its own position (``apply_rotary_emb_query/key``; the cache
holds rotated keys), attention reads the rows' blocks through their block tables (paged_attention.py), and only
each row's last token reaches the output layer (``last_token_logits``). ``megatron_paged_attention(chunks, kernels)``
points Megatron's attention at the kernels for the duration and gives every layer its global layer number as the
cache key (Megatron's own offset refuses virtual pipeline stages).

Multi-latent attention layers hold one latent tensor per layer instead of K and V, and run their own forward for
the phase (paged_mla.py): Megatron's dynamic MLA path needs ``cache_mla_latents``, which deletes the training
weights it absorbs and runs only on Transformer Engine with FlashMLA.

Test: ``.venv/bin/python -m pytest tests/test_paged_engine.py -q``
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_rl.generation.paged_attention import PagedKernels, capturing


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache shape on this rank: K and V ``[blocks, block_tokens, kv_heads, head_dim]`` each, or, for
    multi-latent attention (``latent``), one ``[blocks, block_tokens, 1, kv_lora_rank + rope dim]`` tensor."""

    kv_heads: int
    head_dim: int
    latent: bool = False

    @property
    def tensors(self) -> int:
        return 1 if self.latent else 2


def attention_layers(chunks: list) -> dict:
    """``{global layer number: LayerCache}`` of the self-attention modules of ``chunks`` (this rank's layers)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    found = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MultiLatentAttention):
                config = module.config
                found[module.layer_number] = LayerCache(kv_heads=1, latent=True,
                                                        head_dim=config.kv_lora_rank + config.qk_pos_emb_head_dim)
            elif isinstance(module, SelfAttention):
                found[module.layer_number] = LayerCache(kv_heads=module.num_query_groups_per_partition,
                                                        head_dim=module.hidden_size_per_attention_head)
    return found


class BlockPool:
    """Fixed-size KV blocks for every layer of this rank, a free list and reference counts."""

    def __init__(self, layers: dict, *, num_blocks: int, block_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV block pool needs at least one block, got {num_blocks}")
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        self.caches = {number: tuple(torch.zeros(num_blocks, block_tokens, layer.kv_heads, layer.head_dim,
                                                 dtype=dtype, device=device) for _ in range(layer.tensors))
                       for number, layer in layers.items()}
        self.refs = [0] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids first
        self.most_taken = 0
        self.reserved = 0

    @staticmethod
    def block_bytes(layers: dict, *, block_tokens: int, dtype: torch.dtype) -> int:
        """Bytes one block holds over all ``layers`` (K and V, or the latent)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(layer.tensors * block_tokens * layer.kv_heads * layer.head_dim * size for layer in layers.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.caches.values() for t in pair)

    @property
    def taken(self) -> int:
        """Blocks rows hold (reserved ones left out)."""
        return self.num_blocks - len(self.free) - self.reserved

    def reserve(self) -> int:
        """The highest free block, kept out of the rows' reach for good (scratch space)."""
        block = self.free.pop(0)
        self.refs[block] = 1
        self.reserved += 1
        return block

    def take(self) -> Optional[int]:
        """A free block (reference count 1), or None when none is left."""
        if not self.free:
            return None
        block = self.free.pop()
        self.refs[block] = 1
        self.most_taken = max(self.most_taken, self.taken)
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, blocks: list) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)
            elif self.refs[block] < 0:
                raise RuntimeError(f"KV block {block} released more often than it was taken")

    def copy(self, source: int, target: int, tokens: int) -> None:
        """The first ``tokens`` positions of block ``source`` into block ``target``, in every layer."""
        for pair in self.caches.values():
            for cache in pair:
                cache[target, :tokens] = cache[source, :tokens]


CONTEXT_INPUTS = ("cu_q", "cu_k", "k_lens", "table", "positions", "slot_block", "slot_offset", "last")
"""What ``PagedContext.set_step`` reads of a step's inputs."""


class PagedContext:
    """One forward's rows over a ``BlockPool``, in the interface of Megatron's dynamic inference context.

    ``set_step`` describes the forward: the fed tokens packed row after row, their positions and KV slots, and
    per row its query and key offsets and block table (runner.py works them out on the host)."""

    use_flashinfer_fused_rope = False
    num_speculative_tokens = 0

    class config:  # noqa: N801 (Megatron reads this from the context's InferenceConfig)
        materialize_only_last_token_logits = True

    def __init__(self, pool: BlockPool, *, max_sequence_length: int, device: torch.device) -> None:
        self.pool = pool
        self.max_sequence_length = max_sequence_length
        self.device = device
        self.padding_slice = slice(0, 0)
        self.graph_tables: list[torch.Tensor] = []
        """The rotary tables read while capturing a CUDA graph: held as long as this context (and its graphs)
        lives, since Megatron's LRU of them may drop one that a graph replays."""

    # --- what the engine sets before a forward
    def set_step(self, step: dict, *, max_q: int, max_k: int, into: Optional[dict] = None) -> torch.Tensor:
        """Describe the next forward from ``step``, its inputs on the device (runner.py ``send_step``: the fed
        tokens' ``positions``, ``slot_block`` and ``slot_offset``, each row's ``last`` token, ``cu_q``, ``cu_k``,
        ``k_lens`` and its block ``table`` cut to the longest row's blocks); ``max_q`` / ``max_k``: the longest row's
        new tokens and keys (marked on ``k_lens`` as ``host_max`` for the torch decode kernel). Returns the
        positions.
        ``into`` (graphs.py ``DecodeGraphs.inputs``, a decode-only step of exactly that many rows): the step is
        copied into those fixed buffers, which the forward then reads, table and all."""
        if into is not None:
            for name in CONTEXT_INPUTS:
                value, target = step[name], into[name]
                (target[:, :value.shape[1]] if name == "table" else target).copy_(value)
            step = into
            max_k = into["table"].shape[1] * self.pool.block_tokens
        else:  # the decode kernel reads this many keys, not the table's whole width (paged_attention.py)
            step["k_lens"].host_max = max_k
        self._max_q, self._max_k, self._decode_only = max_q, max_k, max_q == 1
        self._rope: dict = {}
        """This step's RoPE cos and sin per rotary table (``_rotated``)."""
        self._cu_q, self._cu_k, self._k_lens, self._table = step["cu_q"], step["cu_k"], step["k_lens"], step["table"]
        self._positions, self._slot_block, self._slot_offset = step["positions"], step["slot_block"], step["slot_offset"]
        self._last = step["last"]
        return self._positions

    # --- Megatron's dynamic-context interface (megatron/core/transformer/attention.py, models/gpt/gpt_model.py)
    def is_static_batching(self) -> bool:
        return False

    def is_dynamic_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        return self._decode_only

    def using_cuda_graph_this_step(self) -> bool:
        return False

    def cu_query_lengths(self):
        return self._cu_q, self._max_q

    def cu_kv_lengths(self):
        return self._cu_k, self._k_lens, self._max_k

    def append_key_value_cache(self, layer_number: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """``key``/``value`` ``[tokens, 1, kv_heads, dim]`` into the rows' blocks."""
        k_cache, v_cache = self.pool.caches[layer_number]
        k_cache[self._slot_block, self._slot_offset] = key.squeeze(1).to(k_cache.dtype)
        v_cache[self._slot_block, self._slot_offset] = value.squeeze(1).to(v_cache.dtype)

    def append_latent(self, layer_number: int, latent: torch.Tensor) -> None:
        """Multi-latent attention: ``latent`` ``[tokens, kv_lora_rank + rope dim]`` into the rows' blocks."""
        cache = self.latent_cache(layer_number)
        cache[self._slot_block, self._slot_offset, 0] = latent.to(cache.dtype)

    def latent_cache(self, layer_number: int) -> torch.Tensor:
        """Multi-latent attention: the layer's ``[blocks, block_tokens, 1, kv_lora_rank + rope dim]`` cache."""
        cache, = self.pool.caches[layer_number]
        return cache

    @property
    def positions(self) -> torch.Tensor:
        """The position of every fed token ``[tokens]``."""
        return self._positions

    @property
    def block_table(self) -> torch.Tensor:
        """``[rows, blocks]`` int32: each fed row's blocks, in order."""
        return self._table

    def key_value_cache(self, layer_number: int):
        k_cache, v_cache = self.pool.caches[layer_number]
        return k_cache, v_cache, self._table

    def _rotated(self, tensor: torch.Tensor, table: torch.Tensor, config) -> torch.Tensor:
        """RoPE at each fed token's position, as Megatron's unfused ``_apply_rotary_pos_emb_bshd`` computes it (the
        builder turns its fusion off on every device), with the step's cos and sin computed once for all layers and
        both of query and key (within a CUDA graph's capture, again inside it, so that a replay computes them from its
        own positions)."""
        from megatron.core.models.common.embeddings.rope_utils import _rotate_half
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config,
        )

        under_capture = capturing()
        if under_capture:
            self.graph_tables.append(table)
        key = (id(table), tensor.dtype, under_capture)
        if key not in self._rope:
            freqs = table[self._positions]
            mscale = _yarn_get_concentration_factor_from_config(config)
            self._rope[key] = (table, freqs.shape[-1], (torch.cos(freqs) * mscale).to(tensor.dtype),
                               (torch.sin(freqs) * mscale).to(tensor.dtype))
        _, rot_dim, cos, sin = self._rope[key]
        rotated, passed = tensor[..., :rot_dim], tensor[..., rot_dim:]
        rotated = (rotated * cos) + (_rotate_half(rotated, config.rotary_interleaved) * sin)
        return torch.cat((rotated, passed), dim=-1)

    def apply_rotary_emb_query(self, query, query_emb, config, cu_seqlens_q=None, cp_group=None, mscale=1.0):
        return self._rotated(query, query_emb, config)

    def apply_rotary_emb_key(self, key, key_emb, config, cp_group=None, mscale=1.0):
        return self._rotated(key, key_emb, config)

    def last_token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[1, tokens, h]`` -> each row's last token ``[rows, h]``."""
        return hidden.squeeze(0)[self._last]

    # the static-batching counters Megatron's base context offers (no-ops for dynamic batching)
    def increment_sequence_len_offset(self, increment: int) -> None:
        pass

    def increment_batch_size_offset(self, increment: int) -> None:
        pass

    def reset_batch_size_offset(self) -> None:
        pass


def _merge_heads(tensor: torch.Tensor, pattern: str) -> torch.Tensor:
    """The one einops ``rearrange`` Megatron's dynamic attention calls (einops is not a dependency)."""
    if pattern.replace(" ", "") != "sbhd->sb(hd)":
        raise NotImplementedError(f"rearrange {pattern!r}")
    return tensor.flatten(-2)


@contextlib.contextmanager
def megatron_paged_attention(chunks: list, kernels: PagedKernels) -> Iterator[None]:
    """For the duration, Megatron's attention modules of ``chunks`` run dynamic batching on ``kernels`` and key
    their caches by global layer number (``_get_pp_layer_offset_for_inference`` 0: Megatron's own refuses virtual
    pipeline stages), under Megatron's process-wide ``InferenceMode``, which its modules read instead of the
    inference context to take their decode paths. Restored on exit."""
    from megatron.core.inference.utils import InferenceMode
    from megatron.core.transformer import attention as megatron_attention
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    from megatron_rl.generation.paged_mla import paged_mla_forward

    names = {"flash_attn_varlen_func": kernels.varlen, "flash_attn_with_kvcache": kernels.kvcache,
             "HAVE_FA3": False, "HAVE_FA4": False,  # Megatron prefers FA4, then FA3, where installed; the engine runs FA2
             "is_fa_min_version": lambda *args, **kwargs: True, "rearrange": _merge_heads}
    saved = {name: getattr(megatron_attention, name) for name in names}
    patched, patched_mla = [], []
    try:
        InferenceMode.set_active()
        for name, value in names.items():
            setattr(megatron_attention, name, value)
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, MultiLatentAttention):
                    module.forward = types.MethodType(
                        lambda self, *args, **kwargs: paged_mla_forward(self, *args, attend=kernels.mla, **kwargs),
                        module)
                    patched_mla.append(module)
                elif isinstance(module, Attention) and "_get_pp_layer_offset_for_inference" not in module.__dict__:
                    module._get_pp_layer_offset_for_inference = types.MethodType(lambda self: 0, module)
                    patched.append(module)
        yield
    finally:
        InferenceMode.unset_active()
        for name, value in saved.items():
            setattr(megatron_attention, name, value)
        for module in patched:
            del module._get_pp_layer_offset_for_inference
        for module in patched_mla:
            del module.forward
