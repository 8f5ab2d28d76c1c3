"""`python launch.py convert ...` end to end, and its answers to bad input (one line, exit 2, nothing published).

Run: .venv/bin/python -m pytest tests/test_conversion_cli.py -q

One tiny Qwen3 model goes HF -> Megatron (1 process) -> HF with --verify through the real CLI; the bad-input
cases reuse (copies of) those folders. The --slurm cases check the job script (--dry-run) and the refusals here;
tests/slurm/test_conversion_job.py submits a real conversion to the dev cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT, run_launch

from megatron_rl.spec.config.schema import ClusterConfig
from megatron_rl.spec.errors import ConfigError
from launcher.slurm.script import render_convert_script

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))

from convert_fixtures import make_hf_model  # noqa: E402


def _fails_cleanly(result, *needles, code=2):
    err = result.stderr.strip()
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def _no_leftovers(folder: Path) -> None:
    assert not folder.exists()
    assert not list(folder.parent.glob(f".{folder.name}.tmp-*"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    hf = make_hf_model("qwen3", root / "hf")
    imported = run_launch("convert", "hf-to-megatron", "--hf", str(hf), "--out", str(root / "ckpt"))
    assert imported.returncode == 0, imported.stdout + imported.stderr
    return root


def test_cli_round_trip_with_verify(converted):
    result = run_launch("convert", "megatron-to-hf", "--ckpt", str(converted / "ckpt"), "--out",
                        str(converted / "out"), "--verify", "--tolerance", "1e-4")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report) == {"max_abs_logit_diff", "argmax_agreement", "tensors_equal"}
    assert report["max_abs_logit_diff"] < 1e-4 and report["argmax_agreement"] == 1.0 and report["tensors_equal"]
    assert (converted / "out" / "config.json").is_file() and (converted / "out" / "tokenizer_config.json").is_file()
    assert json.loads((converted / "out" / "config.json").read_text())["head_dim"] == 32
    again = run_launch("convert", "megatron-to-hf", "--ckpt", str(converted / "ckpt"), "--out",
                       str(converted / "out"), "--shard-size", "50KB", "--overwrite")
    assert again.returncode == 0 and len(list((converted / "out").glob("model-*.safetensors"))) > 1


def test_failed_check_publishes_nothing(converted, tmp_path):
    from megatron_rl.conversion import export_checkpoint_to_hf

    def reject(folder):
        assert (folder / "model.safetensors.index.json").is_file()  # the complete export, not yet published
        raise RuntimeError("rejected")

    with pytest.raises(RuntimeError, match="rejected"):
        export_checkpoint_to_hf(converted / "ckpt", tmp_path / "out", check=reject)
    _no_leftovers(tmp_path / "out")


def test_existing_output_is_refused(converted):
    (converted / "taken").mkdir(exist_ok=True)
    result = run_launch("convert", "megatron-to-hf", "--ckpt", str(converted / "ckpt"), "--out",
                        str(converted / "taken"))
    _fails_cleanly(result, "already exists", "--overwrite")
    result = run_launch("convert", "hf-to-megatron", "--hf", str(converted / "hf"), "--out", str(converted / "taken"))
    _fails_cleanly(result, "already exists")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_launch("convert", "megatron-to-hf", "--ckpt", str(tmp_path / "empty"), "--out", str(tmp_path / "o"))
    _fails_cleanly(result, "not a checkpoint")
    result = run_launch("convert", "hf-to-megatron", "--hf", str(tmp_path / "empty"), "--out", str(tmp_path / "o"))
    _fails_cleanly(result, "no config.json")
    _no_leftovers(tmp_path / "o")


def test_unsupported_architecture_names_the_supported_ones(converted, tmp_path):
    hf = tmp_path / "gpt2"
    shutil.copytree(converted / "hf", hf)
    (hf / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    result = run_launch("convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "o"))
    _fails_cleanly(result, "unsupported architecture", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


def test_truncated_and_missing_hf_shards(converted, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(converted / "hf", hf)
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    result = run_launch("convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "o"))
    _fails_cleanly(result, "truncated", "model.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    result = run_launch("convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "o"))
    _fails_cleanly(result, "model-00002-of-00002.safetensors", "missing")
    _no_leftovers(tmp_path / "o")


def test_mismatched_hf_shapes(converted, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(converted / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (hf / "config.json").write_text(json.dumps(cfg))
    result = run_launch("convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "o"))
    _fails_cleanly(result, "mismatched shapes", "mlp.gate_proj.weight")


def test_damaged_megatron_checkpoints(converted, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted / "ckpt", ckpt)
    step = ckpt / "step_00000000"
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(step)).read_metadata().storage_data
    record = next(info for index, info in storage.items() if index.fqn.startswith("decoder.layers.")
                  and "_extra_state" not in index.fqn)
    shard = step / record.relative_path
    data = shard.read_bytes()
    start = record.offset  # one weight's record becomes unreadable; the file keeps its size
    shard.write_bytes(data[:start] + b"\xff" * 64 + data[start + 64:])
    result = run_launch("convert", "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "o"))
    _fails_cleanly(result, "damaged")
    _no_leftovers(tmp_path / "o")  # the failure came mid-export: the temp folder was removed
    shard.write_bytes(data[:-1000])
    result = run_launch("convert", "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "o"))
    _fails_cleanly(result, "truncated", shard.name)
    shard.unlink()
    result = run_launch("convert", "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "o"))
    _fails_cleanly(result, "missing", shard.name)
    _no_leftovers(tmp_path / "o")


def test_wrong_model_for_checkpoint(converted, tmp_path):
    result = run_launch("convert", "megatron-to-hf", "--ckpt", str(converted / "ckpt"), "--out", str(tmp_path / "o"),
                        "--model", "tiny-cpu")
    _fails_cleanly(result, "tiny-cpu")
    _no_leftovers(tmp_path / "o")


def test_bad_layout_is_refused_before_any_process(converted, tmp_path):
    result = run_launch("convert", "hf-to-megatron", "--hf", str(converted / "hf"), "--out", str(tmp_path / "o"),
                        "--tp", "3")
    _fails_cleanly(result, "--tp=3 does not divide the")


def test_convert_command_does_not_import_torch():
    code = ("import sys, launcher.cli.convert as c; c.build_parser(); "
            "import megatron_rl.conversion, megatron_rl.conversion.names, megatron_rl.conversion.importer; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_slurm_dry_run_prints_the_job_script_and_writes_nothing(tmp_path):
    hf, out = tmp_path / "it's $(touch PWNED)", tmp_path / "ckpt"
    result = run_launch("convert", "hf-to-megatron", "--hf", str(hf), "--out", str(out), "--tp", "2", "--dtype",
                        "bf16", "--slurm", "--dry-run", "cluster.partition=cpu", "cluster.cpus_per_task=16",
                        f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    cluster = ClusterConfig(partition="cpu", cpus_per_task=16, job_name="megatron-rl-convert")
    assert result.stdout == render_convert_script(cluster, run_dir=tmp_path / "run", python=sys.executable,
                                                  convert_args=["hf-to-megatron", "--hf", str(hf), "--out", str(out),
                                                                "--dtype", "bf16", "--tp", "2"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("args", "needle"), [
    (["--hf", "/models/a\n#SBATCH --x\ntouch PWNED", "--out", "o", "--slurm", "--dry-run"], "holds a line break"),
    (["--hf", "a", "--out", "o", "--dry-run"], "--dry-run applies to a Slurm job; add --slurm"),
    (["--hf", "a", "--out", "o", "cluster.partition=cpu"], "need --slurm"),
    (["--hf", "a", "--out", "o", "--slurm", "cluster.nodes=2"], "one CPU task on one node"),
    (["--hf", "a", "--out", "o", "--slurm", "model.name=x"], "takes cluster.* and run.dir overrides"),
    (["--hf", "a", "--out", "o", "--slurm", "--dry-run", "cluster.partiton=cpu"], "did you mean 'cluster.partition'"),
    (["--hf", "a", "--out", "o", "--slurm"], "convert --slurm needs `sbatch` on PATH"),
])
def test_slurm_conversion_refuses_bad_input_in_one_line(tmp_path, args, needle):
    result = run_launch("convert", "hf-to-megatron", *args, env={"PATH": str(tmp_path)})
    _fails_cleanly(result, needle)
    assert not list(tmp_path.iterdir()) and not (REPO_ROOT / "PWNED").exists()


def test_a_checkpoint_whose_common_state_runs_code_is_refused(tmp_path):
    """common.pt of a user-supplied --ckpt is read with torch.load(weights_only=True): a pickle that would run
    code on load is refused in one line, and the code does not run."""
    import pickle

    from megatron_rl.conversion.dist_reader import CheckpointReader

    class RunsCode:
        def __reduce__(self):
            return (exec, (f"open({str(tmp_path / 'ran')!r}, 'w').write('pwned')",))

    folder = tmp_path / "step_00000001"
    folder.mkdir()
    (folder / "common.pt").write_bytes(pickle.dumps({"step": 1, "extra": RunsCode()}))
    reader = CheckpointReader.__new__(CheckpointReader)
    reader.folder = folder
    with pytest.raises(ConfigError, match="unreadable common.pt"):
        reader.common_state()
    assert not (tmp_path / "ran").exists()
