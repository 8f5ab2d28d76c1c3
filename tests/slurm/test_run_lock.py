"""One job per run folder on Slurm: the lock names the submitted job while Slurm runs it, and is free once it ended.

    slurm/dev-cluster.sh up && REQUIRE_SLURM=1 .venv/bin/python -m pytest tests/slurm/test_run_lock.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from launcher.lock import acquire

if TYPE_CHECKING:
    from conftest import Launcher

REPO_ROOT = Path(__file__).resolve().parents[2]
LONG_JOB = ("cluster.executor=slurm", "cluster.nodes=2", "cluster.tasks_per_node=1", "parallel.tp=2",
            "algorithm.name=pretrain", "run.steps=100000")


@pytest.mark.slurm
def test_a_second_launch_is_refused_while_the_job_runs_and_free_after_it_ended(launcher: Launcher,
                                                                              tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    started = launcher.start(*LONG_JOB, run_dir=run_dir)
    try:
        job_id = started.job_id()
        launcher.cluster.wait_running(job_id, timeout=120)
        holder = json.loads((run_dir / ".lock").read_text())
        assert holder["slurm_job_id"] == job_id
        config = (run_dir / "config.yaml").read_text()
        second = subprocess.run([sys.executable, str(REPO_ROOT / "launch.py"), *LONG_JOB, "run.steps=5",
                                 f"run.dir={run_dir}"], cwd=REPO_ROOT, env=launcher.env(), capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert second.stderr.startswith(f"error: run.dir={run_dir} is in use by Slurm job {job_id}"), second.stderr
        assert f"scancel {job_id}" in second.stderr and second.stderr.count("\n") == 1
        assert (run_dir / "config.yaml").read_text() == config, "the refused launch rewrote config.yaml"
    finally:
        launcher.cluster.run("scancel", started.job_id(), check=False)
        launcher.finish(started, timeout=120)
    assert launcher.cluster.wait_sacct_state(job_id) == "CANCELLED"
    acquire(run_dir).release()  # the job ended: its lock is stale and taken over
    assert not (run_dir / ".lock").exists()
