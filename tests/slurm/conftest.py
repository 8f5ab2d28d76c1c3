"""Fixtures for tests that run against the real dev Slurm cluster started by `slurm/dev-cluster.sh`.

    slurm/dev-cluster.sh up && .venv/bin/python -m pytest tests/slurm -m slurm

The `slurm_cluster` fixture finds the cluster through `$DEV_CLUSTER_DIR/env.sh` (default folder
/tmp/megatron-rl-dev-cluster) or an exported `SLURM_CONF`, exports `SLURM_CONF` for the session so that
sbatch/sacct/submitit reach it, and skips when no cluster answers; with `REQUIRE_SLURM=1` (CI) it fails instead.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEV_CLUSTER_SCRIPT = REPO_ROOT / "slurm" / "dev-cluster.sh"
DEFAULT_DEV_CLUSTER_DIR = Path("/tmp/megatron-rl-dev-cluster")
ENV_LINE = re.compile(r"^export ([A-Z_][A-Z0-9_]*)='([^']*)'$")
FINAL_JOB_STATES = frozenset(
    {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DevCluster:
    """A running dev cluster and helpers to drive it through the Slurm client commands."""

    state_dir: Path
    """Folder holding the cluster's configs, logs and pid files ($DEV_CLUSTER_DIR)."""
    slurm_conf: Path
    """slurm.conf every client command must read; exported as SLURM_CONF for the test session."""
    nodes: int
    """Number of slurmd nodes, named n1..nN, all in the default partition `debug`."""
    script: Path
    """slurm/dev-cluster.sh, for tests of up/status/down."""

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that talks to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf), "DEV_CLUSTER_DIR": str(self.state_dir)}

    def run(self, *args: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command (e.g. `sbatch ...`) against the cluster; raises with its stderr when `check` and it fails."""
        result = subprocess.run(
            list(args), env=self.env(), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{args} exited {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}")
        return result

    def sacct_state(self, job_id: str) -> str:
        """The job's state as accounting records it (e.g. `COMPLETED`, `CANCELLED`), or "" before it is recorded."""
        words = self.run("sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State").stdout.split()
        return words[0] if words else ""

    def wait_sacct_state(self, job_id: str, *, timeout: float = 30.0) -> str:
        """Poll sacct until the job reaches a final state and return it; fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.sacct_state(job_id)
            if state in FINAL_JOB_STATES:
                return state
            time.sleep(0.25)
        raise AssertionError(f"job {job_id} not in a final state after {timeout} s (last sacct state: {state!r})")

    def wait_running(self, job_id: str, *, timeout: float = 30.0) -> None:
        """Poll squeue until the job runs."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.run("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False).stdout.strip()
            if state == "RUNNING":
                return
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} not RUNNING after {timeout} s (last squeue state: {state!r})")


def _unavailable(reason: str) -> None:
    if os.environ.get("REQUIRE_SLURM") == "1":
        pytest.fail(f"REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        match = ENV_LINE.match(line)
        if match:
            values[match.group(1)] = match.group(2)
    return values


def _find_cluster() -> DevCluster:
    state_dir = Path(os.environ.get("DEV_CLUSTER_DIR", DEFAULT_DEV_CLUSTER_DIR))
    env_file = state_dir / "env.sh"
    if env_file.is_file():
        values = _read_env_file(env_file)
        slurm_conf = Path(values.get("SLURM_CONF", state_dir / "etc" / "slurm.conf"))
        nodes = int(values.get("DEV_CLUSTER_NODES", "0"))
    elif os.environ.get("SLURM_CONF"):
        slurm_conf = Path(os.environ["SLURM_CONF"])
        nodes = 0
    else:
        _unavailable(f"no dev Slurm cluster: {env_file} missing and SLURM_CONF unset (run: slurm/dev-cluster.sh up)")
    if not slurm_conf.is_file():
        _unavailable(f"no dev Slurm cluster: {slurm_conf} does not exist (run: slurm/dev-cluster.sh up)")
    for command in ("sbatch", "sinfo", "sacct", "scancel", "srun"):
        if shutil.which(command) is None:
            _unavailable(f"`{command}` is not on PATH (run: slurm/dev-cluster.sh up, which installs Slurm)")
    cluster = DevCluster(state_dir=state_dir, slurm_conf=slurm_conf, nodes=nodes, script=DEV_CLUSTER_SCRIPT)
    try:
        sinfo = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=15, check=False)
    except subprocess.TimeoutExpired:
        _unavailable(f"the Slurm cluster of {slurm_conf} does not answer `sinfo` within 15 s")
    if sinfo.returncode != 0:
        _unavailable(f"the Slurm cluster of {slurm_conf} does not answer: {sinfo.stderr.strip()}")
    node_lines = [line.split() for line in sinfo.stdout.splitlines() if line.strip()]
    if nodes == 0:
        nodes = len(node_lines)
        cluster = dataclasses.replace(cluster, nodes=nodes)
    ready = [name for name, state in node_lines if state in ("idle", "mix", "alloc")]
    if len(ready) < 2:
        _unavailable(f"the Slurm tests need 2 responding nodes; sinfo shows {node_lines}")
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[DevCluster]:
    """The running dev cluster; SLURM_CONF is exported while the session lasts (submitit shells out to sbatch)."""
    cluster = _find_cluster()
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.slurm_conf)
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
