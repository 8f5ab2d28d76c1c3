"""Pure pieces of the converter: QKV/[gate; up]/vocab arithmetic, key parsing, config folding, safetensors I/O.

Run: .venv/bin/python -m pytest tests/test_conversion_mapping.py -q

Fusions are checked against layouts written out head by head here (not against the functions' own inverse
only), and the HF name map against the parameters of real transformers models built on the meta device.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))

from convert_fixtures import TINY_HF  # noqa: E402

from megatron_rl.spec.errors import ConfigError  # noqa: E402
from megatron_rl.conversion import mapping  # noqa: E402
from megatron_rl.conversion.names import (  # noqa: E402
    MegatronRef,
    expected_hf_tensors,
    hf_config_from_shape,
    hf_row_sources,
    layout_world_size,
    normalize_hf_config,
    parse_megatron_key,
    refs_in_stored_tensor,
    shape_from_config,
    tensor_maps,
)
from megatron_rl.conversion.safetensors_io import (  # noqa: E402
    HFCheckpoint,
    PlannedTensor,
    ShardedSafetensorsWriter,
    parse_size,
    plan_shards,
    read_header,
)


def _hf_config(kind: str) -> dict:
    import transformers

    config_cls, arch, kwargs = TINY_HF[kind]
    cfg = getattr(transformers, config_cls)(**kwargs).to_dict()
    cfg["architectures"] = [arch]
    return cfg


def test_fused_qkv_is_interleaved_per_query_group():
    heads, groups, d, hidden = 8, 2, 3, 5
    q, k, v = torch.randn(heads * d, hidden), torch.randn(groups * d, hidden), torch.randn(groups * d, hidden)
    per_group = heads // groups
    rows = []
    for g in range(groups):  # written out head by head: [q heads of group g; k_g; v_g]
        rows += [q[h * d:(h + 1) * d] for h in range(g * per_group, (g + 1) * per_group)]
        rows += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    expected = torch.cat(rows)
    fused = mapping.fuse_qkv(q, k, v, num_groups=groups, head_dim=d)
    assert torch.equal(fused, expected)
    assert all(torch.equal(a, b) for a, b in zip(mapping.split_qkv(fused, num_heads=heads, num_groups=groups,
                                                                   head_dim=d), (q, k, v), strict=True))
    bias = mapping.fuse_qkv(q[:, 0], k[:, 0], v[:, 0], num_groups=groups, head_dim=d)
    assert torch.equal(bias, expected[:, 0])
    # a TP rank holds whole query groups, so TP shards of the fused tensor are a plain split of it
    shard0 = mapping.fuse_qkv(q[:per_group * d], k[:d], v[:d], num_groups=1, head_dim=d)
    assert torch.equal(fused[:len(shard0)], shard0)


def test_fc1_tp_shards_hold_gate_and_up_each():
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    fc1 = mapping.fuse_gate_up(gate, up)
    shards = mapping.split_fc1_tp_shards(fc1, 2)
    assert torch.equal(shards[0], torch.cat([gate[:4], up[:4]]))
    assert torch.equal(mapping.merge_fc1_tp_shards(shards), fc1)
    assert not torch.equal(torch.cat(shards), fc1)  # the peers' bug: concatenating shards interleaves gate/up
    assert all(torch.equal(a, b) for a, b in zip(mapping.split_gate_up(fc1), (gate, up), strict=True))


def test_vocab_padding_rows_are_zero_and_cut_on_export():
    w = torch.randn(100, 4)
    padded = mapping.pad_vocab(w, 128)
    assert padded.shape == (128, 4) and torch.count_nonzero(padded[100:]) == 0
    assert torch.equal(mapping.cut_vocab(padded, 100), w)
    with pytest.raises(ValueError):
        mapping.pad_vocab(w, 64)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_region_reads_equal_slices_of_the_whole_tensor(kind):
    """What one TP rank reads straight from the HF files equals its slice of the fused global tensor."""
    shape = shape_from_config(_hf_config(kind), kind)
    generator = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(s, generator=generator) for name, s in expected_hf_tensors(shape).items()}

    def read_rows(name, first, last, cols):
        return hf[name][(slice(first, last), *cols)]

    for tm in tensor_maps(shape):
        padded = -(-shape.vocab_size // 128) * 128 if tm.kind == "vocab" else None
        whole = mapping.megatron_from_hf(tm, shape, hf, padded)
        for tp in (1, 2):
            for rank in range(tp):
                rows = whole.shape[0] // tp
                offsets = (rank * rows, *([0] * (whole.dim() - 1)))
                sizes = (rows, *whole.shape[1:])
                block = mapping.megatron_region_from_hf(tm, shape, whole.shape[0], offsets, sizes, read_rows,
                                                        torch.float32)
                assert torch.equal(block, whole[rank * rows:(rank + 1) * rows]), (tm.ref, tp, rank)
        if whole.dim() == 2:  # row-parallel layers are split on dim 1
            cols = whole.shape[1] // 2
            block = mapping.megatron_region_from_hf(tm, shape, whole.shape[0], (0, cols), (whole.shape[0], cols),
                                                    read_rows, torch.float32)
            assert torch.equal(block, whole[:, cols:])
        back = mapping.hf_from_megatron(tm, shape, whole)
        assert all(torch.equal(back[name], hf[name]) for name in tm.hf)
        for name, blocks in hf_row_sources(tm, shape, whole.shape[0]).items():  # the file-to-file copy plan
            assert torch.equal(torch.cat([whole[first:first + rows] for first, rows in blocks]), hf[name])


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_name_map_matches_transformers_parameters(kind):
    """Names and shapes the map expects equal the parameters of the transformers model (meta device)."""
    import transformers

    cfg = _hf_config(kind)
    config_cls, arch, _ = TINY_HF[kind]
    with torch.device("meta"):
        model = getattr(transformers, arch)(getattr(transformers, config_cls)(**TINY_HF[kind][2]))
    params = {n: tuple(p.shape) for n, p in model.state_dict().items() if not n.endswith("inv_freq")}
    if cfg.get("tie_word_embeddings"):
        params.pop("lm_head.weight", None)
    assert expected_hf_tensors(shape_from_config(cfg, kind)) == params


def test_megatron_key_spellings_fold_to_one_ref():
    assert parse_megatron_key("decoder.layers.self_attention.linear_qkv.weight", (3,)) == \
        parse_megatron_key("decoder.layers.3.self_attention.linear_qkv.weight") == \
        MegatronRef("self_attention.linear_qkv.weight", 3)
    assert parse_megatron_key("decoder.layers.2.input_layernorm.weight") == \
        MegatronRef("self_attention.linear_qkv.layer_norm_weight", 2)
    assert parse_megatron_key("decoder.layers.pre_mlp_layernorm.weight", (1,)) == \
        MegatronRef("mlp.linear_fc1.layer_norm_weight", 1)
    stacked = parse_megatron_key("decoder.layers.mlp.experts.experts.linear_fc1.weight", (4, 7))
    per_layer = parse_megatron_key("decoder.layers.4.mlp.experts.experts.linear_fc1.weight", (7,))
    legacy = parse_megatron_key("decoder.layers.4.mlp.experts.local_experts.7.linear_fc1.weight")
    assert stacked == per_layer == legacy == MegatronRef("mlp.experts.experts.linear_fc1.weight", 4, 7)
    assert parse_megatron_key("reward_head.weight") == MegatronRef("rm_head.weight")
    refs = list(refs_in_stored_tensor("decoder.layers.mlp.experts.experts.linear_fc2.weight", (2, 3, 8, 4)))
    assert [r for r, _ in refs][-1] == MegatronRef("mlp.experts.experts.linear_fc2.weight", 1, 2) and len(refs) == 6


def test_transformers5_config_spellings_are_folded():
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 100, "intermediate_size": 96, "moe_intermediate_size": 32, "num_local_experts": 4,
           "num_experts_per_tok": 2, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    shape = shape_from_config(cfg, "cfg")
    assert shape.rotary_base == 1e6 and shape.num_experts == 4 and shape.kv_channels == 16
    with pytest.raises(ConfigError, match="supported: LlamaForCausalLM"):
        normalize_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "cfg")
    with pytest.raises(ConfigError, match="yarn"):
        normalize_hf_config({**cfg, "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn"}}, "cfg")


def test_configs_the_megatron_model_cannot_reproduce_are_refused():
    llama = _hf_config("llama")
    llama31 = {**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert shape_from_config(llama31, "llama3.1").rope_scaling["factor"] == 8.0
    odd = {**llama31, "rope_scaling": {**llama31["rope_scaling"], "original_max_position_embeddings": 256}}
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        normalize_hf_config(odd, "cfg")
    with pytest.raises(ConfigError, match="sliding-window"):
        normalize_hf_config({**llama, "architectures": ["MistralForCausalLM"], "sliding_window": 64}, "cfg")
    assert normalize_hf_config({**_hf_config("qwen2"), "sliding_window": 64, "use_sliding_window": False}, "cfg")
    with pytest.raises(ConfigError, match="attention_bias"):
        normalize_hf_config({**llama, "attention_bias": True}, "cfg")


@pytest.mark.parametrize("kind", list(TINY_HF))
def test_generated_config_describes_the_same_model(kind):
    shape = shape_from_config(_hf_config(kind), kind)
    again = shape_from_config(hf_config_from_shape(shape), "generated")
    assert again.to_dict() | {"name": "", "hf_architecture": ""} == shape.to_dict() | {"name": "",
                                                                                     "hf_architecture": ""}


def test_world_size_of_a_layout():
    assert layout_world_size(2, 2, 1) == 4 and layout_world_size(2, 2, 2) == 4 and layout_world_size(1, 2, 4) == 8


def test_sizes_parse():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size(1000) == 1000
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_streaming_writer_round_trips_through_safetensors(tmp_path):
    from safetensors import safe_open

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6).reshape(2, 3)}
    groups = [[PlannedTensor(n, {"a": "F32", "b": "BF16", "c": "I64"}[n], tuple(t.shape))] for n, t in tensors.items()]
    shards = plan_shards(groups, 64)
    assert [len(s) for s in shards] == [1, 2]  # 60 bytes; then 14 + 48 bytes
    raw = tmp_path / "raw.bin"  # "c" arrives as two byte ranges of another file, copied in the kernel
    c_bytes = tensors["c"].numpy().tobytes()
    raw.write_bytes(b"x" * 5 + c_bytes[:16] + b"y" * 3 + c_bytes[16:])
    writer = ShardedSafetensorsWriter(tmp_path, shards)
    writer.write("a", tensors["a"])
    writer.write("b", tensors["b"])
    writer.copy_ranges("c", [(raw, 5, 16), (raw, 24, len(c_bytes) - 16)])
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                                   "c": "model-00002-of-00002.safetensors"}
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / file), framework="pt") as f:
            assert torch.equal(f.get_tensor(name), tensors[name]) and f.metadata() == {"format": "pt"}
        header_len = struct.unpack("<Q", (tmp_path / file).read_bytes()[:8])[0]
        assert header_len % 8 == 0
    with pytest.raises(RuntimeError, match="does not match the plan"):
        ShardedSafetensorsWriter(tmp_path, shards).write("a", torch.zeros(3, 5, dtype=torch.float64))


def test_truncated_safetensors_is_named(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    assert read_header(tmp_path / "model.safetensors")["x"]["shape"] == [64, 64]
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ConfigError, match="truncated"):
        HFCheckpoint.open(tmp_path)


def test_an_hf_config_with_null_architectures_converts_both_ways():
    """#35 defect 6: transformers reads model_type when config.json's architectures is null, and so do both
    directions here: the import's shape and the export's config.json (it raised a TypeError on export)."""
    from megatron_rl.conversion.export import export_config
    from megatron_rl.conversion.names import hf_config_from_shape, normalize_hf_config
    from megatron_rl.spec.model_shape import load_model_shape

    cfg = {**hf_config_from_shape(load_model_shape("tiny-cpu")), "architectures": None}
    assert normalize_hf_config(cfg, "config.json")["architectures"] == ["LlamaForCausalLM"]
    exported, _ = export_config(cfg, None, "bfloat16", reward=False)
    assert exported["architectures"] == ["LlamaForCausalLM"] and cfg["architectures"] is None
