"""The streamed import (``megatron_rl.conversion.streamed_save``) writes what Megatron itself writes, and holds about
one tensor at a time.

* A tiny Qwen3-MoE model is imported at TP2·PP2·EP2 (meta-device model, shards read from the HF files as they are
  written), then loaded through Megatron (``load_checkpoint``) and saved again by Megatron's own save at the same
  layout and at TP1: the ``.metadata`` of the import and of Megatron's save hold the same keys, global shapes,
  chunks and dtypes, and every tensor of all three equals the HF weights fused the Megatron way.
* Peak memory: a model 8x its largest tensor is imported by one process; its peak RSS above the same import of a
  tiny model stays under 5x the largest tensor (measured 2.5x; the in-memory import held the whole model: >8x).

Run: ``.venv/bin/python -m pytest tests/test_streaming_import.py -q`` (~2 minutes on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))
sys.path.insert(0, str(REPO))

from convert_fixtures import make_hf_model  # noqa: E402

from megatron_rl.conversion.spawn import run_worker  # noqa: E402

LAYOUTS = {"streamed": (2, 2, 2), "megatron": (2, 2, 2), "megatron_tp1": (1, 1, 1)}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed")
    hf = make_hf_model("qwen3_moe", root / "hf")
    tasks = [{"kind": "import", "hf": str(hf), "out": str(root / "streamed"), "tp": 2, "pp": 2, "ep": 2}]
    for name in ("megatron", "megatron_tp1"):
        tp, pp, ep = LAYOUTS[name]
        tasks.append({"kind": "reshard", "ckpt": str(root / "streamed"), "out": str(root / name), "tp": tp, "pp": pp,
                      "ep": ep})
    run_worker(tasks, 4, workdir=root / "worker", timeout=600)
    return root


def _metadata(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_rl.runtime.checkpoint import resolve_checkpoint

    return FileSystemReader(str(resolve_checkpoint(folder))).read_metadata()


def _chunks(md) -> dict:
    out = {}
    for key, entry in md.state_dict_metadata.items():
        if hasattr(entry, "chunks"):
            out[key] = (tuple(entry.size), entry.properties.dtype,
                        sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks))
        else:
            out[key] = "bytes"
    return out


def test_metadata_equals_megatrons_own_save(imported):
    streamed, megatron = _metadata(imported / "streamed"), _metadata(imported / "megatron")
    assert _chunks(streamed) == _chunks(megatron)
    assert any(key.startswith("decoder.layers.1.mlp.experts.") for key in _chunks(streamed))
    step = imported / "streamed" / "step_00000000"
    assert (imported / "streamed" / "latest").read_text().strip() == "step_00000000"
    assert json.loads((step / "saved.json").read_text())["step"] == 0
    assert json.loads((step / "metadata.json").read_text()) == json.loads(
        (imported / "megatron" / "step_00000000" / "metadata.json").read_text())
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(step))  # Megatron's own reader (in the shards from 0.19)
    assert common["step"] == 0 and common["extra"]["model"]["shape"]["num_experts"] == 4


@pytest.mark.parametrize("name", ["streamed", "megatron", "megatron_tp1"])
def test_every_tensor_equals_the_hf_weights(imported, name):
    from safetensors.torch import load_file

    from megatron_rl.conversion.dist_reader import CheckpointReader
    from megatron_rl.conversion.mapping import megatron_from_hf
    from megatron_rl.conversion.names import shape_from_config, tensor_maps

    hf = load_file(str(imported / "hf" / "model.safetensors"))
    shape = shape_from_config(json.loads((imported / "hf" / "config.json").read_text()), "hf")
    reader = CheckpointReader(imported / name)
    maps = tensor_maps(shape)
    assert {tm.ref for tm in maps} == set(reader.index)
    stored = reader.read([tm.ref for tm in maps])
    for tm in maps:
        want = megatron_from_hf(tm, shape, hf, padded_rows=reader.index[tm.ref].shape[0])
        assert torch.equal(stored[tm.ref], want), tm.ref


MEMORY_CASE = dict(hidden=512, layers=8, experts=16, moe_ffn=1024, heads=4, kv_heads=2, head_dim=128, vocab=65536)
TINY_CASE = dict(hidden=128, layers=2, experts=4, moe_ffn=64, heads=4, kv_heads=2, head_dim=32, vocab=1024)
PEAK_OF_ONE_IMPORT = """
import json, resource, sys
from megatron_rl.conversion import import_hf_to_megatron
import_hf_to_megatron(sys.argv[1], sys.argv[2])
print(json.dumps(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
"""


def _peak_rss_of_import(hf: Path, out: Path) -> int:
    """Peak RSS of the (single) worker process of an import at TP1: the largest child of a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", PEAK_OF_ONE_IMPORT, str(hf), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip().splitlines()[-1])


def test_peak_memory_is_a_few_largest_tensors_not_the_model(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from convert_import import qwen3_moe_config, write_random_hf

    sizes = write_random_hf(tmp_path / "hf", qwen3_moe_config(**MEMORY_CASE))
    write_random_hf(tmp_path / "hf_tiny", qwen3_moe_config(**TINY_CASE))
    largest, model = max(sizes.values()), sum(sizes.values())
    assert model > 7 * largest
    above_fixed_cost = (_peak_rss_of_import(tmp_path / "hf", tmp_path / "mg")
                        - _peak_rss_of_import(tmp_path / "hf_tiny", tmp_path / "mg_tiny"))
    assert above_fixed_cost < 5 * largest, (above_fixed_cost / largest, model / largest)
