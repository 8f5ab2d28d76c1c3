"""Preemption on the real dev cluster: checkpoint, requeue, resume, and metrics equal to an uninterrupted run.

    slurm/dev-cluster.sh up && REQUIRE_SLURM=1 .venv/bin/python -m pytest tests/slurm/test_preemption.py -m slurm

Three jobs run at once (their requeue holds overlap): one stops itself after step 5 of 6
(MEGATRON_RL_STOP_AFTER_STEP, the trainer's deterministic preemption), one gets SIGUSR1 from `scancel --signal`
(what `--signal=USR1@N` sends before the time limit), one may not be requeued at all (cluster.max_requeues=0).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import DevCluster, Launcher, LaunchRun

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def preempted_runs(launcher: Launcher, slurm_cluster: DevCluster,
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, LaunchRun]:
    root = tmp_path_factory.mktemp("preempt")
    stop_after = launcher.start(*launcher.pretrain_two_nodes, run_dir=root / "stop-after-5",
                                env={"MEGATRON_RL_STOP_AFTER_STEP": "5"})
    signalled = launcher.start(*launcher.pretrain_two_nodes, run_dir=root / "usr1")
    limited = launcher.start("cluster.executor=slurm", "cluster.nodes=1", "cluster.tasks_per_node=1",
                             "algorithm.name=pretrain", "run.steps=2", "cluster.max_requeues=0",
                             run_dir=root / "no-requeue", env={"MEGATRON_RL_STOP_AFTER_STEP": "1"})
    job_id = signalled.job_id()
    # metrics.jsonl appears as the trainer installs its signal handlers, before the model is built and step 1 runs;
    # a signal that comes a little earlier is held back by the task until the trainer can take it.
    deadline = time.monotonic() + 240
    while not (signalled.run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
        assert signalled.proc.poll() is None, signalled.out.read_text()
        time.sleep(0.1)
    slurm_cluster.run("scancel", "--signal=USR1", job_id)
    return {"stop_after": launcher.finish(stop_after), "usr1": launcher.finish(signalled),
            "limited": launcher.finish(limited)}


def _runs_in_sacct(cluster: DevCluster, job_id: str) -> list[str]:
    """State|ExitCode of every run of the job (a requeued job has one record per run)."""
    return cluster.run("sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "State,ExitCode").stdout.split()


@pytest.mark.parametrize("name", ["stop_after", "usr1"])
def test_preempted_job_requeues_resumes_and_matches_an_uninterrupted_run(
    name: str, preempted_runs: dict[str, LaunchRun], pretrain_baseline: LaunchRun, slurm_cluster: DevCluster
) -> None:
    run = preempted_runs[name]
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checkpoint saved for preemption; requeueing (requeue 1 of at most 3)" in run.stdout
    assert f"slurm: job {run.job_id}: requeued; PENDING" in run.stdout
    assert "resumed from " in run.stdout
    assert _runs_in_sacct(slurm_cluster, run.job_id) == ["REQUEUED|0:0", "COMPLETED|0:0"]
    assert pretrain_baseline.returncode == 0
    assert run.metrics() == pretrain_baseline.metrics()  # every step, every value, exactly


def test_stop_after_step_saves_exactly_that_step(preempted_runs: dict[str, LaunchRun]) -> None:
    run = preempted_runs["stop_after"]
    assert "preemption requested: saved step 5, exiting with code 3 for requeue" in run.stdout
    assert f"resumed from {run.run_dir / 'checkpoints' / 'step_00000005'} (step 5)" in run.stdout


def test_requeue_limit_ends_the_job_with_exit_code_3(preempted_runs: dict[str, LaunchRun],
                                                     slurm_cluster: DevCluster) -> None:
    run = preempted_runs["limited"]
    assert run.returncode == 3, run.stdout + run.stderr
    assert "already requeued 0 times (MAX_REQUEUES=0)" in run.stdout
    assert "more often than cluster.max_requeues=0 allows" in run.stderr
    assert _runs_in_sacct(slurm_cluster, run.job_id) == ["FAILED|3:0"]
    assert [m["step"] for m in run.metrics()] == [1]
    assert (Path(run.run_dir) / "checkpoints" / "step_00000001").is_dir()
