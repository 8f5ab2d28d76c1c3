"""Model shapes from presets, HF config.json and Megatron-style YAML.

Run: .venv/bin/python -m pytest tests/test_model_shape.py -q
Parameter counts are checked against the published totals and, for tiny configs, against the parameter count of
the real Hugging Face model built from the same config.json (on the meta device).
"""

import json

import pytest

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape, list_presets, load_model_shape

from helpers import REPO_ROOT

TINY_HF = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "hidden_act": "silu",
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 256}},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
              "vocab_size": 300, "max_position_embeddings": 1024, "tie_word_embeddings": True, "hidden_act": "silu"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "head_dim": 32,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 200, "max_position_embeddings": 40960, "tie_word_embeddings": False,
              "attention_bias": False, "hidden_act": "silu"},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
                  "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
                  "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0],
                  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                  "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu"},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
                "intermediate_size": 80, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 100,
                "max_position_embeddings": 2048, "tie_word_embeddings": False, "hidden_act": "silu"},
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
                    "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
                    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
                    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
                    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
                    "vocab_size": 128, "max_position_embeddings": 4096, "tie_word_embeddings": False,
                    "num_nextn_predict_layers": 1, "hidden_act": "silu",
                    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 1024}},
}


def _write_hf(tmp_path, family):
    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_HF[family]))
    return folder


@pytest.mark.parametrize(
    "preset, total_b, active_b",
    [("llama-3.1-405b", 405.0, None), ("llama-3.3-70b", 70.6, None), ("nemotron-4-340b", 341.0, None),
     ("qwen3-235b-a22b", 235.0, 22.0), ("deepseek-v3", 671.0, 37.0)],
)
def test_big_presets_match_published_parameter_counts(preset, total_b, active_b):
    shape = load_model_shape(preset)
    assert shape.num_params() / 1e9 == pytest.approx(total_b, rel=0.01)
    if active_b is None:
        assert shape.num_active_params() == shape.num_params()
    else:
        assert shape.num_active_params() / 1e9 == pytest.approx(active_b, rel=0.03)


def test_preset_lookup_is_case_insensitive_and_tiny_cpu_is_exact():
    shape = load_model_shape("TINY-CPU")
    assert (shape.num_layers, shape.hidden_size, shape.ffn_hidden_size) == (2, 64, 128)
    assert (shape.num_attention_heads, shape.num_query_groups, shape.kv_channels) == (4, 2, 16)
    assert (shape.vocab_size, shape.seq_length, shape.tie_embeddings) == (128, 64, False)
    assert shape.normalization == "RMSNorm" and shape.position_embedding_type == "rope" and shape.gated_linear_unit
    # embedding 128*64 + output 128*64 + final norm 64 + 2 * (attn 64*(4+2*2)*16 + 4*16*64 + norm 64
    #                                                            + mlp 3*64*128 + norm 64)
    assert shape.num_params() == 8192 + 8192 + 64 + 2 * (64 * 128 + 4096 + 64 + 3 * 64 * 128 + 64)


def test_tiny_moe_preset():
    shape = load_model_shape("tiny-cpu-moe")
    assert shape.is_moe and shape.num_experts == 4 and shape.moe_router_topk == 2 and shape.qk_layernorm
    assert shape.moe_layers == (True, True) and shape.moe_norm_topk_prob
    assert shape.num_params() > shape.num_active_params()


def test_every_preset_loads():
    names = list_presets()
    assert {"llama-3.1-405b", "llama-3.3-70b", "nemotron-4-340b", "qwen3-235b-a22b", "deepseek-v3", "tiny-cpu",
            "tiny-cpu-moe"} <= set(names)
    for name in names:
        assert isinstance(load_model_shape(name), ModelShape)


def test_presets_are_the_files_of_configs_models():
    assert list_presets() == sorted(p.stem for p in (REPO_ROOT / "configs" / "models").glob("*.yaml"))


def test_deepseek_v3_preset_structure():
    shape = load_model_shape("deepseek-v3")
    assert shape.moe_layers[:3] == (False, False, False) and all(shape.moe_layers[3:])
    assert shape.is_mla and (shape.kv_lora_rank, shape.qk_rope_head_dim) == (512, 64)
    assert shape.mtp_num_layers == 1 and shape.moe_router_score_function == "sigmoid"


def test_hf_families_parse(tmp_path):
    llama = load_model_shape(str(_write_hf(tmp_path, "llama")))
    assert llama.family == "llama" and llama.kv_channels == 16 and llama.num_query_groups == 2
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rotary_base == 500000.0
    assert llama.seq_length == 256  # capped at rope_scaling's original_max_position_embeddings
    assert llama.hf_architecture == "LlamaForCausalLM"
    qwen2 = load_model_shape(str(_write_hf(tmp_path, "qwen2") / "config.json"))
    assert qwen2.add_qkv_bias and qwen2.tie_embeddings and qwen2.family == "qwen2"
    qwen3 = load_model_shape(str(_write_hf(tmp_path, "qwen3")))
    assert qwen3.kv_channels == 32 and qwen3.qk_layernorm and qwen3.seq_length == 8192
    moe = load_model_shape(str(_write_hf(tmp_path, "qwen3_moe")))
    assert moe.moe_layers == (False, True, True) and moe.moe_norm_topk_prob and moe.num_experts == 8
    mixtral = load_model_shape(str(_write_hf(tmp_path, "mixtral")))
    assert mixtral.moe_ffn_hidden_size == 80 and mixtral.moe_layers == (True, True) and mixtral.moe_norm_topk_prob
    ds = load_model_shape(str(_write_hf(tmp_path, "deepseek_v3")))
    assert ds.moe_layers == (False, True, True) and ds.moe_shared_expert_intermediate_size == 32
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_rope_head_dim) == (24, 16, 8) and ds.seq_length == 1024


@pytest.mark.parametrize("family", sorted(TINY_HF))
def test_param_count_matches_real_hf_model(tmp_path, family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    shape = load_model_shape(str(_write_hf(tmp_path, family)))
    config = transformers.AutoConfig.for_model(**TINY_HF[family])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())


def test_megatron_yaml(tmp_path):
    path = tmp_path / "my-moe.yaml"
    path.write_text(
        "num_layers: 4\nhidden_size: 128\nffn_hidden_size: 256\nnum_attention_heads: 8\nnum_query_groups: 4\n"
        "kv_channels: 16\nvocab_size: 1000\nseq_length: 2048\ngated_linear_unit: true\nnum_experts: 8\n"
        "moe_router_topk: 2\nmoe_ffn_hidden_size: 64\nmoe_shared_expert_intermediate_size: 128\n"
        "tie_embeddings: true\nmoe_first_dense_layers: 1\n")
    shape = load_model_shape(str(path))
    assert shape.name == "my-moe" and shape.moe_layers == (False, True, True, True)
    assert shape.tie_embeddings and shape.max_position_embeddings == 2048
    # router 128*8, shared 3*128*128, 8 experts 3*128*64, norm 128
    assert shape.moe_mlp_params() == 128 + 128 * 8 + 3 * 128 * 128 + 8 * 3 * 128 * 64
    assert shape.moe_mlp_params(active=True) == 128 + 128 * 8 + 3 * 128 * 128 + 2 * 3 * 128 * 64


def test_megatron_yaml_moe_layer_freq_list(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("num_layers: 4\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 100\nnum_experts: 4\n"
                    "moe_router_topk: 1\nmoe_ffn_hidden_size: 32\nmoe_layer_freq: [0, 1, 0, 1]\n")
    shape = load_model_shape(str(path))
    assert shape.moe_layers == (False, True, False, True) and shape.ffn_hidden_size == 256


def test_unknown_yaml_key_suggests(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 100\nnum_query_group: 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'num_query_group'.*did you mean 'num_query_groups'"):
        load_model_shape(str(path))


def test_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_model_shape(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_shape(str(tmp_path))
    with pytest.raises(ConfigError, match=r"did you mean 'llama-3.1-405b'"):
        load_model_shape("llama-3.1-450b")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ConfigError, match=r"unsupported architecture.*supported: .*LlamaForCausalLM"):
        load_model_shape(str(bert))
    heads = tmp_path / "heads.yaml"
    heads.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 6\nnum_query_groups: 4\n"
                     "kv_channels: 16\nvocab_size: 10\n")
    with pytest.raises(ConfigError, match="multiple of num_query_groups"):
        load_model_shape(str(heads))
    topk = tmp_path / "topk.yaml"
    topk.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\nnum_experts: 4\n"
                    "moe_router_topk: 8\nmoe_ffn_hidden_size: 32\n")
    with pytest.raises(ConfigError, match="moe_router_topk"):
        load_model_shape(str(topk))


def test_transformers5_rope_parameters_and_qwen3_moe_experts_are_read(tmp_path):
    import json

    from megatron_rl.spec.model_shape import load_model_shape

    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2,
           "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
           "intermediate_size": 128, "moe_intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = load_model_shape(str(tmp_path))
    assert shape.rotary_base == 1000000.0
    assert shape.num_experts == 4 and shape.moe_layers == (True, True)


def test_deepseek_v3_routing_and_rope_fields(tmp_path):
    """DeepSeek-V3's routing fields (sigmoid + noaux_tc expert bias, groups, routed scaling) and yarn parameters;
    n_group 1 is no group limit. The planner's counts do not depend on them (the bias is a buffer)."""
    ds = load_model_shape(str(_write_hf(tmp_path, "deepseek_v3")))
    assert ds.moe_router_score_function == "sigmoid" and ds.moe_router_enable_expert_bias
    assert (ds.moe_router_num_groups, ds.moe_router_group_topk) == (1, 0) and ds.moe_router_topk_scaling_factor == 1.0
    assert ds.rope_type == "yarn" and ds.yarn_params() == {
        "factor": 40.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.0}
    v3 = load_model_shape("deepseek-v3")
    assert v3.moe_router_enable_expert_bias and (v3.moe_router_num_groups, v3.moe_router_group_topk) == (8, 4)
    assert v3.moe_router_topk_scaling_factor == 2.5 and v3.q_lora_rank == 1536


def test_kimi_k2_preset_is_its_published_config():
    """configs/models/kimi-k2.yaml and Kimi-K2's config.json (tests/data, model_type kimi_k2, DeepseekV3
    architecture) give the same shape: 1 dense + 60 MoE layers, 384 experts top-8 without group limit (n_group 1),
    MLA with q-LoRA, yarn factor 32 over 4096, no MTP; about 1.03T parameters, 32.9B active."""
    import dataclasses

    preset = load_model_shape("kimi-k2")
    published = load_model_shape(str(REPO_ROOT / "tests" / "data" / "kimi-k2-config.json"))
    assert dataclasses.replace(published, name=preset.name) == preset
    assert preset.moe_layers == (False,) + (True,) * 60 and preset.num_experts == 384 and preset.is_mla
    assert (preset.moe_router_num_groups, preset.moe_router_group_topk) == (1, 0)
    assert preset.moe_router_topk_scaling_factor == 2.827 and preset.mtp_num_layers == 0
    assert preset.yarn_params()["factor"] == 32.0 and preset.rotary_base == 50000.0
    assert round(preset.num_params() / 1e9) == 1026 and round(preset.num_active_params() / 1e9, 1) == 32.9
