"""A requeue from outside the trainer resumes a 2-node GRPO job from its last complete checkpoint.

    slurm/dev-cluster.sh up && REQUIRE_SLURM=1 .venv/bin/python -m pytest tests/slurm/test_requeue_resume.py -m slurm

Jobs are submitted --requeue. Each case starts the tiny 2-node GRPO job (TP=2 across the nodes, a checkpoint
every 2 steps), waits until it has logged step 3, breaks it, and lets `launch.py --wait` follow the job to its
end: an administrator's `scontrol requeue`, and node n2 set DOWN (NODE_FAIL; the node comes back once the job
is pending again). Either way the job starts again by itself, resumes, logs every step once, and its metrics
equal the uninterrupted run's exactly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import DevCluster, Launcher, LaunchRun, StartedLaunch

pytestmark = pytest.mark.slurm


def _started_past_step_3(launcher: Launcher, run_dir: Path) -> tuple[StartedLaunch, str]:
    started = launcher.start(*launcher.grpo_two_nodes, run_dir=run_dir)
    job_id = started.job_id()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert started.proc.poll() is None, started.out.read_text()[-3000:] + started.err.read_text()[-3000:]
        if _train_steps_logged(run_dir) >= 3:
            return started, job_id
        time.sleep(0.2)
    raise AssertionError(f"step 3 not logged within 300 s:\n{started.out.read_text()[-3000:]}")


def _train_steps_logged(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return sum(1 for line in lines if line.endswith("}") and "phase" not in json.loads(line))


def _runs_in_sacct(cluster: DevCluster, job_id: str) -> list[str]:
    return cluster.run("sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "State").stdout.split()


def _assert_resumed_exactly(launcher: Launcher, run: LaunchRun, baseline: LaunchRun) -> None:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"slurm: job {run.job_id}: requeued; PENDING" in run.stdout
    assert "started again after a requeue" in run.stdout
    assert "resumed from " in run.stdout
    metrics = launcher.grpo_metrics(run.run_dir)
    assert [m["step"] for m in metrics if m.get("phase") is None] == [1, 2, 3, 4, 5, 6]  # each step once
    assert metrics == launcher.grpo_metrics(baseline.run_dir)  # warm-up and every step, every value, exactly
    for done in (run, baseline):  # the final save is named by the loop's step, not by optimizer steps
        assert (done.run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000006"


def test_scontrol_requeue_resumes_from_the_last_checkpoint(launcher: Launcher, grpo_two_node_baseline: LaunchRun,
                                                           tmp_path: Path) -> None:
    started, job_id = _started_past_step_3(launcher, tmp_path / "requeued")
    launcher.cluster.run("scontrol", "requeue", job_id)
    run = launcher.finish(started, timeout=400)
    _assert_resumed_exactly(launcher, run, grpo_two_node_baseline)
    assert _runs_in_sacct(launcher.cluster, job_id) == ["REQUEUED", "COMPLETED"]
    _assert_manifest_records_the_requeue(run.run_dir, job_id)


def _assert_manifest_records_the_requeue(run_dir: Path, job_id: str) -> None:
    """The audit record names the Slurm job, both of its runs (the requeue counted), both nodes of each, and the
    step the second resumed from."""
    from helpers import read_manifest

    manifest = read_manifest(run_dir)
    first, second = manifest["attempts"]
    assert [a["slurm"]["job_id"] for a in (first, second)] == [job_id, job_id]
    assert [a["slurm"]["restart_count"] for a in (first, second)] == [0, 1]
    assert manifest["requeues"] == 1 and manifest["slurm_job_ids"] == [job_id]
    assert all(sorted(a["hosts"]) == ["n1", "n2"] and a["world_size"] == 2 for a in (first, second))
    # requeued under it: a save and exit (preempted), a collective broken by the other node's kill (failed: ...),
    # or killed before recording anything (lost); never still "running" or "completed"
    assert first["status"].startswith(("preempted", "failed: ", "lost: ")), first["status"]
    assert second["status"] == "completed" and 2 <= second["resumed_from_step"] < 6
    saved = {entry["step"] for entry in manifest["checkpoints"]}  # every 2 steps, a preemption save, the final
    assert second["resumed_from_step"] in saved and 6 in saved and saved <= set(range(1, 7))


def test_node_failure_requeues_and_resumes_from_the_last_checkpoint(
    launcher: Launcher, grpo_two_node_baseline: LaunchRun, tmp_path: Path
) -> None:
    cluster = launcher.cluster
    started, job_id = _started_past_step_3(launcher, tmp_path / "node-fail")
    try:
        cluster.run("scontrol", "update", "nodename=n2", "state=down", "reason=megatron-rl-test")
        deadline = time.monotonic() + 60
        while cluster.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip() != "PENDING":
            assert time.monotonic() < deadline, "the job was not requeued after its node went down"
            time.sleep(0.2)
    finally:
        cluster.run("scontrol", "update", "nodename=n2", "state=resume", check=False)
    run = launcher.finish(started, timeout=400)
    _assert_resumed_exactly(launcher, run, grpo_two_node_baseline)
    assert _runs_in_sacct(cluster, job_id) == ["NODE_FAIL", "COMPLETED"]
