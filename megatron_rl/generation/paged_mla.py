"""Multi-latent attention (DeepSeek-V3) on the paged engine: the blocks hold the latent, attention is absorbed.

``paged_mla_forward`` replaces an MLA module's forward while the paged engine runs (paged.py
``megatron_paged_attention``); it computes what Megatron's ``MultiLatentAttention.forward`` computes on the same
weights, from a cache of latents.

What a block holds: per token and layer, the normalised KV latent and the rotated shared rope key,
``kv_lora_rank + qk_pos_emb_head_dim`` values (512 + 64 = 576 for DeepSeek-V3), the same on every TP rank. The
expanded K and V would be ``heads / tp x (qk_head_dim + qk_pos_emb_head_dim + v_head_dim)`` (128 / 8 x 320 = 5,120
at TP8): the latent is 8.9x smaller at TP8 and 71x at TP1, and it is what FlashMLA, vLLM and SGLang cache.

Attention is absorbed, the same way on prefill and decode steps: with ``W_UK``, ``W_UV`` the per-head slices of
``linear_kv_up_proj``, a query's score against a cached latent ``c`` is ``q_nope . (W_UK c) + q_pe . k_pe =
[W_UK^T q_nope, q_pe] . [c, k_pe]``, and its output is ``W_UV (sum_j p_j c_j)``: multi-query attention with one
576-wide key "head" whose first 512 entries are the values (``paged_attention.reference_mla``), then one small
matmul per head. A bias on ``linear_kv_up_proj`` moves every score of a query by the same amount (dropped by the
softmax) and adds its V part to the output. The up-projection weights are read as they are, so MLA's projections
must not carry LoRA adapters (they are not LoRA targets; ``linear_proj``, which may be, is called as a module).

Transformer Engine (GPUs) fuses the KV norm into ``linear_kv_up_proj`` (``kv_layernorm`` is an identity there):
the cache then takes the fused norm's output (``te_fused_norm``), unverified until a device runs it.

Test: ``.venv/bin/python -m pytest tests/test_paged_engine.py -q -k mla`` (the kernel against expanded attention) and
``tests/test_generation.py -k mla`` (the tiny DeepSeek-V3 model: log-probs equal the training forward's).
"""

from __future__ import annotations

from typing import Callable

import torch


def _gathered_over_tp(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """A down-projection's output, gathered over TP when its linear is column-parallel (as Megatron's MLA does)."""
    if tensor.size(-1) == width:
        return tensor
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(tensor)


def _rotated(module, tensor: torch.Tensor, positions: torch.Tensor, longest: int) -> torch.Tensor:
    """``tensor`` ``[tokens, 1, heads, rope dim]`` rotated at each token's own position, as MLA's unfused RoPE."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    table = module.rotary_pos_emb(longest)
    table, mscale = table if isinstance(table, tuple) else (table, 1.0)
    return _apply_rotary_pos_emb_bshd(tensor, table[positions], rotary_interleaved=module.config.rotary_interleaved,
                                      multi_latent_attention=True, mscale=mscale)


def paged_mla_forward(self, hidden_states: torch.Tensor, attention_mask=None, key_value_states=None,
                      inference_context=None, *args, attend: Callable, **kwargs):
    """``MultiLatentAttention.forward`` for one paged-engine step: ``hidden_states`` ``[tokens, 1, hidden]`` of the
    rows' new tokens; their latents go to the cache, then every token attends to its row's cached latents.
    Returns ``(output, bias)`` as Megatron's does."""
    from megatron_rl.models.norms import te_fused_norm

    context, config = inference_context, self.config
    tokens, heads = hidden_states.size(0), self.num_attention_heads_per_partition
    nope, rope, rank, v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.kv_lora_rank, config.v_head_dim
    positions = context.positions

    if config.q_lora_rank is not None:
        q_compressed, _ = self.linear_q_down_proj(hidden_states)
        q, _ = self.linear_q_up_proj(self.q_layernorm(_gathered_over_tp(q_compressed, config.q_lora_rank)))
    else:
        q, _ = self.linear_q_proj(hidden_states)
    q_nope, q_pe = q.view(tokens, 1, heads, nope + rope).split([nope, rope], dim=-1)
    q_pe = _rotated(self, q_pe, positions, context.max_sequence_length)

    kv_combined, _ = self.linear_kv_down_proj(hidden_states)
    kv_compressed, k_pe = _gathered_over_tp(kv_combined, rank + rope).split([rank, rope], dim=-1)
    fused_norm = te_fused_norm(self.linear_kv_up_proj)
    kv_compressed = fused_norm(kv_compressed) if fused_norm is not None else self.kv_layernorm(kv_compressed)
    k_pe = _rotated(self, k_pe.unsqueeze(-2), positions, context.max_sequence_length)
    context.append_latent(self.layer_number, torch.cat([kv_compressed.view(tokens, rank), k_pe.view(tokens, rope)],
                                                       dim=-1))

    up = self.linear_kv_up_proj.weight.view(heads, nope + v_dim, rank)
    w_uk, w_uv = up[:, :nope], up[:, nope:]
    query = torch.cat([torch.einsum("thd,hdr->thr", q_nope.view(tokens, heads, nope), w_uk.to(q_nope.dtype)),
                       q_pe.view(tokens, heads, rope)], dim=-1)
    cache = context.latent_cache(self.layer_number)
    cu_q, max_q = context.cu_query_lengths()
    _, k_lens, max_k = context.cu_kv_lengths()
    latent_out = attend(query.to(cache.dtype), cache, cu_q, k_lens, max_q, max_k,
                        block_table=context.block_table, head_dim_v=rank,
                        softmax_scale=self.softmax_scale)
    out = torch.einsum("thr,hvr->thv", latent_out.to(q_nope.dtype), w_uv.to(q_nope.dtype))
    bias = getattr(self.linear_kv_up_proj, "bias", None)
    if isinstance(bias, torch.Tensor) and bias.numel():
        out = out + bias.view(heads, nope + v_dim)[:, nope:].to(out.dtype)
    return self.linear_proj(out.reshape(tokens, 1, heads * v_dim))
