"""The real dev Slurm cluster of slurm/dev-cluster.sh: multi-node jobs, accounting, submitit + torch gloo, the script.

    slurm/dev-cluster.sh up && REQUIRE_SLURM=1 .venv/bin/python -m pytest tests/slurm/test_dev_cluster.py -m slurm
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import cloudpickle
import pytest
import submitit

if TYPE_CHECKING:
    from conftest import DevCluster

pytestmark = pytest.mark.slurm
DEV_CLUSTER_SCRIPT = Path(__file__).resolve().parents[2] / "slurm" / "dev-cluster.sh"


@pytest.fixture(scope="module")
def two_node_batch_job(slurm_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """Job id and output lines of one `sbatch --wait` job with one task on each of 2 nodes."""
    out = tmp_path_factory.mktemp("sbatch") / "job.out"
    task = 'echo "$SLURMD_NODENAME $SLURM_PROCID $(getent hosts "$SLURMD_NODENAME" | cut -d" " -f1)"'
    result = slurm_cluster.run(
        "sbatch", "--wait", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--time=1",
        f"--output={out}", "--wrap", f"srun bash -c '{task}'",
        timeout=60,
    )  # fmt: skip
    return result.stdout.strip().split(";")[0], out.read_text().splitlines()


def test_sbatch_wait_runs_one_task_on_each_of_two_nodes(two_node_batch_job: tuple[str, list[str]]) -> None:
    _, lines = two_node_batch_job
    rows = sorted((line.split() for line in lines), key=lambda row: row[1])
    assert [rank for _, rank, _ in rows] == ["0", "1"], lines
    assert len({node for node, _, _ in rows}) == 2, lines
    assert all(node.startswith("n") and address == "127.0.0.1" for node, _, address in rows), lines


def test_sacct_records_the_two_node_job_completed(
    slurm_cluster: DevCluster, two_node_batch_job: tuple[str, list[str]]
) -> None:
    job_id, _ = two_node_batch_job
    assert slurm_cluster.wait_sacct_state(job_id, timeout=20) == "COMPLETED"
    rows = slurm_cluster.run("sacct", "-n", "-P", "-j", job_id, "-o", "JobID,NNodes,NodeList,State,ExitCode").stdout
    records = {line.split("|")[0]: line.split("|")[1:] for line in rows.splitlines()}
    # The job-level NodeList is sometimes recorded as the batch host alone; the srun step's is exact.
    assert records[job_id][0] == "2"
    assert records[f"{job_id}.0"] == ["2", "n[1-2]", "COMPLETED", "0:0"]


def test_srun_places_several_tasks_on_each_node(slurm_cluster: DevCluster) -> None:
    result = slurm_cluster.run(
        "srun", "--nodes=2", "--ntasks-per-node=3", "--time=1", "bash", "-c", 'echo "$SLURMD_NODENAME $SLURM_PROCID"',
        timeout=60,
    )  # fmt: skip
    tasks_by_node: dict[str, list[int]] = {}
    for line in result.stdout.splitlines():
        node, rank = line.split()
        tasks_by_node.setdefault(node, []).append(int(rank))
    assert sorted(len(ranks) for ranks in tasks_by_node.values()) == [3, 3], result.stdout
    assert sorted(rank for ranks in tasks_by_node.values() for rank in ranks) == list(range(6))


def _gloo_all_reduce_of_ranks() -> dict[str, object]:
    """Runs in each Slurm task: joins a gloo group through submitit's env and all-reduces rank + 1."""
    import datetime

    import torch
    import torch.distributed as dist
    from submitit.helpers import TorchDistributedEnvironment

    dist_env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        value = torch.tensor([float(dist_env.rank + 1)], dtype=torch.float64)
        dist.all_reduce(value)
        return {
            "rank": dist_env.rank,
            "world_size": dist.get_world_size(),
            "node": os.environ["SLURMD_NODENAME"],
            "master_addr": dist_env.master_addr,
            "sum": value.item(),
        }
    finally:
        dist.destroy_process_group()


def test_submitit_two_node_job_all_reduces_over_gloo(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    # The worker cannot import this test module by name, so the function travels by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
        executor.update_parameters(
            nodes=2, tasks_per_node=1, cpus_per_task=1, timeout_min=3, slurm_partition="debug", name="gloo-2-nodes"
        )
        job = executor.submit(_gloo_all_reduce_of_ranks)
        results = job.results()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    by_rank = sorted(results, key=lambda r: r["rank"])
    # ranks 0 and 1 contribute 1 + 2
    assert [(r["rank"], r["world_size"], r["sum"]) for r in by_rank] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert by_rank[0]["node"] != by_rank[1]["node"]
    assert {r["master_addr"] for r in by_rank} == {by_rank[0]["node"]}
    assert slurm_cluster.wait_sacct_state(job.job_id, timeout=20) == "COMPLETED"


def test_scancel_shows_cancelled_in_sacct(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    job_id = slurm_cluster.run(
        "sbatch", "--parsable", "--nodes=1", "--time=5", f"--output={tmp_path / 'sleep.out'}", "--wrap", "sleep 300"
    ).stdout.strip()
    slurm_cluster.wait_running(job_id, timeout=20)
    cancelled_at = time.monotonic()
    slurm_cluster.run("scancel", job_id)
    assert slurm_cluster.wait_sacct_state(job_id, timeout=20) == "CANCELLED"
    assert time.monotonic() - cancelled_at < 20


def _pid_files(cluster: DevCluster) -> dict[str, str]:
    return {path.name: path.read_text().strip() for path in sorted(cluster.state_dir.glob("*/*.pid"))}


def test_status_reports_every_node_and_working_accounting(slurm_cluster: DevCluster) -> None:
    result = slurm_cluster.run("bash", str(slurm_cluster.script), "status")
    node_states = {line.split()[0]: line.split()[2] for line in result.stdout.splitlines() if line.startswith("n")}
    assert sorted(node_states) == [f"n{i}" for i in range(1, slurm_cluster.nodes + 1)]
    assert set(node_states.values()) <= {"idle", "mix", "alloc"}, node_states
    assert "accounting: ok" in result.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="dev-cluster.sh up needs root")
def test_second_up_while_running_changes_nothing(slurm_cluster: DevCluster) -> None:
    pids_before = _pid_files(slurm_cluster)
    started = time.monotonic()
    result = slurm_cluster.run("bash", str(slurm_cluster.script), "up", timeout=60)
    assert time.monotonic() - started < 15
    assert "already up" in result.stderr
    assert f"export SLURM_CONF='{slurm_cluster.slurm_conf}'" in result.stdout.splitlines()
    assert _pid_files(slurm_cluster) == pids_before
    assert len(pids_before) == 4 + slurm_cluster.nodes  # munged, mariadbd, slurmdbd, slurmctld, one slurmd per node
    for pid in pids_before.values():
        assert Path(f"/proc/{pid}").exists()


def _script_in_empty_state_dir(tmp_path: Path, command: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_CONF", "NODES")}
    env["DEV_CLUSTER_DIR"] = str(tmp_path / "no-cluster-here")
    return subprocess.run(
        ["bash", str(DEV_CLUSTER_SCRIPT), command], env=env, capture_output=True, text=True, timeout=30
    )


def test_status_without_a_cluster_exits_non_zero(tmp_path: Path) -> None:
    result = _script_in_empty_state_dir(tmp_path, "status")
    assert result.returncode == 1
    assert "not up: no cluster in" in result.stderr


def test_down_without_a_cluster_is_a_no_op(tmp_path: Path) -> None:
    result = _script_in_empty_state_dir(tmp_path, "down")
    assert result.returncode == 0, result.stderr
    assert "nothing to stop" in result.stderr
    assert not (tmp_path / "no-cluster-here").exists()


def test_unknown_command_is_rejected_with_the_valid_ones(tmp_path: Path) -> None:
    result = _script_in_empty_state_dir(tmp_path, "restart")
    assert result.returncode == 1
    assert "unknown command 'restart'; use up, down, status or restart-controller" in result.stderr
