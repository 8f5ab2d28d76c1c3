"""Build a Megatron Core ``GPTModel`` from the launcher's ``ModelShape`` (HF config, Megatron YAML or preset).

Covers the Llama, Qwen2 (QKV bias), Qwen3 (QK norm, explicit head_dim), Mixtral, Qwen3-MoE and DeepSeek-V3
families: GQA, RoPE, RMSNorm, SwiGLU, tied or untied embeddings and a TP-independent padded vocabulary; for
DeepSeek-V3 also multi-latent attention (``MLATransformerConfig``, q-LoRA optional, yarn RoPE), shared experts,
dense-first layers, sigmoid routing with the expert-bias correction, group-limited routing and the routed
scaling factor. Multi-token-prediction layers are not built. Transformer Engine
layers are used on GPUs when TE is installed; Megatron's local (pure torch) spec otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_rl.spec.config.schema import LoraConfig, attention_kernel
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.spec.parallel import ParallelDims, mla_error
from megatron_rl.spec.pipeline_layout import expand_layout, megatron_layout

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


def resolve_transformer_engine(setting) -> bool:
    """runtime.transformer_engine for this process: auto is whether TE is usable (installed, with a GPU)."""
    usable = have_transformer_engine()
    if setting is True and not usable:
        raise ConfigError("runtime.transformer_engine=true, but transformer_engine does not import here or no GPU "
                          "is visible; install the project's te extra in the job's environment, or set "
                          "runtime.transformer_engine=auto")
    return usable if setting == "auto" else bool(setting)


def compute_dtype(name: str) -> torch.dtype:
    """Resolve model.dtype: auto is bf16 on GPUs and fp32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """Runtime choices that are not part of the architecture."""

    dims: ParallelDims = field(default_factory=lambda: ParallelDims(world_size=1))
    """The parallel sizes and the pipeline split (only the model-parallel ones matter to the builder)."""
    recompute: str = "none"
    """Activation recompute: none, selective or full."""
    dtype: torch.dtype = torch.float32
    """Parameter and compute dtype."""
    seq_length: Optional[int] = None
    """Training sequence length."""
    init_seed: int = 1234
    """Seed of the layout-invariant weight initialisation."""
    moe_load_balancing: str = "none"
    """Router load-balancing loss: one of the schema's MOE_LOAD_BALANCING (Megatron's
    moe_router_load_balancing_type)."""
    moe_aux_loss_coeff: float = 0.0
    """Its coefficient (0 turns it off)."""
    moe_expert_bias_update: bool = False
    """model.moe_expert_bias_update: update the router's expert bias (rate EXPERT_BIAS_UPDATE_RATE) or keep it."""
    router_replay: bool = False
    """algorithm.router_replay: routers that can record and replay their top-k (megatron_rl/models/router_replay.py)."""
    transformer_engine: bool = field(default_factory=lambda: have_transformer_engine())
    """Build Transformer Engine layers (runtime.transformer_engine resolved; default: whether TE is usable)."""
    moe_grouped_gemm: Optional[bool] = None
    """runtime.moe_grouped_gemm: routed experts as grouped linears (TEGroupedMLP; TE's grouped GEMM, or without TE
    the torch grouped linears of grouped_linear.py) or one MLP per expert; None: grouped where TE runs."""
    attention: str = "auto"
    """runtime.attention: flash, unfused, or auto (flash); see ``core_attention``."""
    recompute_num_layers: Optional[int] = None
    """parallel.recompute_num_layers: with full recompute, only the first N layers of each stage (block method)."""
    tp_comm_overlap: bool = False
    """runtime.tp_comm_overlap: TE userbuffers overlap of the TP collectives (GPUs with TE only)."""
    lora: Optional[LoraConfig] = None
    """model.lora: low-rank adapters on a frozen base (megatron_rl/models/lora.py); None trains every weight."""

    @property
    def grouped_experts(self) -> bool:
        """Whether routed experts are grouped linears (runtime.moe_grouped_gemm resolved)."""
        return self.transformer_engine if self.moe_grouped_gemm is None else self.moe_grouped_gemm

    @property
    def core_attention(self) -> str:
        """flash or unfused, the kernel these layers run."""
        return attention_kernel(self.attention)

    def takes_packed_sequences(self, shape: ModelShape) -> bool:
        """Whether packed micro-batches reach these layers' core attention as THD ``PackedSeqParams``, which runs one
        attention per sequence (Transformer Engine's, or SDPADotProductAttention's for dense attention), rather
        than as a block-diagonal mask (Megatron's local kernel, and MLA without TE)."""
        return self.transformer_engine or (self.core_attention == "flash" and not shape.is_mla)


CPU_INIT = True
"""Megatron's ``use_cpu_initialization`` on every device: weights are drawn on the CPU, then moved to the GPU
(``build_gpt_model``), so ``model.init_seed`` gives the same weights on a CPU and a GPU and at every TP layout:
``_initialize_affine_weight_cpu`` draws each full master weight from the CPU generator that
``layout_invariant_init`` seeds, and every TP rank keeps its slice. Megatron's GPU path would draw each rank's slice
from its CUDA RNG tracker (seed + 2718 + tp_rank): different weights on every device and TP layout.

The cost grows with the model. A rank draws the full master weights of the layers it holds (fp32, then cast),
at ~185 M normals/s on one CPU thread (measured here; torchrun starts ranks with OMP_NUM_THREADS=1) and about
as fast again for the cast. Llama-3.1-405B at TP8 PP16: 8 layers of 3.19 B weights (qkv 0.30, o 0.27, fc1 1.74,
fc2 0.87 B) plus a 2.1 B embedding or output layer on the end stages, 27.6 B per rank: ~150 s to draw, ~160 s
to cast, ~5 min per start, and the largest master (fc1, 7 GB fp32 + 3.5 GB bf16) on all 8 ranks of a node at
once is ~84 GB of host memory. With ``model.init_from`` (or a resumed run) the draw is wasted: the checkpoint
overwrites it. Skipping it there (Megatron's ``perform_initialization=False``) is not done: weights a
checkpoint does not hold must still be drawn (a reward model's fresh head on a policy trunk, LoRA adapters,
a PPO critic's value head), and an unloaded ``torch.empty`` weight would train on garbage without an error."""

EXPERT_BIAS_UPDATE_RATE = 1e-3
"""Megatron's default moe_router_bias_update_rate (DeepSeek-V3's gamma 0.001)."""


def aux_loss_coeff(opts: ModelOptions) -> float:
    """The ``moe_aux_loss_coeff`` to give Megatron for ``opts.moe_aux_loss_coeff``: the coefficient itself.

    Under per-token loss (``calculate_per_token_loss``) Megatron multiplies each rank's aux loss by the tokens it
    routed times its TP·CP group size (router.py ``attach_and_log_load_balancing_loss``, from 0.19), which cancels
    the division of every gradient by the global token count also under sequence parallelism, where a rank
    routes 1/(tp·cp) of the sequence (tests/test_scale_layouts.py). 0.16.1 left out the group size, and this
    function multiplied the coefficient by tp·cp to make up for it.
    """
    if opts.moe_load_balancing == "none" or not opts.moe_aux_loss_coeff:
        return 0.0
    return opts.moe_aux_loss_coeff


def transformer_config(shape: ModelShape, opts: ModelOptions):
    """Megatron ``TransformerConfig`` for ``shape`` under the given parallel sizes."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dims = opts.dims
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
            **moe_routing_options(shape, opts),
            moe_token_dispatcher_type=moe_dispatcher(dims),
            moe_grouped_gemm=opts.grouped_experts,
            moe_aux_loss_coeff=aux_loss_coeff(opts),
            moe_router_load_balancing_type=opts.moe_load_balancing if opts.moe_aux_loss_coeff else "none",
            moe_enable_routing_replay=opts.router_replay,
            expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=dims.etp)
    recompute = {}
    if opts.recompute == "selective":
        recompute = dict(recompute_granularity="selective")
    elif opts.recompute == "full" and opts.recompute_num_layers is not None:
        recompute = dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=opts.recompute_num_layers)
    elif opts.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config_class, mla = TransformerConfig, {}
    if shape.is_mla:
        config_class, mla = mla_options(shape, dims, transformer_engine=opts.transformer_engine)
    return config_class(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.v_head_dim if shape.is_mla else shape.kv_channels,  # MLA: the value head
        normalization=shape.normalization, layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=shape.gated_linear_unit, activation_func=activation,
        add_bias_linear=shape.add_bias_linear, add_qkv_bias=shape.add_qkv_bias,
        qk_layernorm=shape.qk_layernorm or shape.is_mla,  # MLA: its latent norms (q_layernorm, kv_layernorm)
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        # Interleaved at pp=2 a rank's previous and next stage are one peer: batched p2p posts the gradient to
        # "prev" before the activation to "next", the peer receives them in posting order, and the two swap once
        # the schedule sends both at once (the ratio of a GRPO step is then not 1). Megatron-LM turns batching off
        # under interleaving too.
        batch_p2p_comm=dims.vpp <= 1,
        context_parallel_size=dims.cp, sequence_parallel=dims.sp,
        num_layers_in_first_pipeline_stage=dims.first_stage_layers,
        num_layers_in_last_pipeline_stage=dims.last_stage_layers,
        account_for_embedding_in_pipeline_split=dims.account_for_embedding,
        account_for_loss_in_pipeline_split=dims.account_for_loss,
        pipeline_model_parallel_layout=(megatron_layout(expand_layout(dims.pipeline_layout))
                                        if dims.pipeline_layout is not None else None),
        params_dtype=opts.dtype, bf16=opts.dtype == torch.bfloat16, fp16=opts.dtype == torch.float16,
        pipeline_dtype=opts.dtype, use_cpu_initialization=CPU_INIT,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        init_method_std=0.02, calculate_per_token_loss=True, attention_backend=attention_backend(opts),
        tp_comm_overlap=opts.tp_comm_overlap, **moe, **recompute, **mla)


def moe_dispatcher(dims: ParallelDims) -> str:
    """Megatron's MoE token dispatcher: the all-to-all one on every device and backend (gloo has all_to_all_single
    too), so the dispatcher GPUs run is the one CI runs; but the all-gather one where experts are split over
    expert-TP ranks (etp > 1) and over EP ranks (ep > 1) on gloo: after the all-to-all each expert-TP rank holds
    its own number of tokens, which the dispatcher gathers over the expert-TP group in uneven pieces, and gloo's
    all_gather takes equal pieces only ("invalid tensor size")."""
    if dims.etp > 1 and dims.ep > 1:
        dist = torch.distributed
        backend = str(dist.get_backend()) if dist.is_initialized() else \
            ("nccl" if torch.cuda.is_available() else "gloo")
        if "nccl" not in backend:
            return "allgather"
    return "alltoall"


def attention_backend(opts: ModelOptions):
    """Megatron's ``attention_backend`` for TE layers (auto: flash or fused, TE's pick; unfused: TE's unfused
    backend); ``local`` for the torch layers, whose kernel is the spec's core-attention module."""
    from megatron.core.transformer.enums import AttnBackend

    if not opts.transformer_engine:
        return AttnBackend.local
    return AttnBackend.auto if opts.core_attention == "flash" else AttnBackend.unfused


def moe_routing_options(shape: ModelShape, opts: ModelOptions) -> dict:
    """DeepSeek-V3 routing: expert bias (frozen unless opts.moe_expert_bias_update), group-limited top-k, scaling.

    Megatron and transformers agree on group-limited routing when each group is scored by its top-2 experts:
    Megatron scores a group by its top (topk / group_topk) experts, transformers' DeepseekV3 by its top 2
    (conversion refuses the configs where the two differ)."""
    options: dict = {}
    if shape.moe_router_enable_expert_bias:
        options.update(moe_router_enable_expert_bias=True, moe_router_dtype="fp32",  # HF routes in fp32
                       moe_router_bias_update_rate=EXPERT_BIAS_UPDATE_RATE if opts.moe_expert_bias_update else 0.0)
    if shape.moe_router_num_groups > 1 and shape.moe_router_group_topk:
        options.update(moe_router_num_groups=shape.moe_router_num_groups,
                       moe_router_group_topk=shape.moe_router_group_topk)
    if shape.moe_router_topk_scaling_factor != 1.0:
        options.update(moe_router_topk_scaling_factor=shape.moe_router_topk_scaling_factor)
    return options


def mla_options(shape: ModelShape, dims: ParallelDims, *, transformer_engine: bool):
    """``MLATransformerConfig`` and its fields for a multi-latent-attention shape (DeepSeek-V2/V3).

    The local spec builds MLA's latent norms (q_layernorm, kv_layernorm) only with ``qk_layernorm``. Megatron's
    ``finalize_model_grads`` sums every ``q_layernorm`` grad over TP by name, which is right only when each TP
    rank saw its own part of the sequence: so at TP > 1 the local spec needs sequence parallelism."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if not transformer_engine:
        _mla_without_te()
    why = mla_error(shape, tp=dims.tp, cp=dims.cp, sp=dims.sp, transformer_engine=transformer_engine)
    if why is not None:
        raise ConfigError(why)
    options = dict(q_lora_rank=shape.q_lora_rank or None, kv_lora_rank=shape.kv_lora_rank,
                   qk_head_dim=shape.qk_nope_head_dim, qk_pos_emb_head_dim=shape.qk_rope_head_dim,
                   v_head_dim=shape.v_head_dim, rotary_base=shape.rotary_base)
    if shape.rope_type == "yarn":
        yarn = shape.yarn_params()
        options.update(rope_type="yarn", rotary_scaling_factor=yarn["factor"],
                       original_max_position_embeddings=yarn["original_max_position_embeddings"],
                       beta_fast=yarn["beta_fast"], beta_slow=yarn["beta_slow"], mscale=yarn["mscale"],
                       mscale_all_dim=yarn["mscale_all_dim"])
    elif shape.rope_type == "default":
        options.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    else:
        raise NotImplementedError(f"{shape.name}: rope_scaling {shape.rope_type!r} with multi-latent attention")
    return MLATransformerConfig, options


def _mla_without_te() -> None:
    """Megatron's MLA module without Transformer Engine, patched once per process:

    * it takes TE's import stubs (MagicMocks) for TE and calls ``isinstance`` with them: ``HAVE_TE`` set False;
    * its only TP-replicated down projection is modelopt's ``Linear`` with torch's default init: replaced (under
      that name, which MLA checks) by one that also applies the config's init method;
    * it builds its rotary embedding without ``use_cpu_initialization`` inside
      ``torch.device(torch.cuda.current_device())``, which fails without a GPU: subclasses defaulting to CPU, as
      every other weight and table is built (``CPU_INIT``; Megatron moves the rotary tables to the GPU at first use).
    """
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer import multi_latent_attention as mla

    if getattr(mla, "_megatron_rl_patched", False):
        return
    mla.HAVE_TE = False

    class DuplicatedLinear(Linear):  # (without TE, 0.19's MLA module binds the name Linear to None)
        """Megatron's plain (TP-replicated) ``Linear``, initialised with the config's init method like
        Megatron's parallel linears (its base keeps torch's default init). MLA accepts it under the name
        ``Linear``; its weight is tagged ``sequence_parallel``, so under SP its grad is summed over TP."""

        def __init__(self, input_size, output_size, *, config, init_method, **kwargs):
            super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
            if config.perform_initialization:
                with torch.no_grad():
                    init_method(self.weight)

    mla.Linear = DuplicatedLinear
    for name in ("RotaryEmbedding", "YarnRotaryEmbedding"):
        base = getattr(mla, name)

        def __init__(self, *args, _base=base, **kwargs):
            kwargs.setdefault("use_cpu_initialization", True)
            _base.__init__(self, *args, **kwargs)

        setattr(mla, name, type(name, (base,), {"__init__": __init__}))
    mla._megatron_rl_patched = True


def layer_spec(shape: ModelShape, config, *, vp_stage: Optional[int] = None, transformer_engine: Optional[bool] = None,
               attention: str = "unfused"):
    """Decoder block spec: Transformer Engine layers when ``transformer_engine`` (default: when TE is usable),
    Megatron's local spec otherwise.

    Under sequence parallelism the local spec's torch norms (which refuse it) become ``SequenceParallelTorchNorm``:
    the input, pre-MLP, QK and final norms, their weights tagged for the TP all-reduce of their grads. Under
    context parallelism the local core attention (which refuses it) becomes ``CPDotProductAttention``; with
    Transformer Engine, TE's own CP attention runs. ``attention="flash"`` makes the local core attention torch's
    scaled_dot_product_attention (``SDPADotProductAttention``, at cp > 1 ``SDPACPAttention``); TE layers take
    the kernel from ``config.attention_backend``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = have_transformer_engine() if transformer_engine is None else transformer_engine
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                      normalization=shape.normalization, vp_stage=vp_stage)
    if config.moe_grouped_gemm and not use_te:  # Megatron's local spec has sequential experts only
        from megatron_rl.models.grouped_linear import with_torch_grouped_experts

        spec = with_torch_grouped_experts(spec)
    if use_te:
        return spec
    if config.sequence_parallel:
        from megatron_rl.models.norms import sequence_parallel_spec

        spec = sequence_parallel_spec(spec)
    if config.multi_latent_attention:
        return local_mla_spec(spec, flash=attention == "flash", q_compressed=config.q_lora_rank is not None)
    from megatron_rl.models.cp_attention import CPDotProductAttention, with_cp_core_attention
    from megatron_rl.models.sdpa_attention import SDPACPAttention, SDPADotProductAttention

    if config.context_parallel_size > 1:
        return with_cp_core_attention(spec, SDPACPAttention if attention == "flash" else CPDotProductAttention)
    if attention == "flash":
        return with_cp_core_attention(spec, SDPADotProductAttention)
    return spec


def local_mla_spec(spec, *, flash: bool = False, q_compressed: bool = True):
    """A copy of a local-spec block spec whose MLA layers run without Transformer Engine.

    * core attention: ``mla_core_attention(flash)`` (the local kernel, or SDPA with ``flash``, accepting MLA's
      k/v widths);
    * the down projections (q_down, kv_down) are replicated over TP, as TE's spec makes them ("duplicated"),
      instead of column-parallel: in 0.16.1's column-parallel branch each TP rank drops the other ranks' heads'
      gradient of the shared rope key (split backward of ``gather_from_tensor_model_parallel_region``), so
      TP > 1 trained differently from TP = 1;
    * without a compressed query (``q_compressed`` False: no q_lora_rank), no query norm, which Megatron refuses
      then (it would normalise nothing).
    """
    import copy

    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_rl.models.norms import swap_norms

    _mla_without_te()
    spec = swap_norms(copy.deepcopy(spec), DotProductAttention, mla_core_attention(flash))
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if isinstance(attention, mla.MLASelfAttentionSubmodules):
            attention.linear_q_down_proj = attention.linear_kv_down_proj = mla.Linear
            if not q_compressed:
                attention.q_layernorm = attention.linear_q_up_proj = IdentityOp
                layer.submodules.self_attention.module = _uncompressed_query_mla()
    return spec


@functools.lru_cache(maxsize=None)
def _uncompressed_query_mla():
    """Megatron's ``MLASelfAttention`` building the modules its spec names. Its norm resolver
    (``mla_qk_norm_config``) gives a model with latent norms but no compressed query (DeepSeek-V2-Lite) a norm on
    the query projection's input, fused into Transformer Engine's projection, and refuses the plain projection;
    that model has no such norm."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class UncompressedQueryMLA(MLASelfAttention):
        def _resolve_qk_norm_config(self, submodules):
            return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=submodules.linear_q_up_proj,
                        linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=submodules.q_layernorm,
                        kv_layernorm=submodules.kv_layernorm)

    return UncompressedQueryMLA


@functools.lru_cache(maxsize=None)
def mla_core_attention(flash: bool = False):
    """Megatron's local ``DotProductAttention`` (with ``flash``: ``SDPADotProductAttention``) for MLA: MLA passes
    ``k_channels`` (nope + rope head dim) and ``v_channels``, which only TE's attention accepts; the local kernel
    already takes the key width from the tensors and the value width from ``kv_channels`` (= v_head_dim here),
    so the two are checked and dropped."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_rl.models.sdpa_attention import SDPADotProductAttention

    base = SDPADotProductAttention if flash else DotProductAttention

    class MLADotProductAttention(base):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
            if v_channels is not None and v_channels != config.kv_channels:
                raise ValueError(f"MLA v_channels {v_channels} != kv_channels {config.kv_channels}")
            super().__init__(config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             cp_comm_type=cp_comm_type, pg_collection=pg_collection)

    return MLADotProductAttention


def expert_seed(seed: int, layer: int, expert: int) -> int:
    """Seed of routed expert ``expert`` (global index) of global layer ``layer``: distinct from the per-layer seeds
    ``seed * 1000 + layer`` of ``layout_invariant_init`` (all below (seed + 1) * 1000) and from each other."""
    return (seed * 1000 + layer) * 100_003 + 1 + expert


@contextlib.contextmanager
def layout_invariant_init(seed: int):
    """Seed the CPU RNG before the embedding and before every decoder layer by its GLOBAL layer number, and before
    every routed expert by its GLOBAL expert index.

    Megatron initialises weights on the CPU from the global RNG in construction order, so a pipeline stage
    that starts at layer k would otherwise draw different weights than a single stage does. With a seed per
    layer (and the output layer drawn right after the last layer), the weights do not depend on pp/vpp;
    tensor parallelism already splits one CPU-drawn master weight.

    Expert parallelism: each EP rank builds only its own experts (``SequentialMLP``: global experts
    ep_rank * n_local ... + n_local - 1), so without more, expert 0 of EP rank 1 would draw what expert 0 of
    EP rank 0 draws, and the ranks would consume different amounts of the layer's stream (changing the output
    layer). So every expert MLP draws from its own seed ``expert_seed(seed, layer, global_expert)``, and the
    layer's stream is restored after the experts, as if they drew nothing from it. Not covered: grouped-GEMM
    experts (``moe_grouped_gemm``: each rank draws its own shards). Weights are drawn on the CPU on every device
    (``CPU_INIT``).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
    from megatron.core.utils import get_pg_rank

    originals = (TransformerLayer.__init__, SequentialMLP.__init__, MLP.__init__)
    building = {}  # the global layer being built; while its experts are built, the next expert's global index

    def seeded_init(self, config, submodules, layer_number=1, *args, **kwargs):
        vp_stage = kwargs.get("vp_stage")
        offset = get_transformer_layer_offset(config, vp_stage, parallel_state.get_pipeline_model_parallel_rank())
        building["layer"] = layer_number + offset
        torch.manual_seed(seed * 1000 + layer_number + offset)
        originals[0](self, config, submodules, layer_number, *args, **kwargs)

    def seeded_experts_init(self, num_local_experts, config, *args, **kwargs):
        # MoELayer's process groups (its ep group also gives MoELayer.local_expert_indices)
        pg_collection = kwargs.get("pg_collection", args[1] if len(args) > 1 else None)
        ep_rank = (get_pg_rank(pg_collection.ep) if pg_collection is not None
                   else parallel_state.get_expert_model_parallel_rank())
        stream = torch.get_rng_state()
        building["expert"] = ep_rank * num_local_experts
        try:
            originals[1](self, num_local_experts, config, *args, **kwargs)
        finally:
            building.pop("expert", None)
            torch.set_rng_state(stream)

    def seeded_mlp_init(self, config, submodules, *args, **kwargs):
        if kwargs.get("is_expert", args[0] if args else False) and "expert" in building:
            torch.manual_seed(expert_seed(seed, building.get("layer", 0), building["expert"]))
            building["expert"] += 1
        originals[2](self, config, submodules, *args, **kwargs)

    TransformerLayer.__init__ = seeded_init
    SequentialMLP.__init__ = seeded_experts_init
    MLP.__init__ = seeded_mlp_init
    torch.manual_seed(seed * 1000)
    try:
        yield
    finally:
        TransformerLayer.__init__, SequentialMLP.__init__, MLP.__init__ = originals
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
            config=config, transformer_layer_spec=layer_spec(shape, config, vp_stage=vp_stage,
                                                             transformer_engine=opts.transformer_engine,
                                                             attention=opts.core_attention),
            vocab_size=padded_vocab_size(shape.vocab_size, opts.dims.tp),
            max_sequence_length=shape.max_position_embeddings,
            pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=shape.tie_embeddings if tie_embeddings is None else tie_embeddings,
            position_embedding_type=shape.position_embedding_type, rotary_base=int(shape.rotary_base),
            rope_scaling=rope_scaling.get("rope_type") == "llama3",
            rope_scaling_factor=float(rope_scaling.get("factor", 8.0)),
            vp_stage=vp_stage)
    if opts.lora is not None:
        from megatron_rl.models.lora import add_adapters

        add_adapters(model, opts.lora, seed=opts.init_seed)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def check_built_split(chunks: list, shape: ModelShape, dims: ParallelDims) -> None:
    """Megatron built, on each of this rank's virtual stages, the decoder layers the planner and the launch check
    counted there (``ParallelDims.stage_layers``: one reading of the split for both)."""
    from megatron.core import parallel_state

    rank = parallel_state.get_pipeline_model_parallel_rank()
    planned = dims.stage_layers(shape.num_layers)[rank::dims.pp]
    built = tuple(len(chunk.decoder.layers) for chunk in chunks)
    if built != planned:
        raise RuntimeError(f"pipeline rank {rank} built {built} decoder layers per virtual stage where the split "
                           f"{dims.split()} gives {planned}")


def build_model_chunks(shape: ModelShape, opts: ModelOptions) -> list:
    """All model chunks this rank holds: one, or vpp of them with interleaved pipelining."""
    chunks = [build_gpt_model(shape, opts, vp_stage=i) for i in range(opts.dims.vpp)] if opts.dims.vpp > 1 \
        else [build_gpt_model(shape, opts)]
    check_built_split(chunks, shape, opts.dims)
    if opts.router_replay and shape.is_moe:
        from megatron_rl.models.router_replay import install

        install(chunks)
    return chunks
