"""Build a Megatron Core ``GPTModel`` from the launcher's ``ModelShape`` (HF config, Megatron YAML or preset).

Covers the Llama, Qwen2 (QKV bias), Qwen3 (QK norm, explicit head_dim), Mixtral and Qwen3-MoE families: GQA,
RoPE, RMSNorm, SwiGLU, tied or untied embeddings and a TP-independent padded vocabulary. Transformer Engine
layers are used on GPUs when TE is installed; Megatron's local (pure torch) spec otherwise.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from launcher.model_shape import ModelShape

VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """Vocabulary padded to a multiple of 128 (and of tp when tp does not divide 128).

    The padded size must not depend on tp for the usual power-of-two tp, or resharding a checkpoint to a
    different tp would change the embedding shape.
    """
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def compute_dtype(name: str) -> torch.dtype:
    """Resolve model.dtype: auto is bf16 on GPUs and fp32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """Runtime choices that are not part of the architecture."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    dtype: torch.dtype = torch.float32
    seq_length: Optional[int] = None
    num_layers_in_first_stage: Optional[int] = None
    num_layers_in_last_stage: Optional[int] = None
    init_seed: int = 1234


def transformer_config(shape: ModelShape, opts: ModelOptions):
    """Megatron ``TransformerConfig`` for ``shape`` under the given parallel sizes."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if shape.is_mla:
        raise NotImplementedError(f"{shape.name}: multi-latent attention models are not built by this runtime yet")
    activation = {"silu": F.silu, "gelu": F.gelu}.get(shape.activation)
    if activation is None:
        raise NotImplementedError(f"{shape.name}: activation {shape.activation!r} is not supported")
    moe = {}
    if shape.is_moe:
        moe = dict(
            num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_router_topk,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=shape.moe_shared_expert_intermediate_size or None,
            moe_layer_freq=[int(x) for x in shape.moe_layers] if shape.moe_layers else 1,
            moe_router_pre_softmax=not shape.moe_norm_topk_prob,
            moe_router_score_function=shape.moe_router_score_function,
            moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
            moe_grouped_gemm=False, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
            expert_model_parallel_size=opts.ep, expert_tensor_parallel_size=1 if opts.ep > 1 else opts.tp)
    recompute = {}
    if opts.recompute == "selective":
        recompute = dict(recompute_granularity="selective")
    elif opts.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels, normalization=shape.normalization, layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=shape.gated_linear_unit, activation_func=activation,
        add_bias_linear=shape.add_bias_linear, add_qkv_bias=shape.add_qkv_bias, qk_layernorm=shape.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp,
        virtual_pipeline_model_parallel_size=opts.vpp if opts.vpp and opts.vpp > 1 else None,
        context_parallel_size=opts.cp, sequence_parallel=opts.sequence_parallel,
        num_layers_in_first_pipeline_stage=opts.num_layers_in_first_stage,
        num_layers_in_last_pipeline_stage=opts.num_layers_in_last_stage,
        params_dtype=opts.dtype, bf16=opts.dtype == torch.bfloat16, fp16=opts.dtype == torch.float16,
        pipeline_dtype=opts.dtype, use_cpu_initialization=not torch.cuda.is_available(),
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        init_method_std=0.02, **moe, **recompute)


def layer_spec(shape: ModelShape, config, *, vp_stage: Optional[int] = None):
    """Decoder block spec: Transformer Engine on GPUs when installed, Megatron's local spec otherwise."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=have_transformer_engine(),
                                      normalization=shape.normalization, vp_stage=vp_stage)


@contextlib.contextmanager
def layout_invariant_init(seed: int):
    """Seed the CPU RNG before the embedding and before every decoder layer by its GLOBAL layer number.

    Megatron initialises weights on the CPU from the global RNG in construction order, so a pipeline stage
    that starts at layer k would otherwise draw different weights than a single stage does. With a seed per
    layer (and the output layer drawn right after the last layer), the weights do not depend on pp/vpp;
    tensor parallelism already splits one CPU-drawn master weight.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

    original = TransformerLayer.__init__

    def seeded_init(self, config, submodules, layer_number=1, *args, **kwargs):
        vp_stage = kwargs.get("vp_stage")
        offset = get_transformer_layer_offset(config, vp_stage, parallel_state.get_pipeline_model_parallel_rank())
        torch.manual_seed(seed * 1000 + layer_number + offset)
        original(self, config, submodules, layer_number, *args, **kwargs)

    TransformerLayer.__init__ = seeded_init
    torch.manual_seed(seed * 1000)
    try:
        yield
    finally:
        TransformerLayer.__init__ = original
        torch.manual_seed(seed)


def build_gpt_model(shape: ModelShape, opts: ModelOptions, *, vp_stage: Optional[int] = None,
                    pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                    model_class=None, tie_embeddings: Optional[bool] = None):
    """One model chunk of ``shape`` for this rank's pipeline stage (and virtual stage ``vp_stage``).

    ``model_class``: a GPTModel subclass (the reward model); ``tie_embeddings`` overrides the shape's.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(shape, opts)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    rope_scaling = shape.rope_scaling or {}
    with layout_invariant_init(opts.init_seed):
        model = (model_class or GPTModel)(
            config=config, transformer_layer_spec=layer_spec(shape, config, vp_stage=vp_stage),
            vocab_size=padded_vocab_size(shape.vocab_size, opts.tp),
            max_sequence_length=shape.max_position_embeddings,
            pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=shape.tie_embeddings if tie_embeddings is None else tie_embeddings,
            position_embedding_type=shape.position_embedding_type, rotary_base=int(shape.rotary_base),
            rope_scaling=rope_scaling.get("rope_type") == "llama3",
            rope_scaling_factor=float(rope_scaling.get("factor", 8.0)),
            vp_stage=vp_stage)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def build_model_chunks(shape: ModelShape, opts: ModelOptions) -> list:
    """All model chunks this rank holds: one, or vpp of them with interleaved pipelining."""
    if opts.vpp and opts.vpp > 1:
        return [build_gpt_model(shape, opts, vp_stage=i) for i in range(opts.vpp)]
    return [build_gpt_model(shape, opts)]
