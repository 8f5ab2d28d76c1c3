"""`launch.py status|logs|cancel` against real run folders: a local run, and jobs on the dev Slurm cluster.

    .venv/bin/python -m pytest tests/test_run_status.py -q
    slurm/dev-cluster.sh up && REQUIRE_SLURM=1 .venv/bin/python -m pytest tests/test_run_status.py -q   # + Slurm

The run folders' names hold spaces, quotes and `$(...)`, so every command below also checks that a path never
reaches a shell as code. The Slurm tests use the `slurm_cluster` fixture of tests/slurm/conftest.py (skip when no
cluster answers; fail with REQUIRE_SLURM=1).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO_ROOT, run_launch
from launcher.lock import CANCELLED_NAME, acquire, mark_cancelled

_spec = importlib.util.spec_from_file_location("slurm_fixtures", REPO_ROOT / "tests" / "slurm" / "conftest.py")
slurm_fixtures = sys.modules.setdefault("slurm_fixtures", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(slurm_fixtures)
slurm_cluster = slurm_fixtures.slurm_cluster  # the Slurm tests' own fixture, reused as is

HOSTILE_NAME = "run it's \"x\" $(touch dir1) ;y"
LOCAL_JOB = ("run.steps=5", "algorithm.sft_warmup_steps=2", "logging.tensorboard=false")
"""A short default GRPO job: 2 warm-up steps then 5 GRPO steps on 2 local processes."""
SLURM_JOB = ("cluster.executor=slurm", "cluster.nodes=2", "cluster.tasks_per_node=1", "parallel.tp=2",
             "algorithm.name=pretrain", "run.steps=4", "logging.tensorboard=false")
LONG_SLURM_JOB = ("cluster.executor=slurm", "cluster.nodes=1", "cluster.tasks_per_node=1",
                  "algorithm.name=pretrain", "run.steps=100000", "logging.tensorboard=false")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_launch(*args, timeout=120, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: ")
    for word in words:
        assert word in result.stderr


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("local") / HOSTILE_NAME
    result = run_launch(*LOCAL_JOB, f"run.dir={run_dir}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return run_dir


# ---------------- a finished local run ----------------
def test_status_of_a_finished_local_run(local_run: Path) -> None:
    result = cli("status", str(local_run))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"run {local_run}  (grpo, local)" in out
    assert "state    COMPLETED  (no launcher alive; metrics.jsonl reached step 5 of run.steps=5)" in out
    assert "  step     5/5\n" in out
    assert "reward_mean " in out and "loss " in out and "kl " in out
    assert f"rank0     {local_run / 'logs' / 'rank0.log'}" in out and "rank1 " in out
    assert f"  manifest {local_run / 'manifest.json'}  (attempts 1, checkpoints " in out
    assert not (Path(REPO_ROOT) / "dir1").exists()


def test_status_json_has_the_same_fields(local_run: Path) -> None:
    result = cli("status", str(local_run), "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["kind"] == "run" and status["run_dir"] == str(local_run)
    assert (status["state"], status["step"], status["steps"], status["phase"]) == ("COMPLETED", 5, 5, "train")
    last = [json.loads(line) for line in (local_run / "metrics.jsonl").read_text().splitlines()][-1]
    assert status["metrics"]["reward_mean"] == last["reward_mean"] and status["metrics"]["loss"] == last["loss"]
    assert status["logs"] == {"rank0": str(local_run / "logs" / "rank0.log"),
                              "rank1": str(local_run / "logs" / "rank1.log")}
    assert status["jobs"] == [] and status["eta_s"] is None and status["executor"] == "local"
    assert status["manifest"] == str(local_run / "manifest.json") and status["manifest_summary"]["attempts"] == 1


def test_logs_prints_rank_0_and_rank_1(local_run: Path) -> None:
    rank0 = cli("logs", str(local_run))
    assert rank0.returncode == 0, rank0.stderr
    assert rank0.stdout == (local_run / "logs" / "rank0.log").read_text()
    assert "step    5/5" in rank0.stdout
    rank1 = cli("logs", str(local_run), "--rank", "1", "--follow")  # the run has ended: --follow returns
    assert rank1.returncode == 0, rank1.stderr
    assert rank1.stdout == (local_run / "logs" / "rank1.log").read_text()


def test_pipeline_folder_shows_every_stage(local_run: Path, tmp_path: Path) -> None:
    pipeline = tmp_path / "my pipeline"
    for when, stage in enumerate(("sft", "grpo")):
        shutil.copytree(local_run, pipeline / stage, ignore=shutil.ignore_patterns("checkpoints", "data"))
        os.utime(pipeline / stage / "config.yaml", (1e9 + when, 1e9 + when))  # sft started first
    metrics = (pipeline / "grpo" / "metrics.jsonl").read_text().splitlines()
    (pipeline / "grpo" / "metrics.jsonl").write_text("\n".join(metrics[:-2]) + "\n")  # stopped at step 3
    text = cli("status", str(pipeline))
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"pipeline {pipeline}: 2 stage(s), FAILED\nstage sft: COMPLETED\n")
    assert "stage grpo: FAILED\n" in text.stdout and "step     3/5" in text.stdout
    assert text.stdout.index("stage sft") < text.stdout.index("stage grpo")
    status = json.loads(cli("status", str(pipeline), "--json").stdout)
    assert status["kind"] == "pipeline" and status["state"] == "FAILED"
    assert [(s["stage"], s["state"], s["step"]) for s in status["stages"]] == [("sft", "COMPLETED", 5),
                                                                              ("grpo", "FAILED", 3)]
    cancelled = cli("cancel", str(pipeline))
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.count("nothing to cancel") == 2 and "stage grpo: " in cancelled.stdout
    assert_one_line_error(cli("logs", str(pipeline)), "is a pipeline of 2 stages", str(pipeline / "sft"))


def test_bad_input_is_one_line_and_exit_2(local_run: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no such run"
    assert_one_line_error(cli("status", str(missing)), str(missing), "does not exist", "give a run folder")
    assert_one_line_error(cli("cancel", str(tmp_path)), str(tmp_path), "is not a run folder")
    (tmp_path / "file").write_text("x")
    assert_one_line_error(cli("logs", str(tmp_path / "file")), "is a file, not a folder")
    assert_one_line_error(cli("logs", str(local_run), "--rank", "7"), "rank 7 has no log", "give --rank 0")
    assert_one_line_error(cli("status"), "RUN_DIR")


def test_status_is_torch_free_and_fast(local_run: Path) -> None:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-X", "importtime", str(REPO_ROOT / "launch.py"), "status",
                             str(local_run)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert imported.isdisjoint({"torch", "megatron", "numpy", "omegaconf", "submitit"}), imported
    assert seconds < 10, seconds  # ~0.3 s on 2 cores; the bound only catches an import of torch


# ---------------- a running local run: follow its log, cancel it ----------------
def test_cancel_a_running_local_run_and_follow_its_log(tmp_path: Path) -> None:
    run_dir = tmp_path / HOSTILE_NAME
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = subprocess.Popen([sys.executable, "launch.py", "run.steps=100000", "algorithm.sft_warmup_steps=2",
                               "logging.tensorboard=false", f"run.dir={run_dir}"], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              # a suite started in the background (`cmd &`) inherits SIGINT ignored; a user's
                              # launcher in a terminal takes Ctrl-C, and that is the path tested here
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    follow = None
    try:
        status = slurm_fixtures.wait_for(lambda: _grpo_started(run_dir), timeout=120, what="a GRPO step")
        assert status["state"] == "RUNNING" and status["eta_s"] > 0, status
        follow = subprocess.Popen([sys.executable, "launch.py", "logs", str(run_dir), "--follow"], cwd=REPO_ROOT,
                                  stdout=subprocess.PIPE, text=True)
        cancelled = cli("cancel", str(run_dir))
        assert cancelled.returncode == 0, cancelled.stderr
        assert f"launcher pid {launch.pid} sent SIGINT" in cancelled.stdout and "it stopped" in cancelled.stdout
        assert launch.wait(timeout=30) == 130
        followed, _ = follow.communicate(timeout=30)  # --follow ends by itself when the run does
        assert follow.returncode == 0 and "step " in followed
        after = json.loads(cli("status", str(run_dir), "--json").stdout)
        assert after["state"] == "CANCELLED" and "launch.py cancel" in after["state_from"], after
        assert stat.S_IMODE((run_dir / CANCELLED_NAME).stat().st_mode) == 0o600
    finally:
        for proc in (launch, follow):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # the launcher stops its ranks
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_the_next_launch_clears_a_cancel(tmp_path: Path) -> None:
    mark_cancelled(tmp_path, 4242)
    assert json.loads((tmp_path / CANCELLED_NAME).read_text())["launcher_pid"] == 4242
    with acquire(tmp_path):
        assert not (tmp_path / CANCELLED_NAME).exists()


def _grpo_started(run_dir: Path) -> dict | None:
    """The run's status once it has logged a GRPO (not warm-up) step."""
    status = json.loads(cli("status", str(run_dir), "--json").stdout or "{}") if (run_dir / "config.yaml").exists() \
        else {}
    return status if status.get("phase") == "train" and status.get("step") else None


# ---------------- the dev Slurm cluster ----------------
@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A finished 2-node pretrain job in a hostile folder: (run folder, job id)."""
    run_dir = tmp_path_factory.mktemp("slurm") / HOSTILE_NAME
    result = run_launch("--wait", *SLURM_JOB, f"run.dir={run_dir}", env=slurm_cluster.env(), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir, slurm_fixtures.JOB_ID.search(result.stdout).group(1)


@pytest.mark.slurm
def test_status_of_a_completed_slurm_run(slurm_run: tuple[Path, str], slurm_cluster) -> None:
    run_dir, job_id = slurm_run
    text = cli("status", str(run_dir), env=slurm_cluster.env())
    assert text.returncode == 0, text.stderr
    assert f"state    COMPLETED  (sacct of job {job_id})" in text.stdout and "  step     4/4\n" in text.stdout
    assert f"job      {job_id} COMPLETED  exit 0:0" in text.stdout and "on n[1-2]" in text.stdout
    assert f"batch     {run_dir / 'slurm' / f'{job_id}_batch.log'}" in text.stdout and "loss " in text.stdout
    status = json.loads(cli("status", str(run_dir), "--json", env=slurm_cluster.env()).stdout)
    assert (status["state"], status["step"], status["steps"], status["executor"]) == ("COMPLETED", 4, 4, "slurm")
    assert status["jobs"] == [{"job_id": job_id, "state": "COMPLETED", "exit_code": "0:0",
                               "elapsed": status["jobs"][0]["elapsed"], "nodes": "n[1-2]", "reason": "",
                               "starts": 1}]
    assert status["logs"]["rank1"] == str(run_dir / "slurm" / f"{job_id}_1_log.out")


@pytest.mark.slurm
def test_logs_of_a_slurm_run(slurm_run: tuple[Path, str], slurm_cluster) -> None:
    run_dir, job_id = slurm_run
    rank0 = cli("logs", str(run_dir), env=slurm_cluster.env())
    assert rank0.returncode == 0, rank0.stderr
    assert rank0.stdout.startswith("[batch] megatron-rl [job ") and "step    4/4" in rank0.stdout
    rank1 = cli("logs", str(run_dir), "--rank", "1", "--follow", env=slurm_cluster.env())
    assert rank1.returncode == 0, rank1.stderr
    assert (run_dir / "slurm" / f"{job_id}_1_log.out").read_text().splitlines()[0] in rank1.stdout
    assert "rank 0 on" not in rank1.stdout and "rank 1 on" in rank1.stdout  # each task logs its own placement


@pytest.mark.slurm
def test_cancel_every_stage_of_a_slurm_pipeline(slurm_cluster, tmp_path: Path) -> None:
    pipeline = tmp_path / HOSTILE_NAME
    job_ids = []
    for stage in ("sft", "grpo"):
        result = run_launch(*LONG_SLURM_JOB, f"run.dir={pipeline / stage}", env=slurm_cluster.env())
        assert result.returncode == 0, result.stderr
        job_ids.append(slurm_fixtures.JOB_ID.search(result.stdout).group(1))
    try:
        slurm_cluster.wait_running(job_ids[0])
        cancelled = cli("cancel", str(pipeline), env=slurm_cluster.env())
        assert cancelled.returncode == 0, cancelled.stderr
        for stage, job_id in zip(("sft", "grpo"), job_ids):
            assert f"stage {stage}: cancelled Slurm job(s) {job_id} of {pipeline / stage}" in cancelled.stdout
            assert slurm_cluster.wait_sacct_state(job_id) == "CANCELLED"
    finally:
        slurm_cluster.run("scancel", *job_ids, check=False)
    status = json.loads(cli("status", str(pipeline), "--json", env=slurm_cluster.env()).stdout)
    assert [(s["stage"], s["state"]) for s in status["stages"]] == [("sft", "CANCELLED"), ("grpo", "CANCELLED")]
    assert status["state"] == "CANCELLED"
    text = cli("status", str(pipeline / "sft"), env=slurm_cluster.env()).stdout
    assert f"job      {job_ids[0]} CANCELLED" in text
