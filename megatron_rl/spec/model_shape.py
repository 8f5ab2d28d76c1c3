"""Model shape: the architecture numbers every later stage (planner, runtime, conversion) reads.

A shape comes from one of three sources, all through ``load_model_shape(spec)``:

* a preset name under ``configs/models/`` (``llama-3.1-405b``, ``tiny-cpu``; case-insensitive);
* a Hugging Face ``config.json`` or the folder holding one (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral,
  DeepSeek-V3);
* a YAML file with Megatron-style fields (``num_layers, hidden_size, ffn_hidden_size, ...``; see ``YAML_KEYS``).

MoE layer placement is kept as ``moe_layers``: one bool per decoder layer (True = MoE MLP, False = dense MLP),
empty for dense models. It covers DeepSeek-V3's ``first_k_dense_replace``, Qwen3-MoE's ``decoder_sparse_step`` /
``mlp_only_layers`` and Megatron's ``moe_layer_freq`` (int or list). In YAML write ``moe_layer_freq`` (Megatron
semantics) and/or ``moe_first_dense_layers`` (the first k layers stay dense).

DeepSeek-V3 (``deepseek_v3``): MLA (``q_lora_rank`` 0 = no query compression, as V2-Lite; ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), routed + shared experts (``n_shared_experts`` x
``moe_intermediate_size``), ``first_k_dense_replace`` / ``moe_layer_freq``, sigmoid scoring with the ``noaux_tc``
expert-bias correction, ``n_group`` / ``topk_group``, ``routed_scaling_factor``, ``norm_topk_prob`` and yarn
``rope_scaling`` (``yarn_params()``). ``num_nextn_predict_layers`` is kept as ``mtp_num_layers`` but MTP layers are
not built: conversion drops them at import with a note.

Check it: ``.venv/bin/python -m pytest tests/test_model_shape.py -q``;
print one: ``.venv/bin/python -m megatron_rl.spec.model_shape llama-3.1-405b``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.spec.errors import ConfigError, did_you_mean
from megatron_rl.spec.resources import presets_dir

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gpt")
# Default training sequence length taken from an HF config when it gives none: long-context windows are
# reached by extension, not by pretraining at that length, so cap it.
HF_DEFAULT_SEQ_CAP = 8192


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Architecture of a decoder-only transformer, in Megatron-Core terms."""

    name: str
    """Human name (preset name, HF folder name or YAML stem)."""
    family: str
    """One of FAMILIES; decides conversion mapping and defaults."""
    num_layers: int
    """Decoder layers (excluding multi-token-prediction layers)."""
    hidden_size: int
    """Model width h."""
    ffn_hidden_size: int
    """Intermediate size of the dense MLP (dense layers of an MoE model too)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups); equal to num_attention_heads for MHA."""
    kv_channels: int
    """Per-head dimension (explicit in Qwen3, where it is not hidden/heads). For MLA: v_head_dim."""
    vocab_size: int
    """Vocabulary size (unpadded)."""
    seq_length: int
    """Default training sequence length."""
    max_position_embeddings: int
    """Longest position the model supports."""
    gated_linear_unit: bool = True
    """Gated MLP (SwiGLU: three matrices) instead of two."""
    activation: str = "silu"
    """MLP activation: silu (SwiGLU), gelu, squared_relu (Nemotron-4)."""
    normalization: str = "RMSNorm"
    """RMSNorm or LayerNorm."""
    norm_epsilon: float = 1e-5
    """Normalization epsilon."""
    position_embedding_type: str = "rope"
    """rope or learned_absolute."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    """HF rope_scaling block (llama3, yarn) kept verbatim."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection (Qwen2)."""
    add_bias_linear: bool = False
    """Bias on every linear layer (classic GPT)."""
    qk_layernorm: bool = False
    """RMSNorm on queries and keys per head (Qwen3)."""
    tie_embeddings: bool = False
    """Output layer shares the input embedding matrix."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 = dense model."""
    moe_router_topk: int = 0
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """Intermediate size of one routed expert."""
    moe_shared_expert_intermediate_size: int = 0
    """Total intermediate size of the always-on shared expert(s); 0 = none."""
    moe_layers: tuple[bool, ...] = ()
    """Per decoder layer: True = MoE MLP, False = dense MLP. Empty for dense models."""
    moe_norm_topk_prob: bool = False
    """Renormalize the top-k routing weights to sum to 1 (Mixtral, Qwen3-MoE with norm_topk_prob, DeepSeek-V3)."""
    moe_router_score_function: str = "softmax"
    """Router scoring: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)."""
    moe_router_enable_expert_bias: bool = False
    """Per-expert bias added to the scores for expert choice only (DeepSeek-V3 topk_method noaux_tc, HF
    mlp.gate.e_score_correction_bias; Megatron router.expert_bias). Whether RL updates it is the run's
    model.moe_expert_bias_update, not part of the shape."""
    moe_router_num_groups: int = 0
    """Group-limited routing: experts are split into this many groups (DeepSeek-V3 n_group); 0 or 1 = off."""
    moe_router_group_topk: int = 0
    """Groups each token may route into (DeepSeek-V3 topk_group); 0 = off."""
    moe_router_topk_scaling_factor: float = 1.0
    """Routing weights are multiplied by this after normalisation (DeepSeek-V3 routed_scaling_factor 2.5)."""
    q_lora_rank: int = 0
    """MLA query low-rank dimension; 0 = no query compression (q_lora_rank null, as DeepSeek-V2-Lite: one q_proj)."""
    kv_lora_rank: int = 0
    """MLA compressed KV dimension; 0 = not MLA."""
    qk_nope_head_dim: int = 0
    """MLA per-head query/key dimension without RoPE."""
    qk_rope_head_dim: int = 0
    """MLA per-head query/key RoPE dimension."""
    v_head_dim: int = 0
    """MLA per-head value dimension."""
    hidden_dropout: float = 0.0
    """Dropout on the residual branches (classic GPT: 0.1); its masks cost activation memory."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (classic GPT: 0.1); stored as a mask only with unfused attention."""
    mtp_num_layers: int = 0
    """Multi-token-prediction layers (DeepSeek-V3: 1); not counted in num_params(). Not built: conversion drops
    their weights at import (with a note) and exports none."""
    hf_architecture: str | None = None
    """HF architectures[0], e.g. LlamaForCausalLM, kept for export."""

    # ----- derived -----
    @property
    def head_dim(self) -> int:
        """Per-head dimension (kv_channels)."""
        return self.kv_channels

    @property
    def is_moe(self) -> bool:
        """Whether any layer has routed experts."""
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def rope_type(self) -> str:
        """RoPE variant: default, llama3 or yarn (HF rope_scaling ``rope_type``, or its older spelling ``type``)."""
        scaling = self.rope_scaling or {}
        return str(scaling.get("rope_type", scaling.get("type")) or "default")

    def yarn_params(self) -> dict[str, float]:
        """YaRN RoPE parameters with HF's defaults filled in (factor, original_max_position_embeddings, beta_fast,
        beta_slow, mscale, mscale_all_dim); only for rope_type yarn."""
        scaling = self.rope_scaling or {}
        if self.rope_type != "yarn":
            raise ValueError(f"{self.name}: rope_type is {self.rope_type}, not yarn")
        original = scaling.get("original_max_position_embeddings")
        factor = scaling.get("factor")
        if factor is None:  # transformers derives it from the context extension
            factor = self.max_position_embeddings / float(original)
        return {"factor": float(factor), "original_max_position_embeddings": int(original),
                "beta_fast": float(scaling.get("beta_fast") or 32), "beta_slow": float(scaling.get("beta_slow") or 1),
                "mscale": float(scaling.get("mscale") or 1.0),
                "mscale_all_dim": float(scaling.get("mscale_all_dim") or 0.0)}

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers with an MoE MLP."""
        return sum(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        """Decoder layers with a dense MLP."""
        return self.num_layers - self.num_moe_layers

    def attention_params(self) -> int:
        """Parameters of one attention block, its input norm included."""
        h = self.hidden_size
        norm = h * (2 if self.normalization == "LayerNorm" else 1)
        if self.is_mla:
            n, qk = self.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk) if self.q_lora_rank else h * n * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            return norm + q + kv + n * self.v_head_dim * h
        d, n, g = self.kv_channels, self.num_attention_heads, self.num_query_groups
        params = h * (n + 2 * g) * d + n * d * h + norm
        if self.add_qkv_bias or self.add_bias_linear:
            params += (n + 2 * g) * d
        if self.add_bias_linear:
            params += h
        if self.qk_layernorm:
            params += 2 * d
        return params

    def _mlp_params(self, ffn: int) -> int:
        matrices = 3 if self.gated_linear_unit else 2
        bias = (ffn * (2 if self.gated_linear_unit else 1) + self.hidden_size) if self.add_bias_linear else 0
        return matrices * self.hidden_size * ffn + bias

    def dense_mlp_params(self) -> int:
        """Parameters of one dense MLP block, its input norm included."""
        norm = self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)
        return norm + self._mlp_params(self.ffn_hidden_size)

    def moe_mlp_params(self, *, active: bool = False) -> int:
        """Parameters of one MoE MLP block (router, shared expert, routed experts; active: only top-k experts)."""
        norm = self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)
        experts = self.moe_router_topk if active else self.num_experts
        shared = self._mlp_params(self.moe_shared_expert_intermediate_size) if self.moe_shared_expert_intermediate_size else 0
        return norm + self.hidden_size * self.num_experts + shared + experts * self._mlp_params(self.moe_ffn_hidden_size)

    def expert_params_per_moe_layer(self) -> int:
        """Routed-expert parameters of one MoE layer (the part split by expert parallelism)."""
        return self.num_experts * self._mlp_params(self.moe_ffn_hidden_size)

    def embedding_params(self) -> int:
        """Input embedding (plus learned positions)."""
        pos = self.max_position_embeddings * self.hidden_size if self.position_embedding_type == "learned_absolute" else 0
        return self.vocab_size * self.hidden_size + pos

    def output_params(self) -> int:
        """Final norm plus the output layer (0 matrix when tied)."""
        norm = self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)
        return norm + (0 if self.tie_embeddings else self.vocab_size * self.hidden_size)

    def layer_params(self, index: int, *, active: bool = False) -> int:
        """Parameters of decoder layer `index` (0-based)."""
        moe = bool(self.moe_layers) and self.moe_layers[index]
        return self.attention_params() + (self.moe_mlp_params(active=active) if moe else self.dense_mlp_params())

    def num_params(self, *, include_mtp: bool = False) -> int:
        """Total parameters (embedding counted once when tied)."""
        dense = self.attention_params() + self.dense_mlp_params()
        moe = self.attention_params() + self.moe_mlp_params() if self.is_moe else 0
        total = self.embedding_params() + self.output_params()
        total += self.num_dense_layers * dense + self.num_moe_layers * moe
        if include_mtp and self.mtp_num_layers:
            total += self.mtp_num_layers * (self.layer_params(self.num_layers - 1) + 2 * self.hidden_size**2)
        return total

    def as_built(self) -> "ModelShape":
        """The model the trainers build of this shape: no multi-token-prediction layers (conversion drops them;
        ``mtp_num_layers`` stays for what reads the checkpoint's layout, and for published runs that had them)."""
        return dataclasses.replace(self, mtp_num_layers=0) if self.mtp_num_layers else self

    def num_active_params(self) -> int:
        """Parameters touched per token (routed experts counted top-k times)."""
        dense = self.attention_params() + self.dense_mlp_params()
        moe = self.attention_params() + self.moe_mlp_params(active=True) if self.is_moe else 0
        return self.embedding_params() + self.output_params() + self.num_dense_layers * dense + self.num_moe_layers * moe

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for JSON dumps)."""
        out = dataclasses.asdict(self)
        out["moe_layers"] = list(self.moe_layers)
        return out

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "ModelShape":
        """The shape ``to_dict`` wrote (as checkpoints record it in ``extra``)."""
        return cls(**{**fields, "moe_layers": tuple(fields.get("moe_layers") or ())})


YAML_KEYS = {
    "name", "family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "vocab_size", "seq_length", "max_position_embeddings", "gated_linear_unit", "activation",
    "normalization", "norm_epsilon", "position_embedding_type", "rotary_base", "rope_scaling", "add_qkv_bias",
    "add_bias_linear", "qk_layernorm", "tie_embeddings", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_first_dense_layers", "moe_norm_topk_prob",
    "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "mtp_num_layers", "hf_architecture", "hidden_dropout", "attention_dropout",
}
YAML_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def _moe_pattern(num_layers: int, num_experts: int, freq: Any, first_dense: int, source: str) -> tuple[bool, ...]:
    if not num_experts:
        return ()
    if isinstance(freq, (list, tuple)):
        if len(freq) != num_layers or any(v not in (0, 1, True, False) for v in freq):
            raise ConfigError(f"{source}: moe_layer_freq list must hold {num_layers} entries of 0/1, got {list(freq)}")
        pattern = [bool(v) for v in freq]
    else:
        if not isinstance(freq, int) or freq < 1:
            raise ConfigError(f"{source}: moe_layer_freq must be a positive int or a 0/1 list, got {freq!r}")
        pattern = [i % freq == 0 for i in range(num_layers)]
    if first_dense < 0 or first_dense > num_layers:
        raise ConfigError(f"{source}: moe_first_dense_layers must be in [0, {num_layers}], got {first_dense}")
    for i in range(first_dense):
        pattern[i] = False
    return tuple(pattern)


def _validate(shape: ModelShape, source: str) -> ModelShape:
    def bad(msg: str):
        raise ConfigError(f"{source}: {msg}")

    if shape.family not in FAMILIES:
        bad(f"family '{shape.family}' unknown; use one of {', '.join(FAMILIES)}{did_you_mean(shape.family, FAMILIES)}")
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "vocab_size", "seq_length", "max_position_embeddings"):
        value = getattr(shape, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            bad(f"{key} must be a positive integer, got {value!r}")
    if shape.num_attention_heads % shape.num_query_groups:
        bad(f"num_attention_heads ({shape.num_attention_heads}) must be a multiple of num_query_groups "
            f"({shape.num_query_groups})")
    if shape.normalization not in ("RMSNorm", "LayerNorm"):
        bad(f"normalization must be RMSNorm or LayerNorm, got {shape.normalization!r}")
    if shape.position_embedding_type not in ("rope", "learned_absolute"):
        bad(f"position_embedding_type must be rope or learned_absolute, got {shape.position_embedding_type!r}")
    if shape.activation not in ("silu", "gelu", "squared_relu"):
        bad(f"activation must be silu, gelu or squared_relu, got {shape.activation!r}")
    if shape.num_experts:
        if not 1 <= shape.moe_router_topk <= shape.num_experts:
            bad(f"moe_router_topk must be in [1, num_experts={shape.num_experts}], got {shape.moe_router_topk}")
        if shape.moe_ffn_hidden_size <= 0:
            bad("moe_ffn_hidden_size must be set (> 0) for an MoE model")
        if len(shape.moe_layers) != shape.num_layers or not any(shape.moe_layers):
            bad("MoE model needs at least one MoE layer (check moe_layer_freq / moe_first_dense_layers)")
        if shape.moe_router_score_function not in ("softmax", "sigmoid"):
            bad(f"moe_router_score_function must be softmax or sigmoid, got {shape.moe_router_score_function!r}")
        if shape.moe_router_enable_expert_bias and shape.moe_router_score_function != "sigmoid":
            bad("moe_router_enable_expert_bias needs moe_router_score_function sigmoid")
        groups, group_topk = shape.moe_router_num_groups, shape.moe_router_group_topk
        if groups > 1 or group_topk:
            if groups < 1 or shape.num_experts % groups or not 1 <= group_topk <= groups:
                bad(f"group-limited routing needs moe_router_num_groups dividing num_experts ({shape.num_experts}) "
                    f"and 1 <= moe_router_group_topk <= groups; got {groups} and {group_topk}")
            if shape.moe_router_topk > group_topk * (shape.num_experts // groups):
                bad(f"moe_router_topk {shape.moe_router_topk} exceeds the experts of {group_topk} group(s)")
    elif shape.moe_router_topk or shape.moe_layers:
        bad("moe_router_topk / MoE layers given but num_experts is 0")
    if shape.kv_lora_rank and not (shape.qk_nope_head_dim and shape.qk_rope_head_dim and shape.v_head_dim):
        bad("MLA (kv_lora_rank > 0) needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
    if shape.kv_lora_rank and shape.kv_channels != shape.v_head_dim:
        bad(f"MLA: kv_channels ({shape.kv_channels}) must equal v_head_dim ({shape.v_head_dim})")
    if shape.rope_type == "yarn":
        scaling = shape.rope_scaling or {}
        if not scaling.get("original_max_position_embeddings"):
            bad(f"yarn rope_scaling needs original_max_position_embeddings, got {scaling}")
    if shape.seq_length > shape.max_position_embeddings:
        bad(f"seq_length {shape.seq_length} exceeds max_position_embeddings {shape.max_position_embeddings}")
    return shape


def shape_from_megatron_dict(cfg: dict[str, Any], *, name: str, source: str) -> ModelShape:
    """Build a shape from Megatron-style keys (YAML presets and user YAML files)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a mapping of Megatron-style model fields")
    for key in cfg:
        if key not in YAML_KEYS:
            raise ConfigError(f"{source}: unknown key '{key}'{did_you_mean(str(key), YAML_KEYS)}")
    missing = [k for k in YAML_REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
    c = dict(cfg)
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    num_experts = int(c.get("num_experts") or 0)
    pattern = _moe_pattern(c["num_layers"], num_experts, c.pop("moe_layer_freq", 1),
                           int(c.pop("moe_first_dense_layers", 0) or 0), source)
    seq = c.get("seq_length", 4096)
    kwargs = dict(
        name=str(c.pop("name", name)),
        family=c.pop("family", "llama" if not num_experts else "qwen3_moe"),
        ffn_hidden_size=c.pop("ffn_hidden_size", 4 * hidden),
        num_query_groups=c.pop("num_query_groups", heads),
        kv_channels=c.pop("kv_channels", hidden // heads if heads and hidden % heads == 0 else 0),
        seq_length=c.pop("seq_length", seq),
        max_position_embeddings=c.pop("max_position_embeddings", seq),
        moe_layers=pattern,
    )
    if c.get("rope_scaling") is not None and not isinstance(c["rope_scaling"], dict):
        raise ConfigError(f"{source}: rope_scaling must be a mapping, got {c['rope_scaling']!r}")
    if not c.get("num_experts"):
        c.pop("num_experts", None)
    kwargs.update(c)
    if kwargs.get("gated_linear_unit") is False and "activation" not in cfg:
        kwargs["activation"] = "gelu"
    try:
        shape = ModelShape(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return _validate(shape, source)


# ----- Hugging Face config.json -----
HF_MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
}
HF_ARCHITECTURES = {arch: mt for mt, (_, arch) in HF_MODEL_TYPES.items()}


def _hf_act(act: str, source: str) -> str:
    table = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
             "relu2": "squared_relu"}
    if act not in table:
        raise ConfigError(f"{source}: hidden_act '{act}' not supported; use one of {', '.join(sorted(table))}")
    return table[act]


def fold_transformers5_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers-5 spellings in the classic keys: ``rope_parameters`` -> rope_theta / rope_scaling, and
    Qwen3-MoE's ``num_local_experts`` -> num_experts (read wrongly, they silently give theta 10000 or a dense model)."""
    cfg = dict(cfg)
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        if cfg.get("rope_theta") is None and rope.get("rope_theta") is not None:
            cfg["rope_theta"] = rope["rope_theta"]
        if cfg.get("rope_scaling") is None and rope.get("rope_type") not in (None, "default"):
            cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if cfg.get("model_type") == "qwen3_moe" and cfg.get("num_experts") is None and cfg.get("num_local_experts"):
        cfg["num_experts"] = cfg["num_local_experts"]
    return cfg


def shape_from_hf_config(cfg: dict[str, Any], *, name: str, source: str) -> ModelShape:
    """Build a shape from a Hugging Face config.json dict."""
    cfg = fold_transformers5_keys(cfg)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type not in HF_MODEL_TYPES:
        model_type = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), model_type)
    if model_type not in HF_MODEL_TYPES:
        supported = ", ".join(sorted(HF_ARCHITECTURES))
        raise ConfigError(f"{source}: unsupported architecture (model_type={model_type!r}, architectures={archs}); "
                          f"supported: {supported}")
    family, default_arch = HF_MODEL_TYPES[model_type]
    try:
        layers, hidden, heads = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
    except KeyError as exc:
        raise ConfigError(f"{source}: missing HF key {exc.args[0]}") from None
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    rope_scaling = cfg.get("rope_scaling")
    original = (rope_scaling or {}).get("original_max_position_embeddings") if isinstance(rope_scaling, dict) else None
    seq = min(max_pos, HF_DEFAULT_SEQ_CAP, int(original) if original else max_pos)
    kw: dict[str, Any] = dict(
        name=name, family=family, num_layers=layers, hidden_size=hidden,
        ffn_hidden_size=int(cfg.get("intermediate_size", 4 * hidden)), num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        kv_channels=int(cfg.get("head_dim") or hidden // heads), vocab_size=vocab, seq_length=seq,
        max_position_embeddings=max_pos, gated_linear_unit=True, activation=_hf_act(cfg.get("hidden_act", "silu"), source),
        normalization="RMSNorm", norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        rotary_base=float(cfg.get("rope_theta", 10000.0)), rope_scaling=rope_scaling,
        add_qkv_bias=bool(cfg.get("attention_bias", family == "qwen2")),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hf_architecture=archs[0] if archs else default_arch,
    )
    if family == "qwen3" or family == "qwen3_moe":
        kw["qk_layernorm"] = True
    if family == "qwen3_moe":
        experts = int(cfg.get("num_experts", 0))
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        kw.update(num_experts=experts, moe_router_topk=int(cfg.get("num_experts_per_tok", 0)),
                  moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size", 0)),
                  moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                  moe_layers=tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
                  if experts else ())
    elif family == "mixtral":
        experts = int(cfg.get("num_local_experts", 8))
        kw.update(num_experts=experts, moe_router_topk=int(cfg.get("num_experts_per_tok", 2)),
                  moe_ffn_hidden_size=kw["ffn_hidden_size"], moe_norm_topk_prob=True, moe_layers=(True,) * layers)
    elif family == "deepseek_v3":
        experts = int(cfg.get("n_routed_experts") or 0)
        first_dense = int(cfg.get("first_k_dense_replace", 0))
        freq = int(cfg.get("moe_layer_freq", 1) or 1)
        moe_ffn = int(cfg.get("moe_intermediate_size", 0))
        # transformers' DeepseekV3 always scores with a sigmoid and a correction bias (noaux_tc); the original
        # config.json says so with scoring_func / topk_method.
        sigmoid = cfg.get("scoring_func", "sigmoid") == "sigmoid"
        kw.update(num_experts=experts, moe_router_topk=int(cfg.get("num_experts_per_tok", 0)),
                  moe_ffn_hidden_size=moe_ffn,
                  moe_shared_expert_intermediate_size=int(cfg.get("n_shared_experts") or 0) * moe_ffn,
                  moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                  moe_router_score_function="sigmoid" if sigmoid else "softmax",
                  moe_router_enable_expert_bias=bool(experts) and sigmoid
                  and cfg.get("topk_method", "noaux_tc") == "noaux_tc",
                  moe_router_num_groups=int(cfg.get("n_group") or 0) if experts else 0,
                  moe_router_group_topk=int(cfg.get("topk_group") or 0) if experts and (cfg.get("n_group") or 0) > 1
                  else 0,
                  moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                  moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(layers)) if experts else (),
                  q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
                  qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
                  qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
                  v_head_dim=int(cfg.get("v_head_dim") or 0), kv_channels=int(cfg.get("v_head_dim") or 128),
                  mtp_num_layers=int(cfg.get("num_nextn_predict_layers") or 0), add_qkv_bias=False)
    return _validate(ModelShape(**kw), source)


def _read_yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None


def list_presets() -> list[str]:
    """Preset names available under configs/models/."""
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_model_shape(spec: str) -> ModelShape:
    """Resolve `spec` (preset name, HF config.json or its folder, or Megatron-style YAML) to a ModelShape."""
    spec = str(spec).strip()
    if not spec:
        raise ConfigError("model: empty model spec; give a preset name, an HF config.json path or a YAML path")
    path = Path(spec).expanduser()
    looks_like_path = path.suffix in (".json", ".yaml", ".yml") or "/" in spec or path.exists()
    if looks_like_path:
        if path.is_dir():
            cfg_file = path / "config.json"
            if not cfg_file.is_file():
                raise ConfigError(f"{path}: folder has no config.json; point --model at an HF model folder or file")
            path = cfg_file
        if not path.is_file():
            raise ConfigError(f"{spec}: model file not found; give a preset name ({', '.join(list_presets())}), "
                              "an HF config.json path or a YAML path")
        if path.suffix == ".json":
            try:
                cfg = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}: not valid JSON ({exc})") from None
            name = path.parent.name if path.name == "config.json" else path.stem
            return shape_from_hf_config(cfg, name=name, source=str(path))
        if path.suffix in (".yaml", ".yml"):
            return shape_from_megatron_dict(_read_yaml(path), name=path.stem, source=str(path))
        raise ConfigError(f"{path}: unknown model file type; use config.json (HF) or .yaml (Megatron-style fields)")
    presets = {p.lower(): p for p in list_presets()}
    key = spec.lower()
    if key not in presets:
        raise ConfigError(f"model '{spec}': no such preset under configs/models/{did_you_mean(key, presets)}; "
                          f"presets: {', '.join(presets.values())}")
    preset = presets_dir() / f"{presets[key]}.yaml"
    return shape_from_megatron_dict(_read_yaml(preset), name=presets[key], source=str(preset))


if __name__ == "__main__":
    for arg in sys.argv[1:] or list_presets():
        s = load_model_shape(arg)
        print(f"{s.name}: {s.num_params() / 1e9:.2f}B total, {s.num_active_params() / 1e9:.2f}B active, "
              f"family={s.family}, layers={s.num_layers}, moe_layers={s.num_moe_layers}")
