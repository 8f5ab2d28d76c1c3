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

from helpers import SESSION_MARKER, without_measurements

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

    def restart_controller(self) -> None:
        """Stop slurmctld and start it again from its saved state (slurm/dev-cluster.sh restart-controller); the new
        daemon is the cluster's, not this test session's, so it does not carry the session's marker."""
        env = {key: value for key, value in self.env().items() if key != SESSION_MARKER}
        result = subprocess.run([str(self.script), "restart-controller"], env=env, capture_output=True, text=True,
                                timeout=60, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise AssertionError(f"restart-controller exited {result.returncode}: {result.stderr}")

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


# ---------------- launch.py against the dev cluster (the slurm executor and the sbatch templates) ----------------
PRETRAIN_TWO_NODES = ("cluster.executor=slurm", "cluster.nodes=2", "cluster.tasks_per_node=1", "parallel.tp=2",
                      "algorithm.name=pretrain", "run.steps=6")
"""The tiny 2-node job of the Slurm tests: Megatron TP=2 over gloo, one rank on each node, 6 steps."""

JOB_ID = re.compile(r"submitted Slurm job (\d+)")
GRPO_TWO_NODES = ("cluster.executor=slurm", "cluster.nodes=2", "cluster.tasks_per_node=1", "parallel.tp=2",
                  "logging.tensorboard=false", "algorithm.sft_warmup_steps=5", "algorithm.prompts_per_step=4",
                  "algorithm.group_size=4", "algorithm.global_batch_size=8", "parallel.micro_batch_size=4",
                  "run.steps=6", "checkpoint.save_interval=2", "checkpoint.keep_last=5")
"""A tiny GRPO job with TP=2 across the two nodes, saving every 2 steps."""
HOSTILE_JOB_NAME = "it's a \"job\" $(touch {markers}/name1) `touch {markers}/name2` ;x"
"""A job name that creates files in {markers} if any shell runs it as code."""
HOSTILE_FOLDER = "run it's \"x\" $(touch dir1) `touch dir2` ;y"
"""A run folder name (no slash) that creates dir1/dir2 in a shell's working folder if run as code."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchRun:
    """A finished `python launch.py ... --wait` against the dev cluster."""

    run_dir: Path
    """The run folder (run.dir)."""
    returncode: int
    """launch.py's exit code."""
    stdout: str
    """launch.py's stdout (submission lines, streamed logs, state changes)."""
    stderr: str
    """launch.py's stderr (the explanation of a failure)."""
    job_id: str
    """The Slurm job id ("" when nothing was submitted)."""
    seconds: float
    """Wall time of launch.py."""

    def metrics(self) -> list[dict]:
        """metrics.jsonl without what differs between identical runs (times, throughput, peak memory)."""
        return Launcher.metrics(self.run_dir)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartedLaunch:
    """A `python launch.py ... --wait` still running."""

    proc: subprocess.Popen
    """The launch.py process."""
    run_dir: Path
    """Its run folder."""
    out: Path
    """File receiving its stdout."""
    err: Path
    """File receiving its stderr."""
    started: float
    """time.monotonic() at start."""

    def job_id(self, *, timeout: float = 60.0) -> str:
        """The job id launch.py printed once it submitted."""
        return wait_for(lambda: (JOB_ID.search(self.out.read_text()) or [None, None])[1], timeout=timeout,
                        what=f"job id in {self.out}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launcher:
    """Starts `python launch.py` (the real CLI) in a subprocess that talks to the dev cluster."""

    cluster: DevCluster
    """The running dev cluster."""

    pretrain_two_nodes: tuple[str, ...] = PRETRAIN_TWO_NODES
    """The overrides of the tiny 2-node job."""
    grpo_two_nodes: tuple[str, ...] = GRPO_TWO_NODES
    """The overrides of the tiny 2-node GRPO job."""

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**self.cluster.env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}

    @staticmethod
    def metrics(run_dir: Path) -> list[dict]:
        """A run's metrics.jsonl without what differs between identical runs (times, throughput, peak memory)."""
        import json

        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return without_measurements([json.loads(line) for line in lines if line])

    @staticmethod
    def grpo_metrics(run_dir: Path) -> list[dict]:
        """Every line of a GRPO run's metrics.jsonl (warm-up included) without the timing keys."""
        import json

        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return without_measurements([json.loads(line) for line in lines if line])

    def start(self, *args: str, run_dir: Path, env: dict[str, str] | None = None) -> StartedLaunch:
        """Start launch.py ARGS run.dir=run_dir --wait; its stdout/stderr go to files next to run_dir."""
        import sys

        out = run_dir.parent / f"{run_dir.name}.launch.out"
        err = run_dir.parent / f"{run_dir.name}.launch.err"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as stdout, err.open("w") as stderr:
            command = [sys.executable, str(REPO_ROOT / "launch.py"), "--wait", *args, f"run.dir={run_dir}"]
            proc = subprocess.Popen(command, cwd=REPO_ROOT, env=self.env(env), stdout=stdout, stderr=stderr,
                                    stdin=subprocess.DEVNULL)
        return StartedLaunch(proc=proc, run_dir=run_dir, out=out, err=err, started=time.monotonic())

    def finish(self, started: StartedLaunch, *, timeout: float = 300.0) -> LaunchRun:
        """Wait for a started launch.py (killing it after `timeout` s) and collect what it did."""
        try:
            started.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            started.proc.kill()
            started.proc.wait()
            raise AssertionError(f"launch.py still waiting after {timeout} s:\n{started.out.read_text()[-3000:]}")
        stdout, stderr = started.out.read_text(), started.err.read_text()
        match = JOB_ID.search(stdout)
        return LaunchRun(run_dir=started.run_dir, returncode=started.proc.returncode, stdout=stdout, stderr=stderr,
                         job_id=match.group(1) if match else "", seconds=time.monotonic() - started.started)

    def run(self, *args: str, run_dir: Path, env: dict[str, str] | None = None, timeout: float = 300.0) -> LaunchRun:
        return self.finish(self.start(*args, run_dir=run_dir, env=env), timeout=timeout)

    def sbatch(self, template: str, *sbatch_args: str, run_dir: Path, env: dict[str, str]) -> StartedLaunch:
        """`sbatch --wait slurm/TEMPLATE` from the repository root, as a user would, with RUN_DIR and PYTHON set."""
        import sys

        batch_log = run_dir.parent / f"{run_dir.name}.batch.out"
        err = run_dir.parent / f"{run_dir.name}.sbatch.err"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        command = ["sbatch", "--wait", "--parsable", f"--output={batch_log}", *sbatch_args, f"slurm/{template}"]
        with err.open("w") as stderr:
            proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                    env=self.env({"PYTHON": sys.executable, "RUN_DIR": str(run_dir), **env}),
                                    stdin=subprocess.DEVNULL)
        return StartedLaunch(proc=proc, run_dir=run_dir, out=batch_log, err=err, started=time.monotonic())

    def finish_sbatch(self, started: StartedLaunch, *, timeout: float = 300.0) -> LaunchRun:
        """Wait for `sbatch --wait`; stdout of the result is the batch script's log."""
        try:
            parsable, _ = started.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            started.proc.kill()
            started.proc.communicate()
            raise AssertionError(f"sbatch --wait still waiting after {timeout} s") from None
        log = started.out.read_text() if started.out.exists() else ""
        return LaunchRun(run_dir=started.run_dir, returncode=started.proc.returncode, stdout=log,
                         stderr=started.err.read_text(), job_id=parsable.strip().split(";")[0],
                         seconds=time.monotonic() - started.started)


def wait_for(probe, *, timeout: float, what: str, every: float = 0.1):
    """Poll probe() until it returns something truthy and return it; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"no {what} after {timeout} s")


@pytest.fixture(scope="session")
def launcher(slurm_cluster: DevCluster) -> Launcher:
    """Runs launch.py against the dev cluster."""
    return Launcher(cluster=slurm_cluster)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TwoNodeRuns:
    """The same uninterrupted 2-node job, through launch.py and through plain sbatch, both with hostile names."""

    launch_args: tuple[str, ...]
    """launch.py's overrides (without run.dir)."""
    launch: LaunchRun
    """The run through launch.py (submitit)."""
    plain: LaunchRun
    """The run through `sbatch slurm/train.sbatch` with ALGORITHM=pretrain (stdout: its batch log)."""
    job_name: str
    """The job name both used."""
    markers: Path
    """The folder the job name would create files in, were it run as code."""


@pytest.fixture(scope="session")
def two_node_runs(launcher: Launcher, tmp_path_factory: pytest.TempPathFactory) -> TwoNodeRuns:
    """Runs both at once (their idle waits overlap)."""
    root = tmp_path_factory.mktemp("two-node")
    markers = root / "markers"
    markers.mkdir()
    job_name = HOSTILE_JOB_NAME.format(markers=markers)
    args = (*PRETRAIN_TWO_NODES, f"cluster.job_name={job_name}")
    launched = launcher.start(*args, run_dir=root / "launch" / HOSTILE_FOLDER)
    plain = launcher.sbatch("train.sbatch", "--nodes=2", "--ntasks-per-node=1", f"--job-name={job_name}",
                            run_dir=root / "plain" / HOSTILE_FOLDER,
                            env={"ALGORITHM": "pretrain", "OVERRIDES": "parallel.tp=2 run.steps=6"})
    return TwoNodeRuns(launch_args=args, launch=launcher.finish(launched), plain=launcher.finish_sbatch(plain),
                       job_name=job_name, markers=markers)


@pytest.fixture(scope="session")
def pretrain_baseline(two_node_runs: TwoNodeRuns) -> LaunchRun:
    """The uninterrupted 2-node job through launch.py; other runs compare their metrics to it."""
    return two_node_runs.launch



@pytest.fixture(scope="session")
def grpo_two_node_baseline(launcher: Launcher, tmp_path_factory: pytest.TempPathFactory) -> LaunchRun:
    """GRPO_TWO_NODES uninterrupted; interrupted runs and the local run compare their metrics to it."""
    run = launcher.run(*GRPO_TWO_NODES, run_dir=tmp_path_factory.mktemp("grpo-baseline") / "run", timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run
