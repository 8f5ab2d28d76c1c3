"""Lean decode step: one generated token per row computed straight from the training model's parameters.

After Megatron's normal prefill, a decode step through ``GPTModel`` costs ~35 module calls and ~20 autograd
functions per step for a 2-layer model; at small sizes (and in every CPU test) that Python overhead, not the
arithmetic, sets the speed. ``LeanDecoder`` computes the same maths with plain torch calls on the SAME tensors:
the chunk's parameters (read at every step, never copied, so an optimizer step between two ``generate`` calls
is seen), the rotary table of ``chunk.rotary_pos_emb`` and the K/V tensors of Megatron's
``StaticInferenceContext``, which after the prefill hold RoPE-rotated keys (``RopeOnceDecode`` in attention.py
rotated them and is a precondition). Per layer: norm, fused QKV (+ bias), QK-norm, RoPE of the new token only,
cache write, ``decode_attention`` over the cache (GQA without copies), output projection, residual, norm, fc1
([gate; up] per TP shard) with SwiGLU / GeLU, fc2, residual; then the final norm and the output layer (or tied
embedding).

TP: the local shards of every weight are used as Megatron's column/row-parallel layers use them: the embedding
is looked up in the rank's vocabulary range and all-reduced, row-parallel outputs (``linear_proj``,
``linear_fc2``) are all-reduced over the TP group before their bias, and the vocab-parallel logits are
all-gathered. PP > 1, virtual PP, MoE, MLA, Transformer Engine modules (or any module type not listed in
``lean_decode_unsupported``) keep Megatron's module path; ``generate`` reports which path ran.

It pays for itself on the CPU path (bench/generation.py, 64 rows, greedy: the module path takes 2.25x the time
on the tiny model, 1.47x on the small one, 1.57x in the 256-token case), so it stays. Rows compacted away by
``generate`` shrink the batch it is fed; it works on the cache's first rows.

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q -k lean`` (lean vs Megatron's modules vs the
training forward, TP=1 and TP=2, GQA / MHA, QKV bias, QK-norm, bias linears, tied embeddings).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from megatron_rl.generation.attention import decode_attention

_NORMS = (torch.nn.RMSNorm, torch.nn.LayerNorm)


class _Norm(NamedTuple):
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    shape: tuple
    eps: Optional[float]
    rms: bool


def _norm_of(module) -> Optional[_Norm]:
    if module is None or type(module).__name__ == "IdentityOp":
        return None
    rms = type(module) is torch.nn.RMSNorm
    return _Norm(weight=module.weight, bias=None if rms else module.bias, shape=tuple(module.normalized_shape),
                 eps=module.eps, rms=rms)


def _apply_norm(x: torch.Tensor, norm: _Norm) -> torch.Tensor:
    if norm.rms:
        return F.rms_norm(x, norm.shape, norm.weight, norm.eps)
    return F.layer_norm(x, norm.shape, norm.weight, norm.bias, norm.eps)


class _Layer(NamedTuple):
    input_norm: _Norm
    qkv_weight: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    q_norm: Optional[_Norm]
    k_norm: Optional[_Norm]
    proj_weight: torch.Tensor
    proj_bias: Optional[torch.Tensor]
    mlp_norm: _Norm
    fc1_weight: torch.Tensor
    fc1_bias: Optional[torch.Tensor]
    fc2_weight: torch.Tensor
    fc2_bias: Optional[torch.Tensor]
    layer_number: int
    scale: float


def lean_decode_unsupported(chunks: list) -> Optional[str]:
    """Why the lean step cannot reproduce these chunks' decode step (None: it can)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if len(chunks) != 1 or ps.get_pipeline_model_parallel_world_size() != 1:
        return "pipeline parallelism (PP or virtual PP > 1)"
    chunk = chunks[0]
    config = chunk.config
    if not (getattr(chunk, "pre_process", False) and getattr(chunk, "post_process", False)):
        return "chunk without embedding or output layer"
    if getattr(chunk, "position_embedding_type", None) != "rope" or getattr(chunk, "rotary_pos_emb", None) is None:
        return f"position embedding {getattr(chunk, 'position_embedding_type', None)!r} (only rope)"
    if getattr(chunk.rotary_pos_emb, "rotary_interleaved", False) or getattr(config, "rotary_interleaved", False):
        return "interleaved rotary embedding"
    flags = {
        "num_moe_experts": bool(getattr(config, "num_moe_experts", None)),
        "multi_latent_attention": getattr(config, "multi_latent_attention", False),
        "mtp_num_layers": bool(getattr(config, "mtp_num_layers", None)),
        "fp32_residual_connection": getattr(config, "fp32_residual_connection", False),
        "apply_residual_connection_post_layernorm": getattr(config, "apply_residual_connection_post_layernorm",
                                                            False),
        "layernorm_zero_centered_gamma": getattr(config, "layernorm_zero_centered_gamma", False),
        "glu_linear_offset": bool(getattr(config, "glu_linear_offset", 0.0)),
        "activation_func_clamp_value": getattr(config, "activation_func_clamp_value", None) is not None,
        "use_te_activation_func": getattr(config, "use_te_activation_func", False),
        "attention_output_gate": getattr(config, "attention_output_gate", False),
        "softmax_type": getattr(config, "softmax_type", "vanilla") != "vanilla",
        "window_size": getattr(config, "window_size", None) is not None,
        "apply_query_key_layer_scaling": getattr(config, "apply_query_key_layer_scaling", False),
        "sequence_parallel": getattr(config, "sequence_parallel", False),
        "no_rope_freq": any(getattr(config, "no_rope_freq", None) or []),
    }
    set_flags = [name for name, on in flags.items() if on]
    if set_flags:
        return "config " + ", ".join(set_flags)
    if config.num_query_groups is not None and config.num_query_groups < ps.get_tensor_model_parallel_world_size():
        return "fewer query groups than TP ranks"
    if getattr(config, "bias_activation_fusion", False) and not (config.gated_linear_unit
                                                                 and config.activation_func is F.silu):
        return "bias_activation_fusion with a GeLU (Megatron's fused kernel uses the tanh approximation)"
    if type(chunk.embedding.word_embeddings).__name__ != "VocabParallelEmbedding" or \
            getattr(chunk.embedding, "add_position_embedding", False) or \
            getattr(chunk.embedding, "tokentype_embeddings", None) is not None:
        return "embedding other than a plain VocabParallelEmbedding"
    if type(chunk.output_layer) is not ColumnParallelLinear or chunk.output_layer.bias is not None:
        return f"output layer {type(chunk.output_layer).__name__}"
    if type(chunk.decoder.final_layernorm) not in _NORMS:
        return f"final norm {type(chunk.decoder.final_layernorm).__name__}"
    for layer in chunk.decoder.layers:
        attention, mlp = layer.self_attention, layer.mlp
        kinds = [(layer, TransformerLayer), (attention, SelfAttention), (mlp, MLP),
                 (attention.linear_qkv, ColumnParallelLinear), (attention.linear_proj, RowParallelLinear),
                 (mlp.linear_fc1, ColumnParallelLinear), (mlp.linear_fc2, RowParallelLinear)]
        for module, kind in kinds:
            if type(module) is not kind:
                return f"module {type(module).__name__} (expected {kind.__name__}, local spec)"
            if hasattr(module, "lora"):  # model.lora: the adapters run in forward hooks of the module path
                return "LoRA adapters"
        for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
            if type(norm) not in _NORMS:
                return f"norm {type(norm).__name__} (only torch RMSNorm / LayerNorm)"
        for norm in (attention.q_layernorm, attention.k_layernorm):
            if norm is not None and type(norm).__name__ != "IdentityOp" and type(norm) not in _NORMS:
                return f"QK norm {type(norm).__name__}"
        if type(layer.cross_attention).__name__ != "IdentityOp":
            return "cross attention"
    return None


class LeanDecoder:
    """Decode steps of a dense local-spec ``GPTModel`` chunk on its own parameters and Megatron's KV cache."""

    def __init__(self, chunk, context, *, batch: int) -> None:
        """Call after the prefill forward and ``RopeOnceDecode.begin()`` (the cache holds rotated keys)."""
        from megatron.core import parallel_state as ps

        self.chunk = chunk
        self.context = context
        self.batch = batch
        config = chunk.config
        self.activation = config.activation_func
        self.gated = config.gated_linear_unit
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        embedding = chunk.embedding.word_embeddings
        self.vocab_start = embedding.vocab_start_index
        self.vocab_end = embedding.vocab_end_index
        attention = chunk.decoder.layers[0].self_attention
        self.groups = attention.num_query_groups_per_partition
        self.heads = attention.num_attention_heads_per_partition
        self.head_dim = attention.hidden_size_per_attention_head
        self.per_group = self.heads // self.groups
        freqs = chunk.rotary_pos_emb(context.max_sequence_length)  # [S, 1, 1, rot_dim]
        if freqs.shape[-1] != self.head_dim:
            raise NotImplementedError("partial rotary embeddings are not handled by the lean decode step")
        dtype = attention.linear_qkv.weight.dtype
        half = self.head_dim // 2
        sin = torch.sin(freqs.reshape(freqs.shape[0], -1)).to(dtype)
        # Megatron rotates as t * cos + cat(-t2, t1) * sin; roll(t) = cat(t2, t1), so the sign moves into sin
        self.cos = torch.cos(freqs.reshape(freqs.shape[0], -1)).to(dtype)
        self.signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self.layers = []
        for layer in chunk.decoder.layers:
            att, mlp = layer.self_attention, layer.mlp
            scale = att.core_attention.softmax_scale if hasattr(att.core_attention, "softmax_scale") else None
            if scale is None:
                scale = config.softmax_scale or self.head_dim ** -0.5
            self.layers.append(_Layer(
                input_norm=_norm_of(layer.input_layernorm), qkv_weight=att.linear_qkv.weight,
                qkv_bias=att.linear_qkv.bias, q_norm=_norm_of(att.q_layernorm), k_norm=_norm_of(att.k_layernorm),
                proj_weight=att.linear_proj.weight, proj_bias=att.linear_proj.bias,
                mlp_norm=_norm_of(layer.pre_mlp_layernorm), fc1_weight=mlp.linear_fc1.weight,
                fc1_bias=mlp.linear_fc1.bias, fc2_weight=mlp.linear_fc2.weight, fc2_bias=mlp.linear_fc2.bias,
                layer_number=att.layer_number, scale=float(scale)))
        self.final_norm = _norm_of(chunk.decoder.final_layernorm)
        self.shared_output = getattr(chunk, "share_embeddings_and_output_weights", False)
        if self.tp_size > 1:
            vocab_local = (chunk.shared_embedding_or_output_weight() if self.shared_output
                           else chunk.output_layer.weight).shape[0]
            self.gathered = [torch.empty((batch, vocab_local), dtype=dtype, device=self.cos.device)
                             for _ in range(self.tp_size)]

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        weight = self.chunk.embedding.word_embeddings.weight
        if self.tp_size == 1:
            return F.embedding(token_ids, weight)
        outside = (token_ids < self.vocab_start) | (token_ids >= self.vocab_end)
        local = (token_ids - self.vocab_start).masked_fill_(outside, 0)
        hidden = F.embedding(local, weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        torch.distributed.all_reduce(hidden, group=self.tp_group)
        return hidden

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = F.linear(x, weight)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out, group=self.tp_group)
        return out if bias is None else out + bias

    def step(self, token_ids: torch.Tensor, position: int) -> torch.Tensor:
        """Logits ``[rows, padded_vocab]`` after feeding ``token_ids`` ``[rows]`` (the first ``rows`` cache rows,
        at most the batch) at ``position``; writes the new keys (rotated) and values into the cache there."""
        batch, groups, per_group, head_dim = token_ids.size(0), self.groups, self.per_group, self.head_dim
        memory = self.context.key_value_memory_dict
        cos, sin = self.cos[position], self.signed_sin[position]
        x = self._embed(token_ids)  # [b, h]
        for layer in self.layers:
            h = _apply_norm(x, layer.input_norm)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias).view(batch, groups, per_group + 2, head_dim)
            query, key, value = qkv[:, :, :per_group], qkv[:, :, per_group], qkv[:, :, per_group + 1]
            if layer.q_norm is not None:
                query = _apply_norm(query, layer.q_norm)
            if layer.k_norm is not None:
                key = _apply_norm(key, layer.k_norm)
            query = query * cos + query.roll(head_dim // 2, -1) * sin
            key = key * cos + key.roll(head_dim // 2, -1) * sin
            key_memory, value_memory = memory[layer.layer_number]
            key_memory[position, :batch] = key
            value_memory[position, :batch] = value
            context = decode_attention(query.reshape(batch, groups * per_group, 1, head_dim),
                                       key_memory[:position + 1, :batch], value_memory[:position + 1, :batch],
                                       scale=layer.scale)
            x = x + self._row_parallel(context.reshape(batch, -1), layer.proj_weight, layer.proj_bias)
            h = _apply_norm(x, layer.mlp_norm)
            h = F.linear(h, layer.fc1_weight)
            if layer.fc1_bias is not None:
                h = h + layer.fc1_bias
            if self.gated:
                gate, up = torch.chunk(h, 2, dim=-1)
                h = self.activation(gate) * up
            else:
                h = self.activation(h)
            x = x + self._row_parallel(h, layer.fc2_weight, layer.fc2_bias)
        x = _apply_norm(x, self.final_norm)
        weight = self.chunk.shared_embedding_or_output_weight() if self.shared_output else \
            self.chunk.output_layer.weight
        logits = F.linear(x, weight)
        if self.tp_size > 1:
            gathered = [part[:batch] for part in self.gathered]  # fewer rows once finished ones are compacted
            torch.distributed.all_gather(gathered, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(gathered, dim=-1)
        return logits
