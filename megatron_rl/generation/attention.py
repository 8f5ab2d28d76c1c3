"""Faster attention while generating, on the same modules: SDPA core attention and RoPE once per token.

Two costs of Megatron's static-cache decoding that do not exist in a training forward:

* ``sdpa_core_attention(chunks)``: the local spec's ``DotProductAttention`` materialises grouped keys and
  values per query head (``repeat_interleave`` of the whole cache at every step), runs ``baddbmm``/``bmm``
  around a masked softmax and forks the model-parallel RNG for dropout even in eval mode. While generating,
  those modules call ``megatron_rl.models.sdpa_attention.sdpa_context`` instead (what the training layers of
  ``runtime.attention=flash`` run): the same maths (causal softmax(q k^T * scale) v) without the copies.
  Transformer Engine attention, and the layers already built with SDPA, are left alone.
* ``RopeOnceDecode``: the cache holds keys before RoPE, so every decode step re-rotates the whole cache.
  Megatron's own answer is its flash-decode path (``config.flash_decode``: the cache holds rotated keys and
  a ``flash_decode`` method rotates only the new token, writes the cache and attends). After the prefill
  this class rotates the prefilled keys once in place and turns that path on, with ``flash_decode`` given a
  torch body: RoPE by Megatron's ``apply_rotary_pos_emb`` with the model's own table, cache write, SDPA.
  The body is used even where flash-attn is installed, so GPUs run the same (tested) code as the CPU.

Measured on the tiny Llama (CPU, batch 64, 8 + 32 tokens): the decode step takes about 0.6x the time.
Both are per-instance and undone on exit, so training never sees them; configurations they do not
reproduce (sliding windows, softmax offsets, query-key layer scaling, output gates, YaRN/MLA, no-RoPE layers)
keep Megatron's path.

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q`` (generation vs. the unmodified training
forward agree to 1e-5 in log-probs).
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from megatron_rl.models.sdpa_attention import sdpa_context


def _eligible(module) -> bool:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_rl.models.cp_attention import CPDotProductAttention

    config = getattr(module, "config", None)
    # the CPU CP attention is the plain one while generation has CP off (layout.py whole_sequences)
    plain = type(module) is DotProductAttention or (type(module) is CPDotProductAttention and module.cp_size == 1)
    return (plain and config is not None
            and getattr(config, "softmax_type", "vanilla") == "vanilla"
            and getattr(config, "window_size", None) is None
            and not getattr(config, "apply_query_key_layer_scaling", False))


def _sdpa_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], attn_mask_type=None, attention_bias=None,
                  packed_seq_params=None) -> torch.Tensor:
    """DotProductAttention.forward contract: [sq, b, np, hn] queries, [sk, b, ng, hn] keys/values -> [sq, b, hp]."""
    if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
        return type(self).forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                                  packed_seq_params)
    return sdpa_context(query, key, value, scale=self.softmax_scale)


@contextlib.contextmanager
def sdpa_core_attention(chunks: list) -> Iterator[int]:
    """Swap eligible core-attention modules of ``chunks`` to SDPA for the duration; yields how many modules of
    ``chunks`` attend by SDPA: those swapped and those built with it (runtime.attention=flash)."""
    from megatron_rl.models.sdpa_attention import SDPADotProductAttention

    swapped, built = [], 0
    try:
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, SDPADotProductAttention):
                    built += 1
                elif _eligible(module) and "forward" not in module.__dict__:
                    module.forward = types.MethodType(_sdpa_forward, module)
                    swapped.append(module)
        yield len(swapped) + built
    finally:
        for module in swapped:
            del module.forward


def _rope_once_eligible(chunk) -> bool:
    config = chunk.config
    return (getattr(chunk, "position_embedding_type", None) == "rope"
            and not getattr(config, "multi_latent_attention", False)
            and not getattr(config, "flash_decode", False)
            and not any(getattr(config, "no_rope_freq", None) or [])
            and getattr(config, "softmax_type", "vanilla") == "vanilla"
            and getattr(config, "window_size", None) is None
            and not getattr(config, "apply_query_key_layer_scaling", False)
            and not getattr(config, "attention_output_gate", False)
            and getattr(config, "cuda_graph_impl", "none") in ("none", None)
            and hasattr(chunk, "rotary_pos_emb"))


def _rope_once_flash_decode(self, sequence_len_offset, query_layer, key_layer, value_layer, inference_key_memory,
                            inference_value_memory, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                            *, context, freqs, scale):
    """Megatron's ``Attention.flash_decode`` contract: one new token per row -> [b, 1, np, hn]."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    pos, start = context.sequence_len_offset, context.batch_size_offset
    steps, batch = query_layer.shape[0], query_layer.shape[1]
    if steps != 1:
        raise RuntimeError(f"decode step expects one token per row, got {steps}")
    step_freqs = freqs[pos:pos + 1]
    query = apply_rotary_pos_emb(query_layer, step_freqs, config=self.config)
    inference_key_memory[pos, start:start + batch] = apply_rotary_pos_emb(key_layer, step_freqs, config=self.config)[0]
    inference_value_memory[pos, start:start + batch] = value_layer[0]
    keys = inference_key_memory[:pos + 1, start:start + batch]
    values = inference_value_memory[:pos + 1, start:start + batch]
    context_layer = F.scaled_dot_product_attention(
        query.permute(1, 2, 0, 3), keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3), scale=scale,
        enable_gqa=query.shape[2] != keys.shape[2])
    return context_layer.permute(0, 2, 1, 3)


class RopeOnceDecode:
    """After the prefill: rotate the cached keys once and decode through Megatron's flash-decode hook."""

    def __init__(self, chunks: list, context) -> None:
        from megatron.core.transformer.attention import SelfAttention

        self.chunks = chunks
        self.context = context
        self.enabled = bool(chunks) and all(_rope_once_eligible(chunk) for chunk in chunks)
        self.attentions = [(chunk, module) for chunk in chunks for module in chunk.modules()
                           if isinstance(module, SelfAttention)] if self.enabled else []
        self.patched: list = []
        self.configs: list = []

    def __enter__(self) -> "RopeOnceDecode":
        return self

    def __exit__(self, *exc) -> None:
        self.end()

    def begin(self) -> None:
        """Call once, after the prefill forward and before the first decode step."""
        if not self.enabled:
            return
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        filled = self.context.sequence_len_offset
        for chunk, module in self.attentions:
            freqs = chunk.rotary_pos_emb(self.context.max_sequence_length)
            keys, _ = self.context.key_value_memory_dict[module.layer_number]
            keys[:filled] = apply_rotary_pos_emb(keys[:filled], freqs[:filled], config=module.config)
            config = module.config
            scale = config.softmax_scale
            if scale is None:
                scale = 1.0 / math.sqrt(config.kv_channels)
            module.flash_decode = types.MethodType(
                functools.partial(_rope_once_flash_decode, context=self.context, freqs=freqs, scale=scale), module)
            self.patched.append(module)
        configs = {id(c): c for c in [chunk.config for chunk in self.chunks] + [m.config for _, m in self.attentions]}
        for config in configs.values():
            config.flash_decode = True
            self.configs.append(config)

    def end(self) -> None:
        for config in self.configs:
            config.flash_decode = False
        for module in self.patched:
            del module.flash_decode
        self.configs, self.patched = [], []
