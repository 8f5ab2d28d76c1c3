"""DeepSeek-V3 family: shape, the Megatron Core model (MLA, shared experts, dense-first layers, sigmoid routing
with the expert-bias correction, group-limited routing, yarn RoPE) and conversion both ways, on CPU.

Run: .venv/bin/python -m pytest tests/test_deepseek_v3.py -q      (about 2 minutes on 2 idle cores)

* Training: ``launch.py --config configs/pretrain_tiny.yaml model.name=tiny-cpu-deepseek-v3`` at one process
  and at TP2·EP2·SP, EP2 at DP2, TP2·SP with the experts split over TP (etp 2) and PP2 (3 layers split 2 + 1):
  same per-step loss and grad norm (each run its own subprocess: Megatron's parallel state is process-global).
* Conversion: tiny random ``DeepseekV3ForCausalLM`` models built by transformers (tests/dist/deepseek_fixtures.py)
  go ``convert hf-to-megatron`` at TP2·PP2·EP2 and back; every tensor round-trips bit-identically, transformers
  loads the export, and Megatron's logits at TP2·EP2 match transformers' within 1e-4 (``--verify`` through the
  real CLI for the yarn model, which also carries a multi-token-prediction layer that the import drops).
* FP8: the q-LoRA model block-quantized as DeepSeek-V3 ships (F8_E4M3 + weight_scale_inv) imports at TP2·PP2·EP2
  as exactly fp8 * scale and exports unquantized.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import run_launch
from test_scale_layouts import SP, _assert_same_training, _run

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import load_model_shape, shape_from_hf_config

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))

from deepseek_fixtures import TINY_DEEPSEEK, make_deepseek_model, quantize_fp8  # noqa: E402

PRESET = "tiny-cpu-deepseek-v3"
MODEL = f"model.name={PRESET}"


# ----- shape -----
def test_preset_and_hf_config_shapes():
    tiny = load_model_shape(PRESET)
    assert tiny.is_mla and tiny.moe_layers == (False, True, True) and tiny.moe_shared_expert_intermediate_size == 32
    assert (tiny.moe_router_score_function, tiny.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (tiny.moe_router_num_groups, tiny.moe_router_group_topk, tiny.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert tiny.rope_type == "yarn" and tiny.yarn_params()["original_max_position_embeddings"] == 64
    v3 = load_model_shape("deepseek-v3")
    assert v3.rope_type == "yarn" and v3.yarn_params() == {"factor": 40.0, "original_max_position_embeddings": 4096,
                                                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                                          "mscale_all_dim": 1.0}
    assert (v3.moe_router_num_groups, v3.moe_router_group_topk, v3.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    # a transformers-5 config.json (rope_parameters, no scoring_func/topk_method: transformers always uses sigmoid
    # with the correction bias) and the original DeepSeek spelling (rope_scaling type, q_lora_rank null: V2-Lite)
    hf = dict(TINY_DEEPSEEK["yarn"], architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    shape = shape_from_hf_config(hf, name="x", source="x")
    assert shape.moe_router_enable_expert_bias and shape.moe_router_score_function == "sigmoid"
    assert (shape.q_lora_rank, shape.kv_lora_rank, shape.qk_nope_head_dim, shape.v_head_dim) == (32, 16, 16, 16)
    assert shape.mtp_num_layers == 1 and shape.yarn_params()["factor"] == 4.0 and shape.seq_length == 64
    lite = dict(hf, q_lora_rank=None, rope_parameters=None, scoring_func="softmax", topk_method="greedy",
                rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096})
    lite = shape_from_hf_config(lite, name="lite", source="lite")
    assert lite.q_lora_rank == 0 and not lite.moe_router_enable_expert_bias and lite.rope_type == "yarn"
    with pytest.raises(ConfigError, match="moe_router_group_topk"):
        shape_from_hf_config(dict(hf, n_group=3), name="x", source="x")


def test_megatron_config():
    """MLATransformerConfig with the DeepSeek fields; the expert bias is frozen unless model.moe_expert_bias_update."""
    pytest.importorskip("megatron.core")
    from megatron_rl.spec.config.schema import ModelConfig
    from megatron_rl.spec.parallel import ParallelDims
    from megatron_rl.models.builder import EXPERT_BIAS_UPDATE_RATE, ModelOptions, transformer_config

    assert ModelConfig().moe_expert_bias_update is False
    shape = load_model_shape(PRESET)
    config = transformer_config(shape, ModelOptions())
    assert type(config).__name__ == "MLATransformerConfig" and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (32, 16, 16, 8, 16)
    assert (config.rope_type, config.rotary_scaling_factor) == ("yarn", 4.0)
    assert config.original_max_position_embeddings == 64
    assert config.moe_layer_freq == [0, 1, 1] and config.moe_shared_expert_intermediate_size == 32
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_router_bias_update_rate == 0.0
    updating = transformer_config(shape, ModelOptions(moe_expert_bias_update=True))
    assert updating.moe_router_bias_update_rate == EXPERT_BIAS_UPDATE_RATE
    with pytest.raises(ConfigError, match="without Transformer Engine needs parallel.sequence_parallel=true"):
        transformer_config(shape, ModelOptions(dims=ParallelDims(world_size=2, tp=2, ep=2)))


# ----- training at scale layouts (the runs and the comparison of tests/test_scale_layouts.py) -----
@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _run(run_launch, tmp_path_factory.mktemp("ds_plain"), MODEL, "cluster.tasks_per_node=1")


@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.ep=2", SP],
    ["parallel.ep=2"],  # dense dp 2, expert dp 1
    ["parallel.tp=2", "parallel.etp=2", SP],
    ["parallel.pp=2"],  # 3 layers: 2 + 1
], ids=["tp2-ep2-sp", "ep2-dp2", "tp2-etp2-sp", "pp2-uneven"])
def test_layouts_train_like_one_process(tmp_path, plain, layout):
    """Same seed, same batches: per-step loss (rel 1e-4) and grad norm (rel 1e-5) as one process. Measured
    ~1e-7 apart; the local MLA spec's column-parallel down projections (replaced, see builder.local_mla_spec)
    were 9e-5 apart in grad norm by step 3 at TP2."""
    _assert_same_training(plain, _run(run_launch, tmp_path / "run", MODEL, *layout))


# ----- conversion -----
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The yarn model (with an MTP layer) through the real CLI: import at TP2·PP2·EP2, export with --verify at
    TP2·EP2; the q-LoRA (default RoPE) and no-q-LoRA models through one worker job (import at TP2·PP2·EP2 +
    logits at TP2·EP2), exported in-process."""
    from megatron_rl.conversion import export_checkpoint_to_hf
    from megatron_rl.conversion.spawn import run_worker
    from megatron_rl.conversion.verify import prompt_tokens

    root = tmp_path_factory.mktemp("ds_convert")
    out: dict = {"root": root}
    make_deepseek_model("yarn", root / "hf_yarn", mtp=True)
    out["import"] = run_launch("convert", "hf-to-megatron", "--hf", str(root / "hf_yarn"), "--out",
                               str(root / "mg_yarn"), "--tp", "2", "--pp", "2", "--ep", "2", timeout=400)
    out["export"] = run_launch("convert", "megatron-to-hf", "--ckpt", str(root / "mg_yarn"), "--out",
                               str(root / "out_yarn"), "--verify", "--tp", "2", "--ep", "2", "--tolerance", "1e-4",
                               timeout=400)
    tasks = []
    for kind in ("qlora", "no_qlora"):
        make_deepseek_model(kind, root / f"hf_{kind}", seed=1)
    out["fp8_expected"] = quantize_fp8(root / "hf_qlora", root / "hf_fp8")
    for kind in ("qlora", "no_qlora", "fp8"):
        tasks += [{"kind": "import", "hf": str(root / f"hf_{kind}"), "out": str(root / f"mg_{kind}"), "tp": 2,
                   "pp": 2, "ep": 2, "dtype": "fp32" if kind == "fp8" else None},
                  {"kind": "logits", "ckpt": str(root / f"mg_{kind}"), "tokens": prompt_tokens(120),
                   "out_file": str(root / f"logits_{kind}.pt"), "tp": 2, "pp": 1, "ep": 2}]
    run_worker(tasks, 4, workdir=root / "worker", timeout=600)
    for kind in ("qlora", "no_qlora", "fp8"):
        out[kind] = export_checkpoint_to_hf(root / f"mg_{kind}", root / f"out_{kind}", shard_size="40KB")
    return out


def _tensors(folder: Path) -> dict:
    from megatron_rl.conversion.safetensors_io import HFCheckpoint

    hf = HFCheckpoint.open(folder)  # folders without FP8 weights: every tensor as stored
    return {name: hf.read(name) for name in hf.tensors}


@pytest.mark.parametrize("kind", ["yarn", "qlora", "no_qlora"])
def test_round_trip_is_bit_identical(converted, kind):
    import torch

    root = converted["root"]
    original = {k: v for k, v in _tensors(root / f"hf_{kind}").items() if not k.startswith("model.layers.3.")}
    exported = _tensors(root / f"out_{kind}")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert torch.count_nonzero(exported["model.layers.2.mlp.gate.e_score_correction_bias"]) == 8
    config = json.loads((root / f"out_{kind}" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["num_nextn_predict_layers"] == 0


def test_cli_drops_mtp_and_verifies_against_transformers(converted):
    imported, exported = converted["import"], converted["export"]
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert "note: dropped the 1 multi-token-prediction layer(s)" in imported.stderr
    assert "tp=2 pp=2 ep=2 on 4 process(es)" in imported.stdout
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "multi-token-prediction" in exported.stderr
    report = json.loads(exported.stdout.strip().splitlines()[-1])
    assert report["tensors_equal"] and report["argmax_agreement"] == 1.0
    assert report["max_abs_logit_diff"] <= 1e-4, report


@pytest.mark.parametrize("kind", ["qlora", "no_qlora", "fp8"])
def test_logits_match_transformers(converted, kind):
    """Megatron at TP2·EP2 on the imported checkpoint vs transformers on the original folder (not for FP8) and
    on the export."""
    import torch
    import transformers

    from megatron_rl.conversion.verify import compare_with_hf, prompt_tokens

    root = converted["root"]
    megatron = torch.load(root / f"logits_{kind}.pt", weights_only=True)
    if kind != "fp8":
        original = transformers.AutoModelForCausalLM.from_pretrained(str(root / f"hf_{kind}"), dtype=torch.float32)
        with torch.no_grad():
            reference = original.eval()(torch.tensor(prompt_tokens(120))).logits
        assert float((reference - megatron["logits"]).abs().max()) <= 1e-4
    report = compare_with_hf(megatron, root / f"out_{kind}", prompt_tokens(120), tolerance=1e-4)
    assert report["ok"] and report["tensors_equal"] and report["argmax_agreement"] == 1.0, report


def test_fp8_block_weights_are_dequantized(converted):
    """An FP8 block-quantized checkpoint (blocks 20x24, so TP/EP shards start inside blocks) imports at TP2·PP2·EP2
    as exactly fp8 * weight_scale_inv (fp32 here; bf16 by default), and exports unquantized."""
    import torch

    from megatron_rl.conversion.importer import check_hf_tensors
    from megatron_rl.conversion.names import shape_from_config
    from megatron_rl.conversion.safetensors_io import HFCheckpoint

    root = converted["root"]
    exported, expected = _tensors(root / "out_fp8"), converted["fp8_expected"]
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    assert not torch.equal(exported["model.layers.0.self_attn.q_b_proj.weight"],
                           _tensors(root / "hf_qlora")["model.layers.0.self_attn.q_b_proj.weight"])
    assert "quantization_config" not in json.loads((root / "out_fp8" / "config.json").read_text())
    hf = HFCheckpoint.open(root / "hf_fp8")
    assert hf.dtype() == "BF16" and hf.fp8_block == (20, 24)
    shape = shape_from_config(hf.config, "fp8")
    notes = check_hf_tensors(shape, hf.tensors, "fp8", hf.fp8_block)
    assert any("dequantized" in note for note in notes)
    with pytest.raises(ConfigError, match="needs model.layers.0.self_attn.q_a_proj.weight_scale_inv"):
        check_hf_tensors(shape, {k: v for k, v in hf.tensors.items() if not k.endswith("q_a_proj.weight_scale_inv")},
                         "fp8", hf.fp8_block)


def test_expert_bias_changes_routing(converted):
    """The correction bias is live on both sides: zeroing it in transformers changes the logits."""
    import torch
    import transformers

    from megatron_rl.conversion.verify import prompt_tokens

    model = transformers.AutoModelForCausalLM.from_pretrained(str(converted["root"] / "out_qlora"),
                                                              dtype=torch.float32).eval()
    tokens = torch.tensor(prompt_tokens(120))
    with torch.no_grad():
        before = model(tokens).logits
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        after = model(tokens).logits
    assert float((before - after).abs().max()) > 1e-3


def test_preset_export_config_is_a_transformers_model():
    """A preset's (or a trained checkpoint's) DeepseekV3 config.json: transformers builds exactly the tensors the
    name map writes, and it parses back to the same shape (less the MTP layer, which exports drop); an uneven
    pipeline split of DeepSeek-V3's 61 layers is legal for conversion."""
    import dataclasses

    import torch
    import transformers

    from megatron_rl.conversion.importer import check_layout
    from megatron_rl.conversion.names import expected_hf_tensors, hf_config_from_shape, shape_from_config

    for preset in (PRESET, "deepseek-v3"):
        shape = load_model_shape(preset)
        cfg = hf_config_from_shape(shape)
        back = shape_from_config(cfg, "export", name=preset)
        assert dataclasses.replace(back, mtp_num_layers=shape.mtp_num_layers) == shape
    cfg = hf_config_from_shape(load_model_shape(PRESET))
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg))
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = expected_hf_tensors(load_model_shape(PRESET))
    fused = {k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert {k: v for k, v in state.items() if k not in fused} == {k: v for k, v in expected.items()
                                                                    if ".experts." not in k or "shared" in k}
    check_layout(load_model_shape("deepseek-v3"), 8, 16, 64)  # 61 layers: 3 + 14 x 4 + 2


def test_te_and_local_mla_keys_fold_to_one_ref():
    """Transformer Engine fuses MLA's latent norms into the up projections; the local spec keeps them apart."""
    from megatron_rl.conversion.names import KV_NORM, Q_NORM, MegatronRef, parse_megatron_key

    layer = "decoder.layers.4.self_attention."
    assert parse_megatron_key(layer + "linear_q_up_proj.layer_norm_weight") == MegatronRef(Q_NORM, 4)
    assert parse_megatron_key(layer + "q_layernorm.weight") == MegatronRef(Q_NORM, 4)
    assert parse_megatron_key(layer + "linear_kv_up_proj.layer_norm_weight") == MegatronRef(KV_NORM, 4)
    assert parse_megatron_key(layer + "kv_layernorm.weight") == MegatronRef(KV_NORM, 4)


def test_refused_deepseek_configs():
    from megatron_rl.conversion.names import normalize_hf_config

    base = dict(TINY_DEEPSEEK["qlora"], architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    for change, needle in [({"rope_interleave": False}, "rope_interleave"), ({"norm_topk_prob": False},
                           "norm_topk_prob"), ({"num_experts_per_tok": 4}, "top-2"),
                           ({"moe_layer_freq": 2}, "moe_layer_freq"), ({"scoring_func": "softmax"}, "sigmoid"),
                           ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "linear")]:
        with pytest.raises(ConfigError, match=needle):
            normalize_hf_config(dict(base, **change), "cfg")


# ----- GRPO with colocated generation (the runs of tests/test_grpo_layouts.py, on this model) -----
@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    from test_grpo_layouts import PACKED, _grpo

    return {name: _grpo(tmp_path_factory.mktemp(f"ds_grpo_{name}"), MODEL, *extra) for name, extra in
            [("1proc", ["cluster.tasks_per_node=1"]), ("tp2_ep2_sp", ["parallel.tp=2", "parallel.ep=2", SP, *PACKED])]}


def test_grpo_at_tp2_ep2_sp_matches_one_process(grpo_runs):
    """MLA, shared expert, dense-first layer and sigmoid routing under GRPO at TP2·EP2·SP with packed rows
    (parallel.micro_batch_tokens; the 1-process run padded), checked as tests/test_grpo_layouts.py checks the MoE
    model: the first mini-batch's ratio is 1 within 1e-5 (generation log-probs, from the latent cache, = the
    packed training forward's) at every step of both runs; one generation worker, as in the 1-process run, so the
    first step's rewards are equal; the losses are those of one process."""
    import test_grpo_layouts as layouts  # module attribute: its tests are not collected again here

    def job(name):
        return grpo_runs[name], None

    for name in grpo_runs:
        layouts.test_first_minibatch_ratio_is_one(job, name)
    layouts.test_same_rollout_workers_give_the_same_run(job, "tp2_ep2_sp", "1proc")


# ----- Kimi-K2's tokenizer: custom code in the tokenizer folder, loaded only with model.trust_remote_code -----
CUSTOM_TOKENIZER = '''
from transformers import PreTrainedTokenizer


class TinyCharTokenizer(PreTrainedTokenizer):
    """a-z and space after 3 special tokens: stands in for Kimi-K2's tiktoken class (tokenization_kimi.py)."""

    def __init__(self, **kwargs):
        self._chars = ["<pad>", "<s>", "</s>"] + list("abcdefghijklmnopqrstuvwxyz ")
        self._ids = {c: i for i, c in enumerate(self._chars)}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self._chars)

    def get_vocab(self):
        return dict(self._ids)

    def _tokenize(self, text, **kwargs):
        return list(text)

    def _convert_token_to_id(self, token):
        return self._ids.get(token, 0)

    def _convert_id_to_token(self, index):
        return self._chars[index]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''

LOAD_OFFLINE = '''
import json, socket, sys

def no_network(*args, **kwargs):
    raise AssertionError("tried to reach the network")

socket.socket.connect = socket.create_connection = no_network
import megatron_rl.data.tokenizer as tokenizers
from megatron_rl.spec.errors import ConfigError

folder, result, out = sys.argv[1], sys.argv[2], {}
for name, detect in (("auto_map", True), ("transformers_error", False)):
    if not detect:  # the check transformers makes itself, when the auto_map check is bypassed
        tokenizers.ships_tokenizer_code = lambda path: False
    try:
        tokenizers.load_tokenizer(folder)
        out[name] = "loaded"
    except ConfigError as err:
        out[name] = str(err)
tok = tokenizers.load_tokenizer(folder, trust_remote_code=True)
ids = tok.encode("hi you", add_bos=True, add_eos=True)
out["loaded"] = {"class": type(tok.hf).__name__, "ids": ids, "text": tok.decode(ids), "vocab": tok.vocab_size,
                 "eos": tok.eos_id, "pad": tok.pad_id}
open(result, "w").write(json.dumps(out))  # not stdout: transformers prints its remote-code prompt there
'''


def test_tokenizer_with_custom_code_needs_trust_remote_code(tmp_path):
    """A folder whose tokenizer_config.json `auto_map`s AutoTokenizer to a class in the folder (as Kimi-K2's
    tiktoken tokenizer): refused with a one-line error naming model.trust_remote_code, by our auto_map check and
    by transformers' own; loaded with it; offline (HF_HUB_OFFLINE=1, sockets refused) in a fresh process."""
    import os
    import subprocess

    from helpers import REPO_ROOT

    from megatron_rl.spec.config.loader import load_config

    assert load_config().model.trust_remote_code is False
    assert load_config(overrides=["model.trust_remote_code=true"]).model.trust_remote_code is True
    folder = tmp_path / "kimi_like_tokenizer"
    folder.mkdir()
    (folder / "tiny_tokenizer.py").write_text(CUSTOM_TOKENIZER)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TinyCharTokenizer", "auto_map": {"AutoTokenizer": ["tiny_tokenizer.TinyCharTokenizer",
                                                                              None]},
        "pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", LOAD_OFFLINE, str(folder), str(tmp_path / "out.json")],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    for refused in (out["auto_map"], out["transformers_error"]):
        assert "model.trust_remote_code=true" in refused and "\n" not in refused, refused
    assert out["loaded"] == {"class": "TinyCharTokenizer", "ids": [1, 10, 11, 29, 27, 17, 23, 2], "text": "hi you",
                             "vocab": 30, "eos": 2, "pad": 0}
