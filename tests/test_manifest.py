"""The run's audit record (megatron_rl/runtime/manifest.py) without a training job: hashes against hashlib and
coreutils, the private atomic read-modify-write, secrets kept unresolved, attempts across a requeue, exports.

The real runs' manifests are checked in tests/test_local_runs.py (pretrain: preempted and resumed),
tests/test_grpo_run.py (GRPO: synthetic data hashes, four attempts) and tests/test_reliability_launcher.py (an
``oc.env`` secret is in no file of the run folder).

    .venv/bin/python -m pytest tests/test_manifest.py -q
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron_rl.spec.config import load_config
from megatron_rl.spec.config.loader import env_references, to_yaml
from megatron_rl.spec.errors import ConfigError
from megatron_rl.runtime import manifest as mf


def _tree(root: Path) -> Path:
    """A folder with nested files, one over the 1 MiB read chunk, one empty, names that sort differently as
    bytes and as lower-case text."""
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "B.txt").write_text("upper\n")
    (root / "a.txt").write_text("lower\n")
    (root / "sub" / "empty").write_bytes(b"")
    (root / "sub" / "deeper" / "big.bin").write_bytes(os.urandom(3 * mf.CHUNK + 5))
    return root


def test_file_hash_is_hashlib_over_its_bytes_across_chunks(tmp_path):
    path = tmp_path / "big.bin"
    data = os.urandom(2 * mf.CHUNK + 17)
    path.write_bytes(data)
    assert mf.content_hash(path) == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "files": 1}


def test_folder_hash_is_sha256sum_of_the_sorted_sha256sum_lines(tmp_path):
    root = _tree(tmp_path / "ckpt")
    got = mf.content_hash(root)
    script = "find . -type f -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum"
    coreutils = subprocess.run(["sh", "-c", script], cwd=root, capture_output=True, text=True, check=True)
    assert got["sha256"] == coreutils.stdout.split()[0]
    by_hand = "".join(f"{hashlib.sha256((root / rel).read_bytes()).hexdigest()}  {rel}\n"
                      for rel in ["B.txt", "a.txt", "sub/deeper/big.bin", "sub/empty"])
    assert got == {"sha256": hashlib.sha256(by_hand.encode()).hexdigest(), "files": 4,
                   "bytes": 6 + 6 + 3 * mf.CHUNK + 5}
    (root / "sub" / "empty").write_bytes(b"x")
    assert mf.content_hash(root)["sha256"] != got["sha256"], "a changed byte must change the folder hash"
    (root / "sub" / "empty").write_bytes(b"")
    (root / "sub" / "empty").rename(root / "sub" / "empty2")
    assert mf.content_hash(root)["sha256"] != got["sha256"], "a renamed file must change the folder hash"


def test_update_is_private_atomic_and_loses_no_concurrent_entry(tmp_path):
    run_dir = tmp_path / "run"
    mf.update_manifest(run_dir, lambda d: d.update(checkpoints=[]))
    path = run_dir / mf.MANIFEST_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    code = ("import sys; from megatron_rl.runtime.manifest import update_manifest\n"
            "for i in range(15): update_manifest(sys.argv[1], lambda d: d['checkpoints'].append(sys.argv[2]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(run_dir), name]) for name in ("p", "q")]
    threads = [threading.Thread(target=lambda: [mf.update_manifest(run_dir, lambda d: d["checkpoints"].append("t"))
                                                for _ in range(15)])]
    for thread in threads:
        thread.start()
    assert [proc.wait(timeout=60) for proc in procs] == [0, 0]
    threads[0].join()
    entries = json.loads(path.read_text())["checkpoints"]
    assert sorted(set(entries)) == ["p", "q", "t"] and len(entries) == 45
    assert sorted(p.name for p in run_dir.iterdir()) == [".manifest.lock", "manifest.json"]  # no temp file left
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ConfigError, match="symlink"):
        mf.update_manifest(run_dir, lambda d: None)
    assert not (tmp_path / "elsewhere.json").exists()


def _job(tmp_path, monkeypatch, *extra: str):
    """A config as the launcher writes it (config.yaml, oc.env kept) and the JobConfig the job loads from it."""
    monkeypatch.setenv("AUDIT_SECRET", "tok-9c1d-never-in-manifest")
    monkeypatch.setenv("AUDIT_PROJECT", "proj-secret-77f")
    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", "run.name=${oc.env:AUDIT_SECRET}",
                 "logging.wandb={project: '${oc.env:AUDIT_PROJECT}', mode: offline}", *extra]
    run_dir.mkdir(mode=0o700)
    config = run_dir / "config.yaml"
    config.write_text(to_yaml(load_config(None, overrides), env_references(None, overrides)))
    return load_config(config), config


def test_attempts_secrets_inputs_and_a_requeue(tmp_path, monkeypatch):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg, config = _job(tmp_path, monkeypatch, f"data.train_path={data}")
    ckpt = _tree(tmp_path / "run" / "checkpoints" / "step_00000002")
    for rank in (1, 3):  # torch_dist shards written by ranks 1 and 3 (rank 2 wrote none); rank 0 wrote the rest
        (ckpt / f"__{rank}_0.distcp").write_bytes(os.urandom(1000 + rank))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    first = mf.RunManifest(cfg, enabled=True, config_path=config)
    first.start(rank_hosts=["node-a", "node-a", "node-b", "node-a"])
    first.checkpoint_saved(ckpt, 2, save_s=0.5)
    for rank in (1, 2, 3):  # the other ranks hash what they wrote, in threads of their own
        other = mf.RunManifest(cfg, enabled=False, rank=rank)
        other.checkpoint_saved(ckpt, 2, save_s=0.5)
        other.finished("preempted")
    first.finished("preempted")
    killed = mf.RunManifest(cfg, enabled=True, config_path=config)
    killed.start(rank_hosts=["node-a"])  # and never finishes: SIGKILLed

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    second = mf.RunManifest(cfg, enabled=True, config_path=config)
    second.start(rank_hosts=["node-c"])
    second.resumed(2)
    (tmp_path / "run" / "export").mkdir()
    (tmp_path / "run" / "export" / "config.json").write_text("{}")
    second.export_written(ckpt, tmp_path / "run" / "export")
    second.finished("completed")
    mf.RunManifest(cfg, enabled=False).start(rank_hosts=["x"])  # another rank writes nothing

    text = (tmp_path / "run" / mf.MANIFEST_FILE).read_text()
    assert "tok-9c1d-never-in-manifest" not in text and "proj-secret-77f" not in text
    record = json.loads(text)
    assert record["config"]["run"]["name"] == "${oc.env:AUDIT_SECRET}"
    assert record["config"]["logging"]["wandb"]["project"] == "${oc.env:AUDIT_PROJECT}"
    assert record["config"]["data"]["train_path"] == str(data) and record["config"]["run"]["steps"] == cfg.run.steps
    assert [(a["index"], a["status"], a["resumed_from_step"]) for a in record["attempts"]] == [
        (1, "preempted", None), (2, "lost: ended without recording its end", None), (3, "completed", 2)]
    assert record["attempts"][0]["hosts"] == {"node-a": "0-1,3", "node-b": "2"}
    assert record["attempts"][0]["slurm"] is None and record["attempts"][2]["slurm"]["job_id"] == "4242"
    assert record["requeues"] == 1 and record["slurm_job_ids"] == ["4242"]
    assert record["started_at"] == record["attempts"][0]["started_at"]
    assert record["ended_at"] == record["attempts"][2]["ended_at"] >= record["attempts"][2]["started_at"]
    train = [e for e in record["inputs"] if e["key"] == "data.train_path"]
    assert train == [{"key": "data.train_path", "path": str(data), "bytes": data.stat().st_size, "files": 1,
                      "sha256": hashlib.sha256(data.read_bytes()).hexdigest(), "attempt": 1}], "unchanged: once"
    # composed from the four ranks' parts: the hash of the whole folder
    assert [(c["step"], c["sha256"], c["files"], c["hash"], c["attempt"]) for c in record["checkpoints"]] == [
        (2, mf.content_hash(ckpt)["sha256"], 6, "hashed", 1)]
    assert [(e["checkpoint"], e["sha256"], e["attempt"]) for e in record["exports"]] == [
        (str(ckpt), mf.content_hash(tmp_path / "run" / "export")["sha256"], 3)]
    assert record["packages"]["omegaconf"] and record["python"] == sys.version.split()[0]


def test_convert_records_its_export_in_the_run_the_checkpoint_came_from(tmp_path, monkeypatch):
    cfg, config = _job(tmp_path, monkeypatch)
    writer = mf.RunManifest(cfg, enabled=True, config_path=config)
    writer.start(rank_hosts=["h"])
    writer.finished("completed")
    ckpt = _tree(tmp_path / "run" / "checkpoints" / "step_00000003")
    (ckpt.parent / "latest").write_text("step_00000003\n")
    out = _tree(tmp_path / "hf")
    assert mf.record_export(ckpt.parent, out) == tmp_path / "run" / mf.MANIFEST_FILE
    exports = json.loads((tmp_path / "run" / mf.MANIFEST_FILE).read_text())["exports"]
    assert [(e["path"], e["checkpoint"], e["sha256"]) for e in exports] == [
        (str(out), str(ckpt), mf.content_hash(out)["sha256"])]
    lone = _tree(tmp_path / "elsewhere" / "step_00000001")
    assert mf.record_export(lone, out) is None


def test_source_state_reads_the_commit_and_dirty_flag(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "f.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert mf.source_state(repo) == {"path": str(repo), "commit": head, "dirty": False, "changes": []}
    (repo / "f.py").write_text("x = 2\n")
    assert mf.source_state(repo)["dirty"] is True and mf.source_state(repo)["changes"] == [" M f.py"]
    inside = repo / "sub"
    inside.mkdir()
    assert mf.source_state(inside)["commit"] is None, "a folder inside someone else's checkout is not a checkout"
    assert mf.source_state(tmp_path)["commit"] is None


def test_a_hash_not_in_time_or_a_retired_folder_is_recorded_and_nothing_waits_longer(tmp_path, monkeypatch):
    """checkpoint.hash_wait_s bounds the wait at the end: a rank that never reports (killed, or hashing 10 TB) is
    named and the checkpoint recorded unhashed; a folder retention deleted before its rank hashed it is recorded
    as such; checkpoint.hash=false records checkpoints unhashed and starts no hashing."""
    import time

    cfg, config = _job(tmp_path, monkeypatch, "checkpoint.hash_wait_s=1")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    kept = _tree(tmp_path / "run" / "checkpoints" / "step_00000004")
    gone = tmp_path / "run" / "checkpoints" / "step_00000002"  # retired before its hash: the folder is gone
    manifest = mf.RunManifest(cfg, enabled=True, config_path=config)
    manifest.start(rank_hosts=["node-a", "node-a"])  # rank 1 never hashes
    manifest.checkpoint_saved(gone, 2, save_s=0.1)
    manifest.checkpoint_saved(kept, 4, save_s=0.1)
    begun = time.monotonic()
    manifest.finished("completed")
    assert time.monotonic() - begun < 10
    entries = json.loads((tmp_path / "run" / mf.MANIFEST_FILE).read_text())["checkpoints"]
    assert [(e["step"], e["sha256"], e["hash"]) for e in entries] == [
        (2, None, mf.RETIRED), (4, None, "not hashed within checkpoint.hash_wait_s=1: ranks 1")]
    assert not (tmp_path / "run" / mf.HASHES_DIR).exists() or not any((tmp_path / "run" / mf.HASHES_DIR).iterdir())

    (tmp_path / "off").mkdir()
    off, _ = _job(tmp_path / "off", monkeypatch, "checkpoint.hash=false")
    unhashed = mf.RunManifest(off, enabled=True)
    unhashed.start(rank_hosts=["node-a"])
    unhashed.checkpoint_saved(kept, 4, save_s=0.1)
    unhashed.finished("completed")
    assert unhashed.shards._thread is None
    entry, = json.loads((tmp_path / "off" / "run" / mf.MANIFEST_FILE).read_text())["checkpoints"]
    assert (entry["sha256"], entry["hash"]) == (None, "off")


def test_a_checkpoint_a_killed_attempt_left_unhashed_is_hashed_by_the_next(tmp_path, monkeypatch):
    """An attempt SIGKILLed while its ranks still hashed leaves the entry pending; the next attempt hashes that
    folder whole (its writers are gone) in the background, so every checkpoint on disk ends up with its hash."""
    cfg, config = _job(tmp_path, monkeypatch)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    folder = _tree(tmp_path / "run" / "checkpoints" / "step_00000002")
    killed = mf.RunManifest(cfg, enabled=True, config_path=config)
    killed.start(rank_hosts=["node-a", "node-a"])  # rank 1 never reports
    killed.checkpoint_saved(folder, 2, save_s=0.1)
    killed.wait()  # the pending entry is written; then the process dies without finishing
    entry, = json.loads((tmp_path / "run" / mf.MANIFEST_FILE).read_text())["checkpoints"]
    assert entry["hash"] == "pending"
    rerun = mf.RunManifest(cfg, enabled=True, config_path=config)
    rerun.start(rank_hosts=["node-a"])
    rerun.finished("completed")
    entry, = json.loads((tmp_path / "run" / mf.MANIFEST_FILE).read_text())["checkpoints"]
    assert (entry["hash"], entry["sha256"]) == ("hashed", mf.content_hash(folder)["sha256"])
