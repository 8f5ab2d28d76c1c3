"""The launcher's reliability and security rules, as a new user meets them (issue 16):

* bad input is one line on stderr, exit 2, no traceback, nothing written;
* everything under run.dir is private (0700 folders, 0600 files) whatever the umask, and a folder others can
  write is refused;
* one job per run folder (``run.dir/.lock``); a stale lock is taken over;
* ``checkpoint.resume=false`` on a folder with checkpoints is refused with both ways forward;
* ``${oc.env:...}`` values (secrets) never reach config.yaml, the run folder or ``--dry-run``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO_ROOT, read_metrics, run_launch

from megatron_rl.spec.errors import ConfigError

TINY_RUN = ["cluster.executor=local", "algorithm.name=pretrain", "algorithm.global_batch_size=2",
            "parallel.micro_batch_size=1", "cluster.tasks_per_node=1", "logging.tensorboard=false"]
"""A one-process pretraining job on the tiny CPU model: a few seconds per run."""


def _one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert fragment in result.stderr, result.stderr


# ---------------- bad input ----------------
@pytest.fixture
def latin1_yaml(tmp_path) -> Path:
    path = tmp_path / "caf\u00e9.yaml"
    path.write_bytes("run:\n  name: caf\u00e9\n".encode("latin-1"))
    return path


def test_a_config_that_is_not_utf8_is_one_line(launch, tmp_path, latin1_yaml):
    result = launch("--config", str(latin1_yaml), f"run.dir={tmp_path / 'run'}", timeout=60)
    _one_line_error(result, f"config file {latin1_yaml} is not UTF-8 text (byte 0xe9 at offset 16); save it as UTF-8")
    assert not (tmp_path / "run").exists()


def test_a_model_yaml_that_is_not_utf8_is_one_line(launch, latin1_yaml):
    result = launch("plan", "--model", str(latin1_yaml), "--gpus", "8", "--gpu-type", "h100-80gb", timeout=60)
    _one_line_error(result, f"model file (model.name) {latin1_yaml} is not UTF-8 text")


@pytest.mark.parametrize("override, fragment", [
    ("run.dir=${nonexistent.key}", "config key 'run.dir' in the merged config: Interpolation key 'nonexistent.key' "
                                   "not found; fix the ${...} reference"),
    ("run.dir=${oc.env:MEGATRON_RL_TEST_UNSET}", "Environment variable 'MEGATRON_RL_TEST_UNSET' not found"),
    ("run.dir=${oc.nosuch:x}", "Unsupported interpolation type oc.nosuch"),
    ("run.steps=${run.dir}", "could not be converted to Integer"),
    ("run.dir=${unclosed", "could not parse the overrides"),
    ("cluster.setup=[export A=${oc.env:HOME}]", "quote values with spaces"),
])
def test_interpolation_errors_are_one_line(launch, tmp_path, override, fragment):
    result = launch(override, f"run.dir={tmp_path / 'run'}", timeout=60) if override.startswith("run.steps") \
        else launch(override, "--dry-run", timeout=60)
    _one_line_error(result, fragment)


def test_a_run_dir_that_is_a_file_is_refused_and_left_alone(launch, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine\n")
    result = launch(*TINY_RUN, "run.steps=1", f"run.dir={path}", timeout=60)
    _one_line_error(result, f"run.dir={path} is a file, not a folder; give another run.dir")
    assert path.read_text() == "mine\n"


def test_convert_checks_the_checkpoint_path_before_importing_torch(tmp_path):
    code = ("import sys; from launcher.cli import main; "
            f"rc = main(['convert', 'megatron-to-hf', '--ckpt', {str(tmp_path / 'nonexistent')!r}, '--out', "
            f"{str(tmp_path / 'hf')!r}]); print('torch' in sys.modules); sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    _one_line_error(result, f"--ckpt {tmp_path / 'nonexistent'}: no such folder; give a checkpoint root or a step_*")
    assert result.stdout.strip() == "False", "torch was imported before the path was checked"
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--gpus", "99999999999999999999"], "--gpus 99999999999999999999 is out of range; give a number from 1 to "
                                         "1,048,576"),
    (["--gpus", "0"], "--gpus 0 is out of range"),
    (["--gpus", "eight"], "--gpus 'eight' is not a whole number"),
    (["--seq-len", "99999999999"], "--seq-len 99999999999 is out of range"),
    (["--global-batch-size", "10000000000"], "--global-batch-size 10000000000 is out of range"),
    (["cluster.nodes=99999999999"], "cluster.nodes=99999999999 is too large; give at most 1,048,576"),
    (["cluster.nodes=4096", "cluster.tasks_per_node=512"], "is 2,097,152 processes; give at most 1,048,576"),
    (["model.seq_length=999999999"], "model.seq_length=999999999 is too large"),
])
def test_huge_numbers_are_refused_at_once(launch, args, fragment):
    started = time.monotonic()
    result = launch("plan", "--model", "llama-3.1-405b", "--gpu-type", "h100-80gb", *args, timeout=60)
    _one_line_error(result, fragment)
    assert time.monotonic() - started < 30


# ---------------- private by default ----------------
def _modes(root: Path) -> dict[str, set[str]]:
    """Every mode under root (root included), by kind: {'dir': {'0700'}, 'file': {'0600'}}."""
    found: dict[str, set[str]] = {"dir": set(), "file": set(), "other": set()}
    for path in [root, *root.rglob("*")]:
        info = os.lstat(path)
        kind = "dir" if stat.S_ISDIR(info.st_mode) else "file" if stat.S_ISREG(info.st_mode) else "other"
        found[kind].add(f"{stat.S_IMODE(info.st_mode):04o} {path.relative_to(root)}")
    return found


def test_umask_022_still_yields_private_run_folders_and_no_secret_on_disk(tmp_path):
    """A real run (with a final checkpoint) under umask 022 whose run.name and run.steps come from oc.env: every
    folder is 0700 and every file 0600, the secret is in no file, and the job read both values from its env."""
    run_dir = tmp_path / "runs" / "private"
    secret = "tok-5e1f-not-on-disk"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SECRET_X": secret, "SECRET_STEPS": "2"}
    result = subprocess.run(
        ["/bin/sh", "-c", 'umask 022 && exec "$@"', "sh", sys.executable, str(REPO_ROOT / "launch.py"), *TINY_RUN,
         "run.name=${oc.env:SECRET_X}", "run.steps=${oc.env:SECRET_STEPS}", "cluster.env=[SECRET_X]",
         f"run.dir={run_dir}"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2], "the job did not read run.steps from its env"
    assert (run_dir / "checkpoints" / "latest").is_file()
    modes = _modes(run_dir)
    assert {m.split()[0] for m in modes["dir"]} == {"0700"}, modes["dir"]
    assert {m.split()[0] for m in modes["file"]} == {"0600"}, modes["file"]
    assert not modes["other"] and not (run_dir / ".lock").exists()
    assert (tmp_path / "runs").stat().st_mode & 0o777 == 0o700, "a parent the launcher created is private too"
    holding = [str(p) for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert holding == [], f"the secret was written to {holding}"
    assert secret not in result.stdout + result.stderr
    config = (run_dir / "config.yaml").read_text()
    assert "name: ${oc.env:SECRET_X}" in config and "steps: ${oc.env:SECRET_STEPS}" in config
    audit = json.loads((run_dir / "manifest.json").read_text())  # the audit record keeps them unresolved too
    assert audit["config"]["run"]["name"] == "${oc.env:SECRET_X}" and audit["config"]["run"]["steps"] == \
        "${oc.env:SECRET_STEPS}"


def test_dry_run_never_prints_an_oc_env_value(launch):
    secret = "tok-dry-run-5e1f"
    result = launch("run.name=${oc.env:SECRET_X}", "cluster.executor=slurm", "cluster.env=[SECRET_X]", "--dry-run",
                    timeout=60, env={"SECRET_X": secret})
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout + result.stderr
    assert "name: ${oc.env:SECRET_X}" in result.stdout
    assert "#SBATCH --export=ALL,SECRET_X" in result.stdout  # the name goes to sbatch, the value never


def test_written_config_resolves_env_when_the_job_loads_it(tmp_path, monkeypatch):
    from megatron_rl.spec.config import load_config
    from megatron_rl.spec.config.loader import env_references, to_yaml

    overrides = ["run.name=${oc.env:SECRET_X}", "run.seed=${oc.env:SECRET_SEED}", "run.steps=3"]
    monkeypatch.setenv("SECRET_X", "s3")
    monkeypatch.setenv("SECRET_SEED", "77")
    cfg = load_config(None, overrides)
    unresolved = env_references(None, overrides)
    assert unresolved == {"run.name": "${oc.env:SECRET_X}", "run.seed": "${oc.env:SECRET_SEED}"}
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg, unresolved))
    assert "s3" not in path.read_text() and "77" not in path.read_text()
    assert load_config(path) == cfg and load_config(path).run.seed == 77
    monkeypatch.setenv("SECRET_SEED", "not-a-number")
    with pytest.raises(ConfigError, match="config key 'run.seed'.*could not be converted to Integer"):
        load_config(path)
    monkeypatch.delenv("SECRET_X")
    with pytest.raises(ConfigError, match="Environment variable 'SECRET_X' not found"):
        load_config(path)


@pytest.mark.parametrize("args, fragment", [
    (["cluster.setup=['export T=${oc.env:HOME}']"], "cluster.setup reads ${oc.env:...}, but setup lines are "
                                                   "written into the job script; name the variable in cluster.env"),
    (["cluster.env=[MEGATRON_RL_TEST_UNSET]"], "cluster.env names MEGATRON_RL_TEST_UNSET, which this shell does "
                                              "not set"),
    (["cluster.env=[TOKEN=abc]"], "cluster.env entry 'TOKEN=abc' is not an environment variable name"),
])
def test_secret_misuse_is_refused(launch, tmp_path, args, fragment):
    result = launch(*TINY_RUN, *args, f"run.dir={tmp_path / 'run'}", timeout=60)
    _one_line_error(result, fragment)
    assert not (tmp_path / "run").exists()


def test_a_folder_others_can_write_is_refused_with_the_fix(launch, tmp_path):
    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    run_dir.chmod(0o777)
    result = launch(*TINY_RUN, "run.steps=1", f"run.dir={run_dir}", timeout=60)
    _one_line_error(result, f"run.dir={run_dir} can be written by others (mode 0777), who could replace the job's "
                            f"config or pickles; run `chmod 700 {run_dir}` or give another run.dir")
    assert list(run_dir.iterdir()) == []
    run_dir.chmod(0o755)  # group/others may read (the user's choice), not write
    assert launch(*TINY_RUN, "run.steps=1", f"run.dir={run_dir}", "--dry-run", timeout=60).returncode == 0


def test_symlinks_are_never_written_through(launch, tmp_path):
    from megatron_rl.spec.private import write_private_text

    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    result = launch(*TINY_RUN, "run.steps=1", f"run.dir={link}", timeout=60)
    _one_line_error(result, f"run.dir={link} is a symlink; give the real folder ({target}) instead")
    assert list(target.iterdir()) == []
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    (target / "config.yaml").symlink_to(victim)
    with pytest.raises(ConfigError, match="config.yaml is a symlink; the launcher does not write through symlinks"):
        write_private_text(target / "config.yaml", "x: 1\n")
    assert victim.read_text() == "keep\n"


# ---------------- one job per run folder ----------------
def _processes_using(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions marker."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _launch_forever(run_dir: Path, *args: str) -> subprocess.Popen:
    """A one-rank job that trains until stopped and saves only when asked to stop (no interval or final save)."""
    return subprocess.Popen([sys.executable, str(REPO_ROOT / "launch.py"), *TINY_RUN, "checkpoint.save_at_end=false",
                             "checkpoint.save_interval=0", "run.steps=1000000", *args, f"run.dir={run_dir}"],
                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _saved_steps(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").glob("step_*"))


def test_a_second_launch_is_refused_and_sigterm_saves_the_current_step(tmp_path):
    """SIGTERM to the launcher (a `kill`, a container stop) stops the run as Ctrl-C does (the ranks finish their
    step and save it; Ctrl-C's path is tests/test_run_status.py's cancel) and the launcher exits 128 + 15."""
    run_dir = tmp_path / "busy"
    first = _launch_forever(run_dir)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():  # the first job is training
            assert first.poll() is None and time.monotonic() < deadline, "the first launch did not start"
            time.sleep(0.2)
        holder = json.loads((run_dir / ".lock").read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        config = (run_dir / "config.yaml").read_text()
        second = run_launch(*TINY_RUN, "run.steps=5", f"run.dir={run_dir}", timeout=60)
        _one_line_error(second, f"run.dir={run_dir} is in use by pid {first.pid} on {socket.gethostname()}")
        assert (run_dir / "config.yaml").read_text() == config, "the refused launch rewrote config.yaml"
        first.send_signal(signal.SIGTERM)  # the launcher stops its ranks, then releases the lock
        try:
            assert first.wait(timeout=60) == 128 + signal.SIGTERM
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launch.py did not stop within 60 s of SIGTERM:\n{_stuck_report(run_dir)}") from None
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        for pid in _processes_using(str(run_dir)):  # a rank the launcher could not stop
            os.kill(pid, signal.SIGKILL)
    assert _processes_using(str(run_dir)) == []
    assert not (run_dir / ".lock").exists()
    assert _saved_steps(run_dir) == [f"step_{read_metrics(run_dir)[-1]['step']:08d}"]  # the step it was in


def _gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to ``timeout`` seconds."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_the_ranks_of_a_killed_launcher_stop_and_keep_the_folder_until_they_have(tmp_path):
    """SIGKILL to the launcher of a quiet run: its rank gets SIGTERM (its parent-death signal), saves the step it
    is in and exits, and until it has, a relaunch into the folder is refused naming it. The rank is held stopped
    (SIGSTOP) across the relaunch, so that it is still alive then whatever the machine's speed."""
    from launcher.lock import acquire
    from megatron_rl.spec.local_ranks import STOP_GRACE_S

    run_dir = tmp_path / "orphaned"
    first = _launch_forever(run_dir, "logging.console=quiet")
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():  # training
            assert first.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        ranks = [pid for pid in _processes_using(str(run_dir / "config.yaml"))
                 if b"megatron_rl.main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 1, ranks
        assert [rank["pid"] for rank in json.loads((run_dir / ".lock").read_text())["ranks"]] == ranks
        os.kill(ranks[0], signal.SIGSTOP)
        first.kill()
        first.wait()
        second = run_launch(*TINY_RUN, "run.steps=5", f"run.dir={run_dir}", timeout=60)
        _one_line_error(second, f"run.dir={run_dir} is in use by the ranks of the ended launcher pid {first.pid}: "
                                f"pid(s) {ranks[0]} on {socket.gethostname()} still run")
        os.kill(ranks[0], signal.SIGCONT)  # the parent-death SIGTERM, pending while stopped, is delivered
        assert _gone(ranks, STOP_GRACE_S + 20) == [], _stuck_report(run_dir)  # its step and save, or killed
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        for pid in {*ranks, *_processes_using(str(run_dir))}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert _processes_using(str(run_dir)) == []
    assert _saved_steps(run_dir) == [f"step_{read_metrics(run_dir)[-1]['step']:08d}"]  # the step it was in
    acquire(run_dir).release()  # the folder is free once the ranks have ended


def test_a_stopped_rank_is_named_and_the_job_ends_within_the_timeout(tmp_path):
    """Rank 1 of a 2-process job is stopped (SIGSTOP) mid-training under parallel.timeout_s=10: rank 0's next
    collective times out (Megatron's groups wait parallel.timeout_s, not their own 30 minutes), the launcher names
    the stopped rank, kills it and exits within the timeout plus a margin, leaving no process."""
    run_dir = tmp_path / "hung"
    args = [sys.executable, str(REPO_ROOT / "launch.py"), *TINY_RUN, "cluster.tasks_per_node=2",
            "algorithm.global_batch_size=4", "checkpoint.save_at_end=false", "run.steps=1000000",
            "parallel.timeout_s=10", f"run.dir={run_dir}"]
    job = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():  # training
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        # the lock lists the ranks' pids in rank order (a rank forked by the test zygote shows the zygote's
        # starting environment in /proc/PID/environ, so RANK is not read there)
        ranks = dict(enumerate(rank["pid"] for rank in json.loads((run_dir / ".lock").read_text())["ranks"]))
        assert sorted(ranks.values()) == sorted(pid for pid in _processes_using(str(run_dir / "config.yaml"))
                                                if b"megatron_rl.main" in Path(f"/proc/{pid}/cmdline").read_bytes())
        os.kill(ranks[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - stopped_at
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        for pid in _processes_using(str(run_dir)):
            os.kill(pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGSTOP, out[-2000:] + err[-3000:]
    assert "rank 1 was stopped (SIGSTOP or a debugger) and never answered" in err, err[-3000:]
    assert 9 <= took < 10 + 30, took  # the timeout (from the collective rank 0 was in), the poll, the stop
    assert _processes_using(str(run_dir)) == []


def _stuck_report(run_dir: Path) -> str:
    """State, kernel wait channel and command of every process whose command line names ``run_dir``, and the
    last lines of rank 0's log: what a hung stop was waiting for."""
    lines = []
    for pid in _processes_using(str(run_dir)):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().split()
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            lines.append(f"pid {pid} state {stat[2]} wchan {wchan}: {cmd[:200]}")
        except OSError:
            continue
    log = run_dir / "logs" / "rank0.log"
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else ["(no rank0.log)"]
    return "\n".join(lines + ["rank0.log:"] + tail)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_slurm_task_reports_its_stopped_trainer_and_the_watcher_names_it_over_the_first_failure(tmp_path, capsys):
    """launcher/slurm/task.py's StoppedWatch on a real stopped process, and launcher/slurm/watch.py's choice:
    a task whose last word is "stopped" is the cause, one that was continued afterwards is not."""
    from launcher.slurm.task import CONTINUED_MARK, FAILURE_MARK, STOPPED_MARK, StoppedWatch
    from launcher.slurm.watch import Watch, failure_details
    from megatron_rl.spec.config.schema import ClusterConfig

    child = subprocess.Popen(["sleep", "30"])
    try:
        watch = StoppedWatch(child.pid, report_after_s=0.2, who="rank 1 on n2")
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while STOPPED_MARK not in capsys.readouterr().err:
            assert time.monotonic() < deadline
            watch.poll()
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.1)
        watch.poll()
        assert capsys.readouterr().err.startswith(f"{CONTINUED_MARK} rank 1 on n2 after ")
    finally:
        child.kill()
        child.wait()

    (tmp_path / "7_batch.log").write_text("srun: error: n1: task 0: Exited with exit code 1\n")
    (tmp_path / "7_0_log.err").write_text(f"{FAILURE_MARK} rank 0 on n1: the trainer exited with code 1\n")
    stopped = f"{STOPPED_MARK} rank 1 on n2: the trainer was stopped (SIGSTOP or a debugger) and never answered\n"
    (tmp_path / "7_1_log.err").write_text(stopped)
    watched = Watch(job_id="7", log_dir=tmp_path, num_tasks=2, cluster=ClusterConfig())
    assert failure_details(watched).startswith(": rank 1 on n2: the trainer was stopped")
    (tmp_path / "7_1_log.err").write_text(stopped + f"{CONTINUED_MARK} rank 1 on n2 after 3 s\n")
    assert failure_details(watched).startswith(": rank 0 on n1: the trainer exited with code 1")


def test_a_stale_lock_of_a_dead_pid_is_taken_over(launch, tmp_path):
    run_dir = tmp_path / "stale"
    run_dir.mkdir(mode=0o700)
    (run_dir / ".lock").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    result = launch(*TINY_RUN, "run.steps=1", "checkpoint.save_at_end=false", f"run.dir={run_dir}", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1]
    assert not (run_dir / ".lock").exists()


def test_a_live_lock_of_this_host_or_another_is_kept(tmp_path):
    from launcher.lock import acquire

    (tmp_path / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    with pytest.raises(ConfigError, match=f"is in use by pid {os.getpid()}"):
        acquire(tmp_path)
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "some-other-login-node"}))
    with pytest.raises(ConfigError, match=r"pid 1 on some-other-login-node.*if it is gone, remove .*\.lock"):
        acquire(tmp_path)


def test_a_lock_is_held_by_its_recorded_ranks_not_by_a_reused_pid(tmp_path):
    """A lock whose launcher is dead but whose rank lives is refused, naming the rank; a rank pid now used by
    another process (its start time differs) holds nothing."""
    from launcher.lock import LOCK_NAME, acquire, start_time

    me = {"pid": os.getpid(), "start": start_time(os.getpid())}
    for ranks, held in (([me], True), ([{**me, "start": me["start"] - 1}], False)):
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(),
                                                      "ranks": ranks}))
        if held:
            with pytest.raises(ConfigError, match=f"the ranks of the ended launcher pid .*: pid.s. {os.getpid()} on"):
                acquire(tmp_path)
        else:
            acquire(tmp_path).release()


@pytest.mark.parametrize("squeue_says, alive", [("RUNNING", True), ("PENDING", True), ("CANCELLED", False),
                                                ("", False)])
def test_a_slurm_lock_is_held_while_squeue_lists_the_job(tmp_path, monkeypatch, squeue_says, alive):
    from launcher.lock import acquire

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n[ \"$3\" = 4242 ] && echo '{squeue_says}'\nexit 0\n")
    (bin_dir / "squeue").chmod(0o700)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    first = acquire(run_dir)
    first.hand_to_job("4242")  # what the Slurm executor does after sbatch
    assert json.loads((run_dir / ".lock").read_text())["slurm_job_id"] == "4242"
    if alive:
        with pytest.raises(ConfigError, match="in use by Slurm job 4242.*scancel 4242"):
            acquire(run_dir)
    else:
        acquire(run_dir).release()
        assert not (run_dir / ".lock").exists()


# ---------------- resume=false on old checkpoints ----------------
@pytest.mark.parametrize("where", ["run", "checkpoint.dir"])
def test_resume_false_on_a_folder_with_checkpoints_is_refused(launch, tmp_path, where):
    run_dir = tmp_path / "old"
    root = run_dir / "checkpoints" if where == "run" else tmp_path / "ckpts"
    (root / "step_00000010").mkdir(parents=True)
    (root / "latest").write_text("step_00000010\n")
    extra = [f"checkpoint.dir={root}"] if where != "run" else []
    run_dir.mkdir(exist_ok=True, mode=0o700)
    before = sorted(p.name for p in run_dir.iterdir())
    result = launch(*TINY_RUN, "checkpoint.resume=false", f"run.dir={run_dir}", *extra, timeout=60)
    key = "run.dir" if where == "run" else "checkpoint.dir"
    _one_line_error(result, f"checkpoint.resume=false, but {root} already holds checkpoints (up to step_00000010); "
                            f"to start over give a new {key}, or to continue from them set checkpoint.resume=true")
    assert sorted(p.name for p in run_dir.iterdir()) == before, "nothing may be written"
    ok = launch(*TINY_RUN, "checkpoint.resume=true", f"run.dir={run_dir}", *extra, "--dry-run", timeout=60)
    assert ok.returncode == 0, ok.stderr


def test_a_requeued_plain_sbatch_start_finds_the_lock_its_own(tmp_path, monkeypatch):
    """``sbatch slurm/train.sbatch`` resolves its config with launcher.slurm.prepare on every start of the job:
    the lock it wrote names its SLURM_JOB_ID, so a requeued start (squeue still lists the job) goes on, and its
    own checkpoints do not count as an old run's; another live job's lock is refused."""
    from launcher.slurm.prepare import resolve

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\necho RUNNING\n")
    (bin_dir / "squeue").chmod(0o700)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    overrides = [*TINY_RUN, "checkpoint.resume=false"]
    first = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}
    resolve(run_dir=str(run_dir), algorithm="pretrain", config=None, overrides=overrides, env=first)
    assert json.loads((run_dir / ".lock").read_text())["slurm_job_id"] == "77"
    (run_dir / "checkpoints" / "step_00000004").mkdir(parents=True)  # the first start saved, then was requeued
    requeued = {**first, "SLURM_RESTART_COUNT": "1"}
    assert resolve(run_dir=str(run_dir), algorithm="pretrain", config=None, overrides=overrides,
                   env=requeued) == run_dir / "config.yaml"
    with pytest.raises(ConfigError, match="checkpoint.resume=false, but .* already holds checkpoints"):
        resolve(run_dir=str(run_dir), algorithm="pretrain", config=None, overrides=overrides, env=first)
    with pytest.raises(ConfigError, match="in use by Slurm job 77"):
        resolve(run_dir=str(run_dir), algorithm="pretrain", config=None, overrides=overrides,
                env={"SLURM_JOB_ID": "78", "SLURM_RESTART_COUNT": "1"})


def test_a_slurm_jobs_rendezvous_port_is_the_same_on_every_node_and_below_the_ephemeral_ports(tmp_path):
    """Every task of a Slurm job computes the same MASTER_PORT (launcher/slurm/task.py, and the sbatch templates'
    srun path in read_dist_env), below the range Linux gives outgoing connections, and a requeued run moves on."""
    from megatron_rl.runtime.distributed import read_dist_env
    from megatron_rl.spec.ports import ephemeral_port_floor, rendezvous_port

    floor = ephemeral_port_floor()
    job = {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "56462666", "SLURM_JOB_NODELIST": "n[1-2]"}
    ports = {read_dist_env({**job, "SLURM_PROCID": str(rank)}).master_port for rank in (0, 1)}
    assert ports == {rendezvous_port(56462666)} and 20000 <= min(ports) < floor
    requeued = read_dist_env({**job, "SLURM_PROCID": "0", "SLURM_RESTART_COUNT": "1"}).master_port
    assert requeued == rendezvous_port(56462666, 1) != min(ports)
    assert all(20000 <= rendezvous_port(job_id, floor=25000) < 25000 for job_id in range(0, 10**6, 997))
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    assert ephemeral_port_floor(str(ranges)) == 40000 and ephemeral_port_floor(str(tmp_path / "none")) == 32768


def test_a_local_jobs_rendezvous_port_is_free_and_below_the_ephemeral_ports():
    """The local executor's MASTER_PORT (spec.ports.free_port): free when drawn, and below the ports Linux gives
    outgoing connections, which a running job's gloo sockets could otherwise take before the store listens (a local
    PPO run failed with EADDRINUSE that way); a taken port is skipped."""
    import socket

    from megatron_rl.spec.ports import ephemeral_port_floor, free_port

    floor = ephemeral_port_floor()
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < floor for port in ports) and len(ports) > 1
    held = []
    try:  # 20 of the 1001 ports of a small range taken: 500 draws would hit one with probability 1 - e^-10
        for port in range(20000, 21001, 50):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", port))
            sock.listen()
        taken = {sock.getsockname()[1] for sock in held}
        drawn = {free_port(floor=21001) for _ in range(500)}
        assert not drawn & taken and all(20000 <= port < 21001 for port in drawn)
    finally:
        for sock in held:
            sock.close()
