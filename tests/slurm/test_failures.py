"""Failures are reported, not hung on: cancel, a node going DOWN, a crashing rank, a stopped rank, missing Slurm
tools, bad keys.

    slurm/dev-cluster.sh up && REQUIRE_SLURM=1 .venv/bin/python -m pytest tests/slurm/test_failures.py
    .venv/bin/python -m pytest tests/slurm/test_failures.py -m "not slurm"      # the ones that need no cluster

Each cluster test starts `launch.py ... --wait`, breaks the running job, and checks that launch.py ends with a
clear message and a non-zero exit within a bound far below a collective timeout (300 s here, 30 min usually).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import DevCluster, Launcher, StartedLaunch

REPO_ROOT = Path(__file__).resolve().parents[2]
ENDS_WITHIN_S = 60.0
LONG_JOB = ("cluster.executor=slurm", "cluster.nodes=2", "cluster.tasks_per_node=1", "parallel.tp=2",
            "algorithm.name=pretrain", "run.steps=100000")


def _launch_without_cluster(tmp_path: Path, *args: str, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    options = [arg for arg in args if arg.startswith("--")]  # launch.py wants its overrides in one run
    overrides = [arg for arg in args if not arg.startswith("--")]
    return subprocess.run([sys.executable, str(REPO_ROOT / "launch.py"), *options, *overrides,
                           f"run.dir={tmp_path / 'run'}"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_missing_sbatch_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = _launch_without_cluster(tmp_path, "cluster.executor=slurm", path=str(tmp_path / "empty"))
    assert result.returncode == 2
    assert result.stderr == ("error: cluster.executor=slurm needs `sbatch`, `srun`, `scontrol` on PATH, which this "
                             "machine lacks; run from a Slurm login node (with accounting for --wait) or set "
                             "cluster.executor=local\n")
    assert not (tmp_path / "run").exists()


def test_missing_sacct_with_wait_is_a_clear_error_before_submitting(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun", "scontrol", "squeue"):
        (bin_dir / tool).write_text(f"#!/bin/sh\ntouch {tmp_path}/called-{tool}\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    result = _launch_without_cluster(tmp_path, "cluster.executor=slurm", "--wait", path=str(bin_dir))
    assert result.returncode == 2
    assert result.stderr.startswith("error: cluster.executor=slurm needs `sacct` on PATH")
    assert not list(tmp_path.glob("called-*")), "nothing may be submitted when the job could not be followed"


def test_unknown_cluster_key_lists_the_valid_ones(tmp_path: Path) -> None:
    result = _launch_without_cluster(tmp_path, "cluster.executor=slurm", "cluster.partitoin=gpu",
                                     path=os.environ["PATH"])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "unknown config key 'cluster.partitoin'" in result.stderr
    assert "did you mean 'cluster.partition'?" in result.stderr
    assert ("valid keys here: executor, nodes, tasks_per_node, rollout_tasks, gpus_per_node, gpu_type, cpus_per_task, "
            "mem, time, "
            "partition, account, qos, reservation, constraint, exclude, job_name, sbatch_extra, setup, "
            "container_image, container_mounts, signal_delay_s, max_requeues") in result.stderr


def _running(launcher: Launcher, tmp_path: Path, *extra: str) -> tuple[StartedLaunch, str]:
    started = launcher.start(*LONG_JOB, *extra, run_dir=tmp_path / "run")
    job_id = started.job_id()
    launcher.cluster.wait_running(job_id, timeout=120)
    return started, job_id


def _ends_within(launcher: Launcher, started: StartedLaunch, since: float):
    run = launcher.finish(started, timeout=ENDS_WITHIN_S + 30)
    elapsed = time.monotonic() - since
    assert elapsed < ENDS_WITHIN_S, f"launch.py took {elapsed:.0f} s to report the failure"
    return run


@pytest.mark.slurm
def test_cancelled_job_ends_wait_with_a_clear_status(launcher: Launcher, tmp_path: Path) -> None:
    started, job_id = _running(launcher, tmp_path)
    cancelled_at = time.monotonic()
    launcher.cluster.run("scancel", job_id)
    run = _ends_within(launcher, started, cancelled_at)
    assert run.returncode == 1
    assert run.stderr.startswith(f"slurm: job {job_id} was CANCELLED (scancel or an administrator) after ")
    assert "rerun with the same run.dir to resume" in run.stderr
    assert launcher.cluster.wait_sacct_state(job_id) == "CANCELLED"


@pytest.mark.slurm
def test_node_set_down_ends_wait_with_node_fail(launcher: Launcher, tmp_path: Path) -> None:
    # a job that may not be requeued (a requeueable one resumes: tests/slurm/test_requeue_resume.py)
    started, job_id = _running(launcher, tmp_path, "cluster.max_requeues=0")
    cluster = launcher.cluster
    try:
        down_at = time.monotonic()
        cluster.run("scontrol", "update", "nodename=n2", "state=down", "reason=megatron-rl-test")
        run = _ends_within(launcher, started, down_at)
    finally:
        cluster.run("scontrol", "update", "nodename=n2", "state=resume", check=False)
        _wait_idle(cluster, "n2")
    assert run.returncode == 1
    assert run.stderr.startswith(f"slurm: job {job_id} ended with NODE_FAIL: a node of the job")
    assert "(nodes down or drained now: n2: megatron-rl-test); rerun with the same run.dir" in run.stderr
    assert cluster.wait_sacct_state(job_id) == "NODE_FAIL"


def _wait_idle(cluster: DevCluster, node: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.run("sinfo", "-h", "-n", node, "-o", "%t", check=False).stdout.strip() == "idle":
            return
        time.sleep(0.5)
    raise AssertionError(f"{node} did not come back to idle within {timeout} s")


def _trainer_pid(job_id: str, rank: int) -> int | None:
    """The pid of the trainer process (python -m megatron_rl.main) of `rank` in job `job_id`, on this machine."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if b"megatron_rl.main" not in cmdline:
                continue
            environ = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and f"SLURM_PROCID={rank}".encode() in environ:
            return int(proc.name)
    return None


def _training_rank_1(launcher: Launcher, tmp_path: Path, *extra: str) -> tuple[StartedLaunch, str, int]:
    """A running two-node job once it trains (metrics written: mid-training, between collectives), and the pid
    of its rank 1 trainer."""
    started, job_id = _running(launcher, tmp_path, *extra)
    metrics = started.run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)
    pid = _trainer_pid(job_id, rank=1)
    assert pid is not None
    return started, job_id, pid


@pytest.mark.slurm
def test_crashing_rank_stops_the_others_and_is_named(launcher: Launcher, tmp_path: Path) -> None:
    started, job_id, pid = _training_rank_1(launcher, tmp_path)
    crashed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    run = _ends_within(launcher, started, crashed_at)
    assert run.returncode == 1
    assert run.stderr.startswith(f"slurm: job {job_id} FAILED with exit code 1:0: rank 1 on n2: the trainer killed by "
                                 "signal SIGKILL\n"), run.stderr
    assert _trainer_pid(job_id, rank=0) is None, "rank 0 outlived the job"


@pytest.mark.slurm
def test_a_stopped_rank_is_named_and_the_job_ends_within_the_timeout(launcher: Launcher, tmp_path: Path) -> None:
    """Rank 1's trainer is SIGSTOPped mid-training: rank 0's collective times out (parallel.timeout_s=10) and srun
    reports rank 0 first, but --wait names rank 1, which its task saw stopped, and no trainer is left behind."""
    started, job_id, pid = _training_rank_1(launcher, tmp_path, "parallel.timeout_s=10")
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        run = _ends_within(launcher, started, stopped_at)
    finally:
        if _trainer_pid(job_id, rank=1) == pid:
            os.kill(pid, signal.SIGKILL)
    assert run.returncode == 1
    assert run.stderr.startswith(f"slurm: job {job_id} FAILED with exit code 1:0: rank 1 on n2: the trainer was "
                                 "stopped (SIGSTOP or a debugger) and never answered"), run.stderr
    assert _trainer_pid(job_id, rank=0) is None and _trainer_pid(job_id, rank=1) is None
