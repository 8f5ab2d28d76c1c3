"""Submitting to the real dev cluster: launch.py through submitit, the same job through plain sbatch, hostile names.

    slurm/dev-cluster.sh up && REQUIRE_SLURM=1 .venv/bin/python -m pytest tests/slurm/test_submission.py -m slurm

Both 2-node runs (fixture `two_node_runs`) use a job name and a run folder holding quotes, spaces, `$(touch ...)`
and backticks, so every check below also checks that those values reached Slurm and the ranks unchanged.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import DevCluster, Launcher, LaunchRun, TwoNodeRuns

pytestmark = pytest.mark.slurm
REPO_ROOT = Path(__file__).resolve().parents[2]
PLACEMENT = re.compile(r"COMPLETED in \S+; rank 0 on (\S+), rank 1 on (\S+)$", re.M)


def _step_record(cluster: DevCluster, job_id: str) -> list[str]:
    """NNodes, NTasks, NodeList, State of the job's srun step."""
    rows = cluster.run("sacct", "-n", "-P", "-j", job_id, "-o", "JobID,NNodes,NTasks,NodeList,State").stdout
    return next(line.split("|")[1:] for line in rows.splitlines() if line.startswith(f"{job_id}.0|"))


def test_two_node_job_through_launch_py(pretrain_baseline: LaunchRun, slurm_cluster: DevCluster) -> None:
    run = pretrain_baseline
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"run folder: {run.run_dir}\n" in run.stdout and f"{run.job_id}_<rank>_log.out" in run.stdout
    metrics = run.metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    placed = PLACEMENT.search(run.stdout)
    assert placed is not None, run.stdout
    assert sorted(placed.groups()) == ["n1", "n2"]  # TP=2 spans the two nodes
    assert _step_record(slurm_cluster, run.job_id) == ["2", "2", "n[1-2]", "COMPLETED"]
    assert slurm_cluster.wait_sacct_state(run.job_id) == "COMPLETED"


def test_submitted_script_is_what_dry_run_shows(two_node_runs: TwoNodeRuns, launcher: Launcher) -> None:
    run = two_node_runs.launch
    dry = subprocess.run([sys.executable, "launch.py", "--dry-run", *two_node_runs.launch_args,
                          f"run.dir={run.run_dir}"],
                         cwd=REPO_ROOT, env=launcher.env(), capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    shown = dry.stdout[dry.stdout.index("\n", dry.stdout.index("# slurm executor:")) + 1:]
    submitted = (run.run_dir / "slurm" / f"{run.job_id}_submission.sh").read_text()
    assert shown.removesuffix("\n") == submitted  # print() adds one newline


def test_same_job_through_plain_sbatch(two_node_runs: TwoNodeRuns, slurm_cluster: DevCluster) -> None:
    plain = two_node_runs.plain
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert plain.metrics() == two_node_runs.launch.metrics()  # same steps, same values, exactly
    assert _step_record(slurm_cluster, plain.job_id) == ["2", "2", "n[1-2]", "COMPLETED"]
    assert (plain.run_dir / "slurm" / f"{plain.job_id}_0_log.out").read_text().count("step ") >= 6


def test_hostile_job_name_and_run_folder_run_unchanged_and_execute_nothing(
    two_node_runs: TwoNodeRuns, slurm_cluster: DevCluster
) -> None:
    for run in (two_node_runs.launch, two_node_runs.plain):
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.run_dir.name == "run it's \"x\" $(touch dir1) `touch dir2` ;y"
        assert [m["step"] for m in run.metrics()] == [1, 2, 3, 4, 5, 6]
        # The controller's record: accounting (sacct) stores a double quote in a job name as a backtick.
        name = slurm_cluster.run("squeue", "-h", "-t", "all", "-j", run.job_id, "-o", "%j").stdout.rstrip("\n")
        assert name == two_node_runs.job_name
    # Run as code, the values would create these files in a shell's folder: the repository (the submit and task
    # folder), a run folder, or the markers folder.
    root = two_node_runs.markers.parent
    executed = [p for p in (*root.rglob("*"), *REPO_ROOT.iterdir()) if p.name in ("name1", "name2", "dir1", "dir2")]
    assert not executed, f"a value reached a shell as code: {executed}"


def test_nonexistent_partition_is_a_one_line_error(launcher: Launcher, tmp_path: Path) -> None:
    run = launcher.run("cluster.executor=slurm", "cluster.partition=nope", run_dir=tmp_path / "run", timeout=60)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: sbatch rejected the job: invalid partition specified: nope")
    assert "cluster.partition='nope'" in run.stderr and "sinfo -s" in run.stderr


def test_convert_template_runs_launch_py_convert(launcher: Launcher, slurm_cluster: DevCluster,
                                                 tmp_path: Path) -> None:
    run = launcher.finish_sbatch(launcher.sbatch("convert.sbatch", run_dir=tmp_path / "convert",
                                                 env={"CONVERT_ARGS": "megatron-to-hf --help"}), timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "usage: launch.py convert megatron-to-hf" in (run.run_dir / "slurm" / f"{run.job_id}_0_log.out").read_text()
    nodes, tasks, node, state = _step_record(slurm_cluster, run.job_id)
    assert (nodes, tasks, state) == ("1", "1", "COMPLETED") and node in ("n1", "n2")
