"""Local executor: start the job's ranks as processes on this machine (torchrun-style environment).

Rank 0's output goes to the console; every rank writes ``run.dir/logs/rank<N>.log``. When any rank fails,
the others are stopped (``megatron_rl.spec.local_ranks``) instead of waiting on a collective timeout.
The launcher holds ``run.dir/.lock`` (``launcher.lock``) until every rank has ended, so a second launch into the
folder is refused, and records the ranks' pids in it, so that is refused too while a rank of a launcher killed
with SIGKILL still lives (the ranks get SIGTERM when the launcher ends: ``megatron_rl.spec.local_ranks``);
everything it writes is private (``megatron_rl.spec.private``).

Ctrl-C (SIGINT), SIGTERM (``kill``, a container stop, a local scheduler's preemption) and SIGHUP (a closed
terminal; not when started under ``nohup``) stop a run the same way: the ranks get SIGTERM, finish their step,
save it and exit; those still running ``STOP_GRACE_S`` (10 s) later are killed. The launcher then exits with 128
+ the signal's number: 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP). A container stop should allow more than that
grace (``docker stop -t 30``).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from launcher.job import PreparedJob, check_env
from launcher.lock import RunLock, acquire
from megatron_rl.spec.local_ranks import (STOP_GRACE_S, RanksEnded, kill_leftovers, rank_env, start_ranks, stop,
                                          watch_ranks)
from megatron_rl.spec.ports import free_port
from megatron_rl.spec.private import make_private_dir, open_private_append


def worker_command(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.main", str(config_path)]


def describe(job: PreparedJob) -> str:
    """The processes a run would start, as shell lines."""
    world = job.cfg.cluster.world_size
    cmd = shlex.join(worker_command(job.config_path))
    lines = [f"# local executor: {world} process(es) on this machine, logs in {shlex.quote(str(job.run_dir / 'logs'))}"]
    for rank in range(world):
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in rank_env(rank, world, 0).items() if k != "MASTER_PORT")
        lines.append(f"{env} MASTER_PORT=<free port> {cmd}")
    return "\n".join(lines)


def _pump(stream, log_path: Path, echo: bool) -> None:
    with open_private_append(log_path) as log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            if echo:
                try:
                    sys.stdout.buffer.write(line)
                    sys.stdout.buffer.flush()
                except OSError:  # the console is gone (a closed terminal): keep the log, and the rank unblocked
                    echo = False


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Taken as Ctrl-C is (SIGINT raises KeyboardInterrupt already)."""


class _StopSignal(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _catch_stop_signals() -> dict:
    """Have SIGTERM and SIGHUP raise ``_StopSignal`` once (a repeat while the ranks stop is ignored), except one
    ignored when the launcher started (``nohup``); the previous handlers, to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    raised = []

    def handler(signum: int, frame) -> None:
        if not raised:
            raised.append(signum)
            raise _StopSignal(signum)

    previous = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handler)
    return previous


def run(job: PreparedJob, *, wait: bool = True) -> int:
    """Take the run folder's lock, start every rank, stream rank 0, and return the job's exit code (the first
    failing rank's); the lock is released when every rank has ended."""
    check_env(job.cfg)  # the ranks inherit this environment, cluster.env's variables with it
    with acquire(job.run_dir) as lock:
        return _run(job, lock)


def _run(job: PreparedJob, lock: RunLock) -> int:
    world = job.cfg.cluster.world_size
    config_path = job.write_config()
    log_dir = job.run_dir / "logs"
    make_private_dir(log_dir)
    port = free_port()
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"run folder: {job.run_dir}\nstarting {world} local process(es); logs: {log_dir}", flush=True)
    procs = start_ranks(worker_command(config_path), world, port=port, env=base_env, stdout=subprocess.PIPE)
    lock.record_ranks([proc.pid for proc in procs])
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, log_dir / f"rank{rank}.log", rank == 0), daemon=True)
             for rank, proc in enumerate(procs)]
    for pump in pumps:
        pump.start()
    previous = _catch_stop_signals()  # before this, SIGTERM ends the launcher, and the ranks with it (prctl)
    try:
        ended = watch_ranks(procs)
    except (KeyboardInterrupt, _StopSignal) as interrupt:
        signum = interrupt.signum if isinstance(interrupt, _StopSignal) else signal.SIGINT
        _say(f"{signal.Signals(signum).name}: stopping the ranks (they save the current step; killed after "
             f"{STOP_GRACE_S:.0f} s)")
        stop(procs, signal.SIGTERM)
        ended = RanksEnded(code=128 + signum)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for pump in pumps:
        pump.join(timeout=5)
    kill_leftovers(procs)
    if ended.rank is not None:
        log = log_dir / f"rank{ended.rank}.log"
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print(f"rank {ended.rank} {ended.how}; last lines of {log}:", file=sys.stderr)
        print("\n".join("  " + line for line in tail), file=sys.stderr)
    return ended.code


def _say(line: str) -> None:
    """A line on stderr, unless it is gone (SIGHUP: the terminal closed)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass
