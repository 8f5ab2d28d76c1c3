"""Helpers shared by the tests: run launch.py (the real CLI) in a subprocess and read a run's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MEASURED_KEYS = ("step_time_s", "tokens_per_s", "time_generate_s", "time_score_s", "time_train_s", "time_eval_s",
                 "generate_tokens_per_s", "train_tokens_per_s")
"""metrics.jsonl keys that differ between identical runs (wall times and throughput), with peak_memory_*."""


def without_measurements(metrics: list[dict]) -> list[dict]:
    """metrics.jsonl lines without what identical runs do not share: MEASURED_KEYS and peak_memory_* (RSS)."""
    return [{k: v for k, v in m.items() if k not in MEASURED_KEYS and not k.startswith("peak_memory_")}
            for m in metrics]


def run_launch(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python launch.py ARGS` from the repo root; returns the completed process (text output)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(REPO_ROOT / "launch.py"), *args], cwd=REPO_ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def torchrun_check(script: str, out: Path, *args: str, nproc: int = 2) -> list[dict]:
    """Run ``tests/dist/<script> --out OUT ARGS`` on ``nproc`` local gloo ranks; each rank's ``OUT/rank{R}.json``."""
    from launcher.ports import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), str(REPO_ROOT / "tests" / "dist" / script), "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
