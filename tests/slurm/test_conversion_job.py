"""`python launch.py convert ... --slurm --wait` on the real dev cluster: a tiny HF model becomes our checkpoint.

    slurm/dev-cluster.sh up && REQUIRE_SLURM=1 .venv/bin/python -m pytest tests/slurm/test_conversion_job.py -m slurm
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import DevCluster, Launcher

pytestmark = pytest.mark.slurm
REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tests" / "dist"))

from convert_fixtures import make_hf_model  # noqa: E402


def test_conversion_runs_as_a_one_task_slurm_job(launcher: Launcher, slurm_cluster: DevCluster,
                                                 tmp_path: Path) -> None:
    hf = make_hf_model("qwen3", tmp_path / "hf it's $(touch PWNED)")
    out, run_dir = tmp_path / "ckpt", tmp_path / "run"
    command = [sys.executable, "launch.py", "convert", "hf-to-megatron", "--hf", str(hf), "--out", str(out),
               "--slurm", "--wait", "cluster.time=00:10:00", f"run.dir={run_dir}"]
    first = subprocess.Popen(command, cwd=REPO_ROOT, env=launcher.env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        lock = run_dir / ".lock"
        deadline = time.monotonic() + 60
        while not (lock.exists() and "slurm_job_id" in lock.read_text()):
            assert time.monotonic() < deadline and first.poll() is None, f"no job id in {lock}"
            time.sleep(0.1)
        held_by = json.loads(lock.read_text())["slurm_job_id"]
        second = subprocess.run([arg for arg in command if arg != "--wait"], cwd=REPO_ROOT, env=launcher.env(),
                                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        stdout, stderr = first.communicate(timeout=240)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stdout + second.stderr
    assert second.stderr.startswith(f"error: run.dir={run_dir} is in use by Slurm job {held_by}"), second.stderr
    result = subprocess.CompletedProcess(command, first.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job_id = result.stdout.split("submitted Slurm job ", 1)[1].split()[0]
    assert held_by == job_id
    assert f"slurm: job {job_id} COMPLETED" in result.stdout
    assert "wrote " in (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert (out / "latest").is_file() and (out / "step_00000000").is_dir()
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    rows = slurm_cluster.run("sacct", "-n", "-P", "-j", job_id, "-o", "JobID,NNodes,NTasks,State").stdout
    assert f"{job_id}.0|1|1|COMPLETED" in rows.splitlines()
    assert not list(tmp_path.rglob("PWNED")) and not (REPO_ROOT / "PWNED").exists()
