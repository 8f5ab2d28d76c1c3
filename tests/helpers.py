"""Helpers shared by the tests: run launch.py (the real CLI) in a subprocess and read a run's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SESSION_MARKER = "MEGATRON_RL_TEST_SESSION"
"""Environment variable holding the test session's id: a process that carries it after the session ended is a leak
(tests/conftest.py)."""
MEASURED_KEYS = ("step_time_s", "tokens_per_s", "time_generate_s", "time_score_s", "time_train_s", "time_eval_s",
                 "generate_tokens_per_s", "train_tokens_per_s")
"""metrics.jsonl keys that differ between identical runs (wall times and throughput), with peak_memory_*."""


def without_measurements(metrics: list[dict]) -> list[dict]:
    """metrics.jsonl lines without what identical runs do not share: MEASURED_KEYS and peak_memory_* (RSS); and
    without offload_* (bytes and seconds of generation.offload_optimizer, which the resume tests compare runs
    with and without)."""
    return [{k: v for k, v in m.items()
             if k not in MEASURED_KEYS and not k.startswith(("peak_memory_", "offload_"))} for m in metrics]


def run_launch(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python launch.py ARGS` from the repo root; returns the completed process (text output)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(REPO_ROOT / "launch.py"), *args], cwd=REPO_ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def torchrun_check(script: str, out: Path, *args: str, nproc: int = 2, timeout: float = 300) -> list[dict]:
    """Run ``tests/dist/<script> --out OUT ARGS`` on ``nproc`` local gloo ranks with torchrun's environment
    (``megatron_rl.spec.local_ranks``, as the local executor starts a job); each rank's ``OUT/rank{R}.json``."""
    from megatron_rl.spec.local_ranks import kill_leftovers, start_ranks, watch
    from megatron_rl.spec.ports import free_port

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO_ROOT / "tests" / "dist" / script), "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    logs = [(out / f"rank{rank}.log").open("w+") for rank in range(nproc)]
    procs = start_ranks(cmd, nproc, port=free_port(), env=env, stdout=logs, cwd=str(REPO_ROOT))
    try:
        code = watch(procs, timeout=timeout)
    finally:
        kill_leftovers(procs)
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    assert code == 0, f"exit code {code}:\n" + "\n".join(f"--- rank {r}\n{t[-4000:]}" for r, t in enumerate(texts))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def read_manifest(run_dir: Path) -> dict:
    """run.dir/manifest.json (megatron_rl/runtime/manifest.py), after checking that it is private (0600)."""
    path = Path(run_dir) / "manifest.json"
    assert path.stat().st_mode & 0o777 == 0o600, oct(path.stat().st_mode)
    return json.loads(path.read_text())


def folder_sha256(folder: Path) -> str:
    """The manifest's folder hash, computed here independently: sha256 of the `sha256sum` lines of the folder's
    files sorted by relative path."""
    import hashlib

    files = sorted((p for p in Path(folder).rglob("*") if p.is_file()), key=lambda p: p.relative_to(folder).as_posix())
    lines = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(folder).as_posix()}\n"
                    for p in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def check_run_manifest(run_dir: Path, *, statuses: list[str]) -> dict:
    """The manifest of a finished local run: one attempt per start with these statuses, this checkout's commit and
    the installed versions, and every checkpoint folder that is still on disk listed with its hash."""
    from importlib import metadata

    manifest = read_manifest(run_dir)
    assert [a["status"] for a in manifest["attempts"]] == statuses
    assert all(a["started_at"] <= a["ended_at"] for a in manifest["attempts"] if not a["status"].startswith("lost"))
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert manifest["source"]["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    for name in ("torch", "megatron-core", "transformers", "omegaconf"):
        assert manifest["packages"][name] == metadata.version(name), name
    on_disk = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if p.is_dir())
    listed = {}
    for entry in manifest["checkpoints"]:  # the newest entry of a folder saved twice
        listed[str(Path(entry["path"]).resolve())] = entry
    assert on_disk and {str(p.resolve()) for p in on_disk} <= set(listed)
    for folder in on_disk:
        assert listed[str(folder.resolve())]["sha256"] == folder_sha256(folder), folder
    return manifest
