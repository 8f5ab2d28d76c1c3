"""Local executor: start the job's ranks as processes on this machine (torchrun-style environment).

Rank 0's output goes to the console; every rank writes ``run.dir/logs/rank<N>.log``. When any rank fails,
the others are stopped (``megatron_rl.spec.local_ranks``) instead of waiting on a collective timeout.
The launcher holds ``run.dir/.lock`` (``launcher.lock``) until every rank has ended, so a second launch into the
folder is refused; everything it writes is private (``megatron_rl.spec.private``).
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
from launcher.lock import acquire
from megatron_rl.spec.local_ranks import RanksEnded, kill_leftovers, rank_env, start_ranks, stop, watch_ranks
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
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()


def run(job: PreparedJob, *, wait: bool = True) -> int:
    """Take the run folder's lock, start every rank, stream rank 0, and return the job's exit code (the first
    failing rank's); the lock is released when every rank has ended."""
    check_env(job.cfg)  # the ranks inherit this environment, cluster.env's variables with it
    with acquire(job.run_dir):
        return _run(job)


def _run(job: PreparedJob) -> int:
    world = job.cfg.cluster.world_size
    config_path = job.write_config()
    log_dir = job.run_dir / "logs"
    make_private_dir(log_dir)
    port = free_port()
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"run folder: {job.run_dir}\nstarting {world} local process(es); logs: {log_dir}", flush=True)
    procs = start_ranks(worker_command(config_path), world, port=port, env=base_env, stdout=subprocess.PIPE)
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, log_dir / f"rank{rank}.log", rank == 0), daemon=True)
             for rank, proc in enumerate(procs)]
    for pump in pumps:
        pump.start()
    try:
        ended = watch_ranks(procs)
    except KeyboardInterrupt:
        stop(procs, signal.SIGTERM)
        ended = RanksEnded(code=130)
    for pump in pumps:
        pump.join(timeout=5)
    kill_leftovers(procs)
    if ended.rank is not None:
        log = log_dir / f"rank{ended.rank}.log"
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print(f"rank {ended.rank} {ended.how}; last lines of {log}:", file=sys.stderr)
        print("\n".join("  " + line for line in tail), file=sys.stderr)
    return ended.code
