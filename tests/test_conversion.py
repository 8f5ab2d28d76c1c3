"""HF -> Megatron (TP=2 x PP=2, EP=2 for MoE) -> HF round trips of every family, checked by tensors and logits.

Run: .venv/bin/python -m pytest tests/test_conversion.py -q

Tiny random-weight models are built with transformers from configs in tests/dist/convert_fixtures.py (no
downloads). ONE torchrun job of 4 CPU processes runs every Megatron-side step (imports, a native TP=2 model, its
TP=1 reshard, a reward model, logits at TP=2 x PP=2); the exports then run here, in-process, without any model.
Each peer bug named in the issue has its own test: MoE expert key names, expert gathering at EP>1, TP>1 export
equal to TP=1, no padded vocabulary rows, the tied lm_head.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))

from convert_fixtures import TINY_HF, TOKENIZER_FILES, make_hf_model  # noqa: E402

from megatron_rl.conversion import export_checkpoint_to_hf  # noqa: E402
from megatron_rl.conversion.dist_reader import CheckpointReader  # noqa: E402
from megatron_rl.conversion.spawn import run_worker  # noqa: E402
from megatron_rl.conversion.verify import compare_with_hf, prompt_tokens  # noqa: E402

FAMILIES = list(TINY_HF)
MOE = {"qwen3_moe", "mixtral"}
FIXTURE_SCRIPT = str(Path(__file__).resolve().parent / "dist" / "convert_fixtures.py")


def _layout(kind: str) -> dict:
    return {"tp": 2, "pp": 2, "ep": 2 if kind in MOE else 1}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("conversion")
    tasks = []
    for kind in FAMILIES:
        hf = make_hf_model(kind, root / f"hf_{kind}")
        vocab = TINY_HF[kind][2]["vocab_size"]
        tasks.append({"kind": "import", "hf": str(hf), "out": str(root / f"mg_{kind}"), **_layout(kind)})
        tasks.append({"kind": "logits", "ckpt": str(root / f"mg_{kind}"), "tokens": prompt_tokens(vocab),
                      "out_file": str(root / f"logits_{kind}.pt"), **_layout(kind)})
    tokens = prompt_tokens(128)
    tasks += [
        {"kind": "random", "model": "tiny-cpu", "out": str(root / "native_tp2"), "tp": 2, "pp": 2, "ep": 1,
         "seed": 3, "record_model": False},
        {"kind": "reshard", "ckpt": str(root / "native_tp2"), "model": "tiny-cpu", "out": str(root / "native_tp1"),
         "tp": 1, "pp": 1, "ep": 1},
        {"kind": "logits", "ckpt": str(root / "native_tp2"), "model": "tiny-cpu", "tokens": tokens,
         "out_file": str(root / "logits_native.pt"), "tp": 2, "pp": 2, "ep": 1},
        {"kind": "reward_fixture", "hf": str(root / "hf_llama"), "out": str(root / "rm"), "tp": 2, "pp": 1,
         "ep": 1, "tokens": prompt_tokens(100), "out_file": str(root / "rm_rewards.pt")},
        {"kind": "logits", "ckpt": str(root / "rm"), "tokens": prompt_tokens(100),
         "out_file": str(root / "logits_rm.pt"), "tp": 2, "pp": 2, "ep": 1},
    ]
    run_worker(tasks, 4, workdir=root / "worker", timeout=900, script=FIXTURE_SCRIPT)
    return root


def _read_folder(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.fixture(scope="module")
def exports(work):
    return {kind: export_checkpoint_to_hf(work / f"mg_{kind}", work / f"out_{kind}", shard_size="40KB")
            for kind in FAMILIES}


@pytest.mark.parametrize("kind", FAMILIES)
def test_round_trip_is_bit_identical(work, exports, kind):
    original, exported = _read_folder(work / f"hf_{kind}"), _read_folder(work / f"out_{kind}")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    index = json.loads((work / f"out_{kind}" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    shards = sorted(p.name for p in (work / f"out_{kind}").glob("model-*.safetensors"))
    assert len(shards) == exports[kind].num_shards > 1 and shards[-1].endswith(f"of-{len(shards):05d}.safetensors")
    for name, text in TOKENIZER_FILES.items():
        assert (work / f"out_{kind}" / name).read_text() == text


@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_match_transformers(work, exports, kind):
    """Megatron at TP=2 x PP=2 (EP=2) on our checkpoint vs transformers on the ORIGINAL and on the export."""
    megatron = torch.load(work / f"logits_{kind}.pt", weights_only=True)
    tokens = prompt_tokens(TINY_HF[kind][2]["vocab_size"])
    original = transformers.AutoModelForCausalLM.from_pretrained(str(work / f"hf_{kind}"), dtype=torch.float32)
    with torch.no_grad():
        reference = original.eval()(torch.tensor(tokens)).logits
    assert reference.shape == megatron["logits"].shape
    assert float((reference - megatron["logits"]).abs().max()) < 1e-4
    report = compare_with_hf(megatron, work / f"out_{kind}", tokens, tolerance=1e-4)
    assert report["ok"] and report["tensors_equal"], report
    assert report["max_abs_logit_diff"] < 1e-4 and report["argmax_agreement"] == 1.0


@pytest.mark.parametrize("kind", sorted(MOE))
def test_moe_expert_keys_and_ep_gathering(work, exports, kind):
    """Keys are experts.E.<proj>.weight (not experts.<proj>.weight0), every expert of every MoE layer is there,
    and the checkpoint really was split: each EP rank saved half of the experts."""
    exported = _read_folder(work / f"out_{kind}")
    proj = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    moe_layers = [0, 1] if kind == "mixtral" else [1]  # qwen3_moe keeps layer 0 dense (mlp_only_layers)
    expected = {f"model.layers.{layer}.{block}.experts.{e}.{p}.weight"
                for layer in moe_layers for e in range(4) for p in proj}
    assert expected <= set(exported)
    assert not [k for k in exported if "experts" in k and not k.endswith(".weight")]
    original = _read_folder(work / f"hf_{kind}")
    assert all(torch.equal(exported[k], original[k]) for k in expected)
    reader = CheckpointReader(work / f"mg_{kind}")
    key = f"decoder.layers.{moe_layers[-1]}.mlp.experts.experts.linear_fc2.weight"
    chunks = reader.metadata.state_dict_metadata[key].chunks
    saving_ranks = {reader.metadata.storage_data[idx].relative_path.split("_")[2]  # files are __<rank>_<n>.distcp
                    for idx in reader.metadata.storage_data if idx.fqn == key}
    assert sorted(c.offsets[0] for c in chunks) == [0, 1, 2, 3] and len(saving_ranks) == 2


def test_kernel_copies_equal_the_in_memory_path(work, exports):
    """Most bytes of a TP=2 x PP=2 checkpoint are copied file to file (copy_file_range); the same export through
    memory only gives identical files."""
    assert 0 < exports["qwen3"].bytes_copied_in_kernel < exports["qwen3"].bytes_written  # o_proj/down_proj: memory
    slow = export_checkpoint_to_hf(work / "mg_qwen3", work / "out_qwen3_memory", shard_size="40KB",
                                   kernel_copy=False)
    assert slow.bytes_copied_in_kernel == 0
    for path in sorted((work / "out_qwen3").glob("*.safetensors")):
        assert path.read_bytes() == (work / "out_qwen3_memory" / path.name).read_bytes()


def test_export_without_torch_equals_the_torch_load_path(work, exports, tmp_path, monkeypatch):
    """A TP=2 x PP=2 export imports neither torch nor Megatron (its own process, checked in sys.modules), and
    gives the same files as the in-process export and as one that reads every chunk with torch.load instead of
    from its raw bytes (the fallback for records of an unusual form)."""
    step = CheckpointReader(work / "mg_qwen3").folder
    script = (f"import sys; from megatron_rl.conversion import export_checkpoint_to_hf; "
              f"export_checkpoint_to_hf({str(step)!r}, {str(tmp_path / 'no_torch')!r}, shard_size='40KB'); "
              f"print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", f"imported: {result.stdout[:500]}"

    monkeypatch.setattr(CheckpointReader, "_raw_offset", lambda self, info, sizes, dtype: None)
    torch_path = export_checkpoint_to_hf(step, tmp_path / "torch_load", shard_size="40KB")
    assert torch_path.bytes_copied_in_kernel == 0
    names = sorted(p.name for p in (work / "out_qwen3").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "no_torch").iterdir()) == \
        sorted(p.name for p in (tmp_path / "torch_load").iterdir())
    for name in names:
        reference = (work / "out_qwen3" / name).read_bytes()
        assert (tmp_path / "no_torch" / name).read_bytes() == reference, name
        assert (tmp_path / "torch_load" / name).read_bytes() == reference, name


def test_bf16_export_matches_torch_cast(work, exports, tmp_path):
    """--dtype bf16 (tensors cast in memory) gives torch's bf16 of every original tensor."""
    export_checkpoint_to_hf(work / "mg_llama", tmp_path / "bf16", shard_size="40KB", dtype="bf16")
    original, exported = _read_folder(work / "hf_llama"), _read_folder(tmp_path / "bf16")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_tp2_export_equals_tp1_export(work):
    """A model trained/saved at TP=2 x PP=2 and the same weights resharded to TP=1 export to identical files,
    and the TP=2 Megatron logits match transformers on the export (model described by --model tiny-cpu)."""
    a = export_checkpoint_to_hf(work / "native_tp2", work / "out_native_tp2", model="tiny-cpu")
    b = export_checkpoint_to_hf(work / "native_tp1", work / "out_native_tp1", model="tiny-cpu")
    ta, tb = _read_folder(a.out_dir), _read_folder(b.out_dir)
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    megatron = torch.load(work / "logits_native.pt", weights_only=True)
    report = compare_with_hf(megatron, a.out_dir, prompt_tokens(128), tolerance=1e-4)
    assert report["ok"] and report["argmax_agreement"] == 1.0, report


def test_no_padded_vocab_rows(work, exports):
    """The checkpoint holds 128 (padded) rows; exports hold exactly vocab_size rows, padding rows were zero."""
    reader = CheckpointReader(work / "mg_llama")
    stored = reader.read([ref for ref in reader.index if ref.name in ("embedding.word_embeddings.weight",
                                                                      "output_layer.weight")])
    assert {tuple(t.shape) for t in stored.values()} == {(128, 64)}
    assert all(torch.count_nonzero(t[100:]) == 0 for t in stored.values())
    for kind in FAMILIES:
        exported = _read_folder(work / f"out_{kind}")
        vocab = TINY_HF[kind][2]["vocab_size"]
        assert exported["model.embed_tokens.weight"].shape[0] == vocab
        assert "lm_head.weight" not in exported or exported["lm_head.weight"].shape[0] == vocab


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_tied_lm_head_survives(work, exports, kind):
    exported = _read_folder(work / f"out_{kind}")
    assert "lm_head.weight" not in exported
    config = json.loads((work / f"out_{kind}" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    model = transformers.AutoModelForCausalLM.from_pretrained(str(work / f"out_{kind}"), dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, exported["model.embed_tokens.weight"])


def test_reward_model_exports_as_sequence_classification(work):
    """Our reward model (megatron_rl.models.reward_model, TP=2) -> LlamaForSequenceClassification whose score
    plus the recorded bias equals the rewards our model computed; Megatron side re-run at TP=2 x PP=2 agrees."""
    summary = export_checkpoint_to_hf(work / "rm", work / "out_rm")
    assert summary.architecture == "LlamaForSequenceClassification" and summary.notes
    config = json.loads((work / "out_rm" / "config.json").read_text())
    assert config["num_labels"] == 1 and config["reward_bias"] == pytest.approx(0.25)
    exported = _read_folder(work / "out_rm")
    fixture = torch.load(work / "rm_rewards.pt", weights_only=True)
    assert torch.equal(exported["score.weight"], fixture["head"]["rm_head.weight"])
    assert "lm_head.weight" not in exported
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(work / "out_rm"),
                                                                            dtype=torch.float32).eval()
    model.config.pad_token_id = -1
    with torch.no_grad():
        scores = model(torch.tensor(prompt_tokens(100))).logits.reshape(-1)
    assert float((scores + 0.25 - fixture["rewards"]).abs().max()) < 1e-4
    megatron = torch.load(work / "logits_rm.pt", weights_only=True)
    assert float((megatron["rewards"] - fixture["rewards"]).abs().max()) < 1e-4
    report = compare_with_hf(megatron, work / "out_rm", prompt_tokens(100), tolerance=1e-4, reward_bias=0.25)
    assert report["ok"] and report["tensors_equal"], report
