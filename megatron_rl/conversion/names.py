"""Which tensor is which: Megatron Core checkpoint keys <-> Hugging Face names, shapes and fusions (pure Python).

No torch here, so the CLI can check an input folder (names, shapes, config) in a second, before it starts any
process. The tensor arithmetic behind each fusion lives in ``mapping.py``.

A Megatron tensor is named by a ``MegatronRef``: the canonical key suffix (``self_attention.linear_qkv.weight``),
the decoder layer and, for routed experts, the expert. A checkpoint may store it under one of several keys
(TE vs local layer names, layers stacked on a leading axis or one key per layer, experts stacked or one key per
expert); ``parse_megatron_key`` folds them all to the same ref, and ``refs_in_stored_tensor`` lists the refs one
stored tensor holds.

Each ``TensorMap`` ties one Megatron ref to the Hugging Face tensors it is made of:

==========  =====================================================  ============================================
kind        Megatron (global, TP/EP/PP-free)                       Hugging Face
==========  =====================================================  ============================================
copy        same tensor                                            same tensor
vocab       [padded_vocab, hidden], rows >= vocab are padding      [vocab, hidden]
qkv         rows interleaved per query group: [q_g; k_g; v_g]...   q_proj, k_proj, v_proj (weight or bias)
gate_up     [gate; up] on dim 0 (a TP shard holds [gate_i; up_i])  gate_proj, up_proj (Mixtral: w1, w3)
==========  =====================================================  ============================================

DeepSeek-V3 (MLA) needs no new kind: every MLA and routing tensor is a plain copy (q_a_proj -> linear_q_down_proj,
q_a_layernorm -> q_layernorm, q_b_proj -> linear_q_up_proj (q_proj -> linear_q_proj without q-LoRA),
kv_a_proj_with_mqa -> linear_kv_down_proj, kv_a_layernorm -> kv_layernorm, kv_b_proj -> linear_kv_up_proj,
gate.e_score_correction_bias -> router.expert_bias) and the shared expert is a gate_up. Rotary rows need no
permutation: DeepSeek lays each head's rope dims out in interleaved pairs, transformers (``rope_interleave``) and
Megatron's MLA (``multi_latent_attention`` in ``apply_rotary_pos_emb``) both de-interleave them the same way
(x[0::2], x[1::2]) before rotating halves, and the rope part is the last qk_rope_head_dim rows of kv_a_proj_with_mqa
and of each q head in both. Multi-token-prediction layers (``model.layers.{num_hidden_layers}...``) are not mapped:
the importer drops them with a note.

Check it: ``.venv/bin/python -m pytest tests/test_conversion_mapping.py -q``.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape, shape_from_hf_config

# HF architectures this converter maps (causal LM); the sequence-classification twin is used for reward models.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
CLASSIFICATION_ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaForSequenceClassification", "MistralForCausalLM": "MistralForSequenceClassification",
    "Qwen2ForCausalLM": "Qwen2ForSequenceClassification", "Qwen3ForCausalLM": "Qwen3ForSequenceClassification",
    "Qwen3MoeForCausalLM": "Qwen3MoeForSequenceClassification",
    "MixtralForCausalLM": "MixtralForSequenceClassification",
    "DeepseekV3ForCausalLM": "DeepseekV3ForSequenceClassification",
}
VALUE_HEAD_ARCHITECTURES = {causal: classify.replace("SequenceClassification", "TokenClassification")
                            for causal, classify in CLASSIFICATION_ARCHITECTURES.items()}
"""A PPO critic's export: the same weights as a reward model's (``model.*``, ``score.weight``), a value per token."""
FAMILY_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                     "mixtral": "mixtral", "deepseek_v3": "deepseek_v3"}
FAMILY_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                       "deepseek_v3": "DeepseekV3ForCausalLM"}
SUPPORTED_ROPE_TYPES = (None, "default", "llama3")
MLA_ROPE_TYPES = (None, "default", "yarn")


def layout_world_size(tp: int, pp: int, ep: int) -> int:
    """Processes a conversion at (tp, pp, ep) runs on: experts stay whole per rank (expert TP 1), so the world
    must hold tp*pp and ep*pp ranks; data parallel size is 1 for dense models."""
    return pp * math.lcm(tp, ep)


def conversion_dims(shape: ModelShape, tp: int, pp: int, ep: int):
    """The ``ParallelDims`` a conversion builds at (tp, pp, ep): experts whole per rank (etp 1), sequence
    parallelism where Megatron needs it (MoE or MLA at tp > 1), and an uneven pipeline split chosen like the
    trainers' (``ParallelDims.with_split``) when pp does not divide the layers (61 layers on pp 2: 31 + 30)."""
    from megatron_rl.spec.parallel import ParallelDims, split_error

    dims = ParallelDims(world_size=layout_world_size(tp, pp, ep), tp=tp, pp=pp, ep=ep, etp=1,
                        sp=(shape.is_moe or shape.is_mla) and tp > 1).with_split(shape.num_layers)
    why = split_error(shape.num_layers, pp, 1, *dims.split())
    if why is not None:
        raise ConfigError(f"--pp {pp} cannot split the {shape.num_layers} layers: {why}")
    return dims


def supported_text() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


# ----- Megatron side -----
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
INPUT_NORM = "self_attention.linear_qkv.layer_norm_weight"
QKV = "self_attention.linear_qkv.weight"
QKV_BIAS = "self_attention.linear_qkv.bias"
Q_NORM = "self_attention.q_layernorm.weight"
K_NORM = "self_attention.k_layernorm.weight"
PROJ = "self_attention.linear_proj.weight"
MLP_NORM = "mlp.linear_fc1.layer_norm_weight"
# multi-latent attention (DeepSeek-V3); the latent norms under their local-spec names
Q_PROJ = "self_attention.linear_q_proj.weight"
Q_DOWN = "self_attention.linear_q_down_proj.weight"
Q_UP = "self_attention.linear_q_up_proj.weight"
KV_DOWN = "self_attention.linear_kv_down_proj.weight"
KV_UP = "self_attention.linear_kv_up_proj.weight"
KV_NORM = "self_attention.kv_layernorm.weight"
EXPERT_BIAS = "mlp.router.expert_bias"
SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
SHARED_FC2 = "mlp.shared_experts.linear_fc2.weight"
FC1 = "mlp.linear_fc1.weight"
FC2 = "mlp.linear_fc2.weight"
ROUTER = "mlp.router.weight"
EXPERT_FC1 = "mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.experts.linear_fc2.weight"
REWARD_HEAD_WEIGHT = "rm_head.weight"
REWARD_HEAD_BIAS = "rm_head.bias"

# LoRA adapters (megatron_rl/models/lora.py) of the dense decoder linears: <linear>.lora.A [r, in], .lora.B [out, r]
LORA_TARGET_WEIGHTS = {"linear_qkv": QKV, "linear_proj": PROJ, "linear_fc1": FC1, "linear_fc2": FC2}
LORA_SUFFIXES = (".lora.A", ".lora.B")


def is_adapter_ref(ref: "MegatronRef") -> bool:
    return ref.name.endswith(LORA_SUFFIXES)


def adapter_refs(ref: "MegatronRef") -> tuple["MegatronRef", "MegatronRef"]:
    """(A, B) refs of the adapter of base weight ``ref`` (``....linear_qkv.weight``)."""
    stem = ref.name.removesuffix(".weight")
    return tuple(MegatronRef(stem + suffix, ref.layer, ref.expert) for suffix in LORA_SUFFIXES)


# Local-spec (pure torch) names and other spellings of the same tensor.
LAYER_ALIASES = {
    "input_layernorm.weight": INPUT_NORM,
    "pre_mlp_layernorm.weight": MLP_NORM,
    "self_attention.linear_q_up_proj.layer_norm_weight": Q_NORM,  # TE fuses MLA's latent norms into the up-projs
    "self_attention.linear_kv_up_proj.layer_norm_weight": KV_NORM,
}
TOP_ALIASES = {
    "reward_head.weight": REWARD_HEAD_WEIGHT, "reward_head.bias": REWARD_HEAD_BIAS,
    "value_head.weight": REWARD_HEAD_WEIGHT, "value_head.bias": REWARD_HEAD_BIAS,
}
LAYERS_PREFIX = "decoder.layers."
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
STACKED_EXPERTS_PREFIX = "mlp.experts.experts."
# Checkpoint keys that are not model weights (optimizer state, RNG, Transformer Engine extra state).
NON_MODEL_PREFIXES = ("optimizer.", "rng_state", "scheduler")


@dataclass(frozen=True, order=True)
class MegatronRef:
    """One Megatron tensor, independent of how the checkpoint stored it."""

    name: str
    """Canonical key: a top-level key, or the suffix after ``decoder.layers.N.`` for a layer tensor."""
    layer: Optional[int] = None
    """Decoder layer (global index), None for top-level tensors."""
    expert: Optional[int] = None
    """Routed expert (global index), None otherwise."""

    def __str__(self) -> str:
        if self.layer is None:
            return self.name
        where = f"layer {self.layer}" + (f" expert {self.expert}" if self.expert is not None else "")
        return f"{self.name} ({where})"


_CHAINED_OPTIMIZER = re.compile(r"^chained_\d+\.optimizer\.")  # MoE runs: one optimizer per param group


def is_model_key(key: str) -> bool:
    return (not key.startswith(NON_MODEL_PREFIXES) and "_extra_state" not in key
            and not _CHAINED_OPTIMIZER.match(key))


def _layer_suffix(key: str) -> tuple[bool, str]:
    """(layer index is an axis of the stored tensor, rest of the key after the layer)."""
    rest = key[len(LAYERS_PREFIX):]
    head, _, tail = rest.partition(".")
    if head.isdigit():
        return False, tail
    return True, rest


def stored_prepend_axes(key: str) -> int:
    """How many leading axes of a stored tensor index layers/experts rather than the weight itself."""
    if not key.startswith(LAYERS_PREFIX):
        return 0
    stacked_layers, rest = _layer_suffix(key)
    return int(stacked_layers) + int(rest.startswith(STACKED_EXPERTS_PREFIX))


def parse_megatron_key(key: str, prepend: tuple[int, ...] = ()) -> MegatronRef:
    """The ref of a stored key; ``prepend`` holds the indices along its layer/expert axes (if any)."""
    prepend_left = list(prepend)
    if not key.startswith(LAYERS_PREFIX):
        return MegatronRef(TOP_ALIASES.get(key, key))
    stacked_layers, rest = _layer_suffix(key)
    layer = prepend_left.pop(0) if stacked_layers else int(key[len(LAYERS_PREFIX):].split(".", 1)[0])
    expert = None
    match = _LOCAL_EXPERT.match(rest)
    if match:
        expert, rest = int(match.group(1)), STACKED_EXPERTS_PREFIX + match.group(2)
    elif rest.startswith(STACKED_EXPERTS_PREFIX):
        expert = prepend_left.pop(0)
    return MegatronRef(LAYER_ALIASES.get(rest, rest), layer, expert)


def refs_in_stored_tensor(key: str, size: tuple[int, ...]) -> Iterator[tuple[MegatronRef, tuple[int, ...]]]:
    """Every (ref, indices along the leading layer/expert axes) that one stored tensor of global ``size`` holds."""
    n = stored_prepend_axes(key)
    if len(size) < n:
        raise ConfigError(f"checkpoint tensor {key} has shape {list(size)}, too few axes for its layer/expert index")
    for index in itertools.product(*(range(s) for s in size[:n])):
        yield parse_megatron_key(key, index), index


# ----- Hugging Face config -----
def with_architecture(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with ``architectures`` taken from ``model_type`` when it is null or missing (transformers reads
    model_type then): both directions of the converter read the architecture from it."""
    if not cfg.get("architectures") and cfg.get("model_type") in FAMILY_MODEL_TYPE:
        return {**cfg, "architectures": [FAMILY_ARCHITECTURE[cfg["model_type"]]]}
    return cfg


def normalize_hf_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Fold transformers-5 spellings (``rope_parameters``, ``num_local_experts`` for Qwen3-MoE) into the classic
    keys that ``megatron_rl.spec.model_shape`` reads, and reject what the Megatron model cannot reproduce."""
    from megatron_rl.spec.model_shape import fold_transformers5_keys

    cfg = with_architecture(fold_transformers5_keys(cfg))
    arch = (cfg.get("architectures") or [None])[0]
    if arch in CLASSIFICATION_ARCHITECTURES.values():
        arch = next(k for k, v in CLASSIFICATION_ARCHITECTURES.items() if v == arch)
        cfg["architectures"] = [arch]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{source}: unsupported architecture {arch or cfg.get('model_type')!r}; "
                          f"supported: {supported_text()}")
    scaling = cfg.get("rope_scaling")
    rope_type = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if arch == "DeepseekV3ForCausalLM":
        _check_deepseek_v3(cfg, rope_type, source)
    elif rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: rope_scaling type {rope_type!r} is not supported by the Megatron model; "
                          f"supported: default, llama3")
    if rope_type == "llama3":
        fixed = {"low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}
        odd = {k: scaling.get(k) for k, v in fixed.items() if scaling.get(k, v) != v}
        if odd:
            raise ConfigError(f"{source}: llama3 rope_scaling with {odd} is not supported: Megatron's RoPE uses "
                              f"{fixed} (only the factor is configurable)")
    quant = cfg.get("quantization_config")
    if quant and (quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3"
                  or len(quant.get("weight_block_size") or ()) != 2):
        raise ConfigError(f"{source}: quantization_config {quant} is not supported; only FP8 (e4m3) block-quantized "
                          "weights (quant_method fp8 with weight_block_size, as DeepSeek-V3 and Kimi-K2 ship them) "
                          "are dequantized at import")
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) and window < int(cfg.get("max_position_embeddings", 0) or 0):
        raise ConfigError(f"{source}: sliding-window attention (sliding_window={window}) is not supported by the "
                          "Megatron model; only full causal attention converts exactly")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported (Megatron's gated MLP has no bias here)")
    if arch in ("LlamaForCausalLM", "MistralForCausalLM") and cfg.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias=true on a Llama model (o_proj bias) is not supported")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act {cfg.get('hidden_act')!r} is not supported; use silu")
    return cfg


def _check_deepseek_v3(cfg: dict[str, Any], rope_type: Optional[str], source: str) -> None:
    """What transformers' DeepseekV3ForCausalLM computes that the Megatron model would compute differently."""
    def refuse(what: str) -> None:
        raise ConfigError(f"{source}: DeepseekV3 with {what} is not supported by the Megatron model")

    if rope_type not in MLA_ROPE_TYPES:
        refuse(f"rope_scaling type {rope_type!r} (supported: default, yarn)")
    if cfg.get("rope_interleave", True) is False:
        refuse("rope_interleave=false (Megatron's MLA de-interleaves the rope dims like DeepSeek's weights)")
    if rope_type == "yarn":
        scaling = cfg["rope_scaling"]
        if scaling.get("attention_factor") is not None:
            refuse("an explicit yarn attention_factor")
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if not (mscale and mscale_all) and (mscale not in (None, 1, 1.0) or mscale_all):
            refuse(f"yarn mscale={mscale} without mscale_all_dim={mscale_all} (transformers then ignores both)")
    if cfg.get("attention_bias"):
        refuse("attention_bias=true")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse(f"scoring_func={cfg.get('scoring_func')!r} / topk_method={cfg.get('topk_method')!r} (transformers "
               "always routes by sigmoid scores plus e_score_correction_bias: sigmoid / noaux_tc)")
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
        refuse("moe_layer_freq != 1 (transformers ignores it: every layer from first_k_dense_replace on is MoE)")
    topk, groups, group_topk = (int(cfg.get(k) or 0) for k in ("num_experts_per_tok", "n_group", "topk_group"))
    if topk > 1 and not cfg.get("norm_topk_prob", True):
        refuse("norm_topk_prob=false (Megatron always renormalises sigmoid top-k weights)")
    if groups > 1 and group_topk < groups and topk // max(group_topk, 1) != 2:
        refuse(f"num_experts_per_tok={topk}, topk_group={group_topk}: transformers scores a group by its top-2 "
               f"experts, Megatron by its top num_experts_per_tok/topk_group={topk // max(group_topk, 1)}")


def mtp_hf_prefixes(shape: ModelShape) -> tuple[str, ...]:
    """HF name prefixes of the multi-token-prediction layers that follow the decoder layers (dropped at import)."""
    return tuple(f"model.layers.{shape.num_layers + i}." for i in range(shape.mtp_num_layers))


def shape_from_config(cfg: dict[str, Any], source: str, name: str = "model") -> ModelShape:
    """ModelShape of an HF config.json dict (normalized first)."""
    return shape_from_hf_config(normalize_hf_config(cfg, source), name=name, source=source)


def hf_config_from_shape(shape: ModelShape) -> dict[str, Any]:
    """A minimal HF config.json for a shape that came from a preset or YAML (no HF config recorded)."""
    if shape.family not in FAMILY_MODEL_TYPE:
        raise ConfigError(f"model family {shape.family!r} cannot be exported to Hugging Face; "
                          f"supported: {supported_text()}")
    cfg: dict[str, Any] = {
        "architectures": [shape.hf_architecture if shape.hf_architecture in SUPPORTED_ARCHITECTURES
                          else FAMILY_ARCHITECTURE[shape.family]],
        "model_type": FAMILY_MODEL_TYPE[shape.family],
        "hidden_size": shape.hidden_size, "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups, "head_dim": shape.kv_channels,
        "vocab_size": shape.vocab_size, "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_epsilon, "rope_theta": shape.rotary_base, "hidden_act": "silu",
        "tie_word_embeddings": shape.tie_embeddings, "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_cache": True,
    }
    if shape.rope_scaling:
        cfg["rope_scaling"] = dict(shape.rope_scaling)
    if shape.family in ("llama", "qwen3", "qwen3_moe"):
        cfg["attention_bias"] = shape.add_qkv_bias
    if shape.family == "qwen3_moe":
        cfg.update(num_experts=shape.num_experts, num_experts_per_tok=shape.moe_router_topk,
                   moe_intermediate_size=shape.moe_ffn_hidden_size, norm_topk_prob=shape.moe_norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(shape.moe_layers) if not moe])
    if shape.family == "deepseek_v3":
        cfg.update(_deepseek_v3_config(shape))
    if shape.family == "mixtral":
        if not all(shape.moe_layers) or shape.moe_ffn_hidden_size != shape.ffn_hidden_size:
            raise ConfigError("a Mixtral export needs every layer MoE with moe_ffn_hidden_size == ffn_hidden_size")
        cfg.update(num_local_experts=shape.num_experts, num_experts_per_tok=shape.moe_router_topk)
    return cfg


def _deepseek_v3_config(shape: ModelShape) -> dict[str, Any]:
    """The DeepseekV3Config fields of a shape (a preset's export); MTP layers are not exported."""
    dense = shape.moe_layers.index(True) if shape.moe_layers else shape.num_layers
    if shape.moe_layers and not all(shape.moe_layers[dense:]):
        raise ConfigError(f"{shape.name}: a DeepseekV3 export needs MoE in every layer after the first dense ones")
    if shape.num_experts and shape.moe_shared_expert_intermediate_size % shape.moe_ffn_hidden_size:
        raise ConfigError(f"{shape.name}: shared expert size must be a multiple of moe_ffn_hidden_size")
    cfg: dict[str, Any] = dict(
        q_lora_rank=shape.q_lora_rank or None, kv_lora_rank=shape.kv_lora_rank,
        qk_nope_head_dim=shape.qk_nope_head_dim, qk_rope_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim, head_dim=shape.qk_rope_head_dim, rope_interleave=True,
        first_k_dense_replace=dense, n_routed_experts=shape.num_experts or None,
        n_shared_experts=shape.moe_shared_expert_intermediate_size // max(shape.moe_ffn_hidden_size, 1),
        moe_intermediate_size=shape.moe_ffn_hidden_size, num_experts_per_tok=shape.moe_router_topk,
        n_group=max(shape.moe_router_num_groups, 1), topk_group=shape.moe_router_group_topk or 1,
        routed_scaling_factor=shape.moe_router_topk_scaling_factor, norm_topk_prob=shape.moe_norm_topk_prob,
        scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=0, attention_bias=False)
    return cfg


def check_convertible(shape: ModelShape, source: str) -> None:
    if shape.family not in FAMILY_MODEL_TYPE:
        raise ConfigError(f"{source}: family {shape.family!r} is not convertible; supported: {supported_text()}")
    if shape.family != "deepseek_v3" and (shape.moe_shared_expert_intermediate_size or shape.is_mla):
        raise ConfigError(f"{source}: shared experts and MLA convert only as DeepseekV3ForCausalLM")
    if shape.add_bias_linear or shape.normalization != "RMSNorm" or not shape.gated_linear_unit:
        raise ConfigError(f"{source}: only RMSNorm + SwiGLU models without linear biases are convertible")


# ----- the name map -----
@dataclass(frozen=True)
class TensorMap:
    """One Megatron tensor and the Hugging Face tensors it is made of."""

    ref: MegatronRef
    """The Megatron tensor."""
    hf: tuple[str, ...]
    """HF names, in fusion order (q, k, v / gate, up)."""
    kind: str
    """copy, vocab, qkv or gate_up (see the module docstring)."""
    hf_shapes: tuple[tuple[int, ...], ...]
    """Shape of each HF tensor."""

    @property
    def megatron_rows(self) -> int:
        """Rows of the global Megatron tensor, before vocab padding."""
        return sum(s[0] for s in self.hf_shapes)


def _expert_hf_names(shape: ModelShape, layer: int, expert: int) -> tuple[str, str, str]:
    if shape.family == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def router_hf_name(shape: ModelShape, layer: int) -> str:
    if shape.family == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe.gate.weight"
    return f"model.layers.{layer}.mlp.gate.weight"


def tensor_maps(shape: ModelShape, *, reward_head: bool = False) -> list[TensorMap]:
    """The full name map of ``shape``, in HF file order (embedding, layers, final norm, head)."""
    h, d = shape.hidden_size, shape.kv_channels
    n, g, f = shape.num_attention_heads, shape.num_query_groups, shape.ffn_hidden_size
    maps = [TensorMap(MegatronRef(EMBEDDING), ("model.embed_tokens.weight",), "vocab", ((shape.vocab_size, h),))]
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."

        def m(name, hf, kind, shapes, expert=None, layer=layer):
            maps.append(TensorMap(MegatronRef(name, layer, expert), hf, kind, shapes))

        m(INPUT_NORM, (p + "input_layernorm.weight",), "copy", ((h,),))
        if shape.is_mla:
            for ref_name, hf_name, hf_shape in _mla_tensors(shape):
                m(ref_name, (a + hf_name,), "copy", (hf_shape,))
        else:
            m(QKV, (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), "qkv",
              ((n * d, h), (g * d, h), (g * d, h)))
        if shape.add_qkv_bias:
            m(QKV_BIAS, (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), "qkv",
              ((n * d,), (g * d,), (g * d,)))
        if shape.qk_layernorm and not shape.is_mla:
            m(Q_NORM, (a + "q_norm.weight",), "copy", ((d,),))
            m(K_NORM, (a + "k_norm.weight",), "copy", ((d,),))
        m(PROJ, (a + "o_proj.weight",), "copy", ((h, n * d),))
        m(MLP_NORM, (p + "post_attention_layernorm.weight",), "copy", ((h,),))
        if shape.moe_layers and shape.moe_layers[layer]:
            e_f = shape.moe_ffn_hidden_size
            m(ROUTER, (router_hf_name(shape, layer),), "copy", ((shape.num_experts, h),))
            if shape.moe_router_enable_expert_bias:
                m(EXPERT_BIAS, (p + "mlp.gate.e_score_correction_bias",), "copy", ((shape.num_experts,),))
            shared = shape.moe_shared_expert_intermediate_size
            if shared:
                s_p = p + "mlp.shared_experts."
                m(SHARED_FC1, (s_p + "gate_proj.weight", s_p + "up_proj.weight"), "gate_up", ((shared, h),) * 2)
                m(SHARED_FC2, (s_p + "down_proj.weight",), "copy", ((h, shared),))
            for expert in range(shape.num_experts):
                gate, up, down = _expert_hf_names(shape, layer, expert)
                m(EXPERT_FC1, (gate, up), "gate_up", ((e_f, h), (e_f, h)), expert)
                m(EXPERT_FC2, (down,), "copy", ((h, e_f),), expert)
        else:
            m(FC1, (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "gate_up", ((f, h), (f, h)))
            m(FC2, (p + "mlp.down_proj.weight",), "copy", ((h, f),))
    maps.append(TensorMap(MegatronRef(FINAL_NORM), ("model.norm.weight",), "copy", ((h,),)))
    if reward_head:
        maps.append(TensorMap(MegatronRef(REWARD_HEAD_WEIGHT), ("score.weight",), "copy", ((1, h),)))
    elif not shape.tie_embeddings:
        maps.append(TensorMap(MegatronRef(OUTPUT), ("lm_head.weight",), "vocab", ((shape.vocab_size, h),)))
    return maps


def _mla_tensors(shape: ModelShape) -> list[tuple[str, str, tuple[int, ...]]]:
    """(Megatron ref name, HF name under self_attn., HF shape) of one MLA block (o_proj excluded)."""
    h, n, lora = shape.hidden_size, shape.num_attention_heads, shape.q_lora_rank
    qk, rope, kv = shape.qk_nope_head_dim + shape.qk_rope_head_dim, shape.qk_rope_head_dim, shape.kv_lora_rank
    if lora:
        q = [(Q_DOWN, "q_a_proj.weight", (lora, h)), (Q_NORM, "q_a_layernorm.weight", (lora,)),
             (Q_UP, "q_b_proj.weight", (n * qk, lora))]
    else:
        q = [(Q_PROJ, "q_proj.weight", (n * qk, h))]
    return q + [(KV_DOWN, "kv_a_proj_with_mqa.weight", (kv + rope, h)), (KV_NORM, "kv_a_layernorm.weight", (kv,)),
                (KV_UP, "kv_b_proj.weight", (n * (shape.qk_nope_head_dim + shape.v_head_dim), kv))]


def expected_hf_tensors(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape that a causal-LM checkpoint of ``shape`` holds."""
    return {name: hf_shape for tm in tensor_maps(shape) for name, hf_shape in zip(tm.hf, tm.hf_shapes, strict=True)}


def megatron_shape(tm: TensorMap, stored_rows: Optional[int] = None) -> tuple[int, ...]:
    """Expected global shape of the Megatron tensor (vocab rows are taken from the checkpoint)."""
    first = tm.hf_shapes[0]
    if tm.kind == "vocab":
        return (stored_rows if stored_rows is not None else first[0], *first[1:])
    if tm.kind == "copy":
        return first
    return (tm.megatron_rows, *first[1:])


def row_pieces(tm: TensorMap, shape: ModelShape, padded_rows: int) -> list[tuple[Optional[str], int, int]]:
    """The global Megatron tensor of ``tm`` as a stack of row blocks: (HF name or None for padding, first HF row,
    rows). Any row range of the Megatron tensor can be read from the HF files through these blocks."""
    if tm.kind == "copy":
        return [(tm.hf[0], 0, tm.hf_shapes[0][0] if tm.hf_shapes[0] else 1)]
    if tm.kind == "vocab":
        rows = tm.hf_shapes[0][0]
        return [(tm.hf[0], 0, rows)] + ([(None, 0, padded_rows - rows)] if padded_rows > rows else [])
    if tm.kind == "gate_up":
        return [(tm.hf[0], 0, tm.hf_shapes[0][0]), (tm.hf[1], 0, tm.hf_shapes[1][0])]
    if tm.kind == "qkv":
        d, groups = shape.kv_channels, shape.num_query_groups
        q_rows = shape.num_attention_heads // groups * d
        pieces = []
        for group in range(groups):
            pieces += [(tm.hf[0], group * q_rows, q_rows), (tm.hf[1], group * d, d), (tm.hf[2], group * d, d)]
        return pieces
    raise ValueError(f"unknown kind {tm.kind}")


def hf_row_sources(tm: TensorMap, shape: ModelShape, stored_rows: int) -> dict[str, list[tuple[int, int]]]:
    """For each HF tensor of ``tm``: the (first row, rows) blocks of the global Megatron tensor it is made of, in
    order (``stored_rows``: rows of the stored tensor, for plain copies). The inverse of ``row_pieces``."""
    if tm.kind == "copy":
        return {tm.hf[0]: [(0, stored_rows)]}
    if tm.kind == "vocab":
        return {tm.hf[0]: [(0, tm.hf_shapes[0][0])]}
    if tm.kind == "gate_up":
        gate_rows = tm.hf_shapes[0][0]
        return {tm.hf[0]: [(0, gate_rows)], tm.hf[1]: [(gate_rows, tm.hf_shapes[1][0])]}
    d, groups = shape.kv_channels, shape.num_query_groups
    q_rows = shape.num_attention_heads // groups * d
    block = q_rows + 2 * d
    return {tm.hf[0]: [(g * block, q_rows) for g in range(groups)],
            tm.hf[1]: [(g * block + q_rows, d) for g in range(groups)],
            tm.hf[2]: [(g * block + q_rows + d, d) for g in range(groups)]}
