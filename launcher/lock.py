"""One job per run folder: an exclusive lock file ``run.dir/.lock`` that names its holder.

    {"pid": 4242, "start": 81723, "host": "login1", "slurm_job_id": "1234", "since": "2026-12-01T15:30:00Z",
     "ranks": [{"pid": 4250, "start": 81730}, {"pid": 4251, "start": 81731}]}

The launcher takes it before it writes anything into the folder (``acquire``). A local run keeps it (and a
``flock`` on it) while it waits for its processes, and removes it at the end; it records its ranks' pids once
they start (``RunLock.record_ranks``), with each process's start time (``/proc/<pid>/stat``, Linux) so that a
reused pid is not taken for the process that had it. A Slurm launch rewrites it with the
job id after submission and leaves it: the folder stays the job's while ``squeue`` lists the job (pending,
running, or requeued: every start of the job carries the same SLURM_JOB_ID, so its requeued runs are its own).
A second launch while the holder lives is refused with a one-line ConfigError; a lock whose holder is gone (the
launcher and every rank it recorded are dead on this host, or Slurm no longer lists the job) is taken over: the
ranks of a launcher killed with SIGKILL stop by themselves (``megatron_rl.spec.local_ranks``), and until they
have, the folder is theirs. The check-and-take is done under a
``flock`` of the lock file, so two launches racing for a stale lock cannot both win.

``launch.py cancel`` of a local run leaves ``run.dir/.cancelled`` (who cancelled and when) beside the lock, so
``status`` can tell a cancelled run from a failed one; the next launch into the folder removes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.local_ranks import LAUNCHER_POLL_S, STOP_GRACE_S, proc_stat
from megatron_rl.spec.private import make_private_dir, open_private, write_private_text

LOCK_NAME = ".lock"
CANCELLED_NAME = ".cancelled"
ENDED_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                          "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"})
"""squeue states of a job that has ended (squeue keeps listing one for MinJobAge seconds)."""


class RunLock:
    """A held run-folder lock; ``release`` (or leaving the ``with`` block) removes it, ``hand_to_job`` records
    the Slurm job that holds the folder from then on."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd
        self._holder: dict = {}

    def _write(self, holder: dict) -> None:
        self._holder = holder
        text = json.dumps(holder, sort_keys=True) + "\n"
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text.encode(), 0)
        os.fsync(self._fd)

    def hand_to_job(self, job_id: str) -> None:
        """The folder now belongs to Slurm job ``job_id`` (until squeue stops listing it); the file stays."""
        self._write({**_me(), "slurm_job_id": str(job_id)})
        self._close()

    def record_ranks(self, pids: list[int]) -> None:
        """The job's local ranks: the folder stays theirs while any of them lives, even after this launcher."""
        self._write({**self._holder, "ranks": [{"pid": pid, "start": start_time(pid)} for pid in pids]})

    def release(self) -> None:
        """Remove the lock (the run ended)."""
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == os.lstat(self.path).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(run_dir: Path, *, job_id: Optional[str] = None, key: str = "run.dir") -> RunLock:
    """Take ``run_dir/.lock`` (creating the folder 0700); ConfigError when a live job holds it. ``job_id``: this
    process runs inside that Slurm job, so a lock naming the same job (an earlier start of it) is its own.
    ``key``: the config key the folder comes from (run.dir, pipeline.dir), named in the error."""
    path = make_private_dir(Path(run_dir)) / LOCK_NAME
    for _ in range(5):
        fd = open_private(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(path)
            os.close(fd)
            raise ConfigError(_busy(run_dir, holder, key)) from None
        try:
            same = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # removed by its holder while we waited for it: take the new file
            os.close(fd)
            continue
        holder = read_holder(path)
        own = job_id is not None and str(holder.get("slurm_job_id")) == str(job_id)
        if holder and not own and holder_alive(holder):
            os.close(fd)
            raise ConfigError(_busy(run_dir, holder, key))
        lock = RunLock(path, fd)
        lock._write(_me())
        Path(run_dir, CANCELLED_NAME).unlink(missing_ok=True)  # a cancel of an earlier attempt
        return lock
    raise ConfigError(f"{key}={run_dir}: could not take {path} (it keeps changing); try again")


def mark_cancelled(run_dir: Path, pid: int) -> None:
    """Record that ``launch.py cancel`` stopped the local launcher ``pid`` of ``run_dir``."""
    write_private_text(Path(run_dir) / CANCELLED_NAME, json.dumps({**_me(), "launcher_pid": pid}) + "\n")


def read_holder(path: Path) -> dict:
    """What the lock file says (empty when it is empty or unreadable)."""
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def holder_alive(holder: dict) -> bool:
    """Whether the holder may still run: its Slurm job is listed by squeue, or its launcher or one of its ranks
    lives on this host. A holder on another host without a job id, or a Slurm job when squeue is missing, counts
    as alive."""
    job_id = holder.get("slurm_job_id")
    if job_id:
        return slurm_job_alive(str(job_id))
    if holder.get("host") != socket.gethostname():
        return True
    return process_alive(holder.get("pid"), holder.get("start")) or bool(live_ranks(holder))


def live_ranks(holder: dict) -> list[int]:
    """The pids of the holder's recorded ranks that still live (on this host)."""
    ranks = holder.get("ranks")
    if not isinstance(ranks, list):
        return []
    return [rank["pid"] for rank in ranks
            if isinstance(rank, dict) and process_alive(rank.get("pid"), rank.get("start"))]


def start_time(pid: int) -> Optional[int]:
    """When the process started (clock ticks since boot), or None (no such process, or no /proc)."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields else None


def process_alive(pid: object, start: object = None) -> bool:
    """``pid_alive``, and not a zombie nor another process that was given the pid since ``start`` (when known)."""
    if not pid_alive(pid):
        return False
    fields = proc_stat(pid)  # type: ignore[arg-type]
    if fields is None:  # no /proc: the pid is all there is to go by
        return True
    return fields[0] != "Z" and (not isinstance(start, int) or int(fields[19]) == start)


def pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def slurm_job_alive(job_id: str) -> bool:
    """squeue lists the job in a state that has not ended (pending, running, requeued, suspended...); True when
    that cannot be asked."""
    if shutil.which("squeue") is None:
        return True
    try:
        result = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if result.returncode != 0:  # "Invalid job id specified": long gone
        return "invalid job id" not in result.stderr.lower()
    states = {word.split()[0].rstrip("+") for word in result.stdout.splitlines() if word.strip()}
    return bool(states - ENDED_STATES)


def _me() -> dict:
    return {"pid": os.getpid(), "start": start_time(os.getpid()), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _busy(run_dir: Path, holder: dict, key: str = "run.dir") -> str:
    lock = Path(run_dir) / LOCK_NAME
    if holder.get("slurm_job_id"):
        who = f"Slurm job {holder['slurm_job_id']} (submitted from {holder.get('host', '?')})"
        how = f"wait for it to end, cancel it with `scancel {holder['slurm_job_id']}`"
    elif holder.get("host") == socket.gethostname() and not process_alive(holder.get("pid"), holder.get("start")) \
            and live_ranks(holder):
        ranks = live_ranks(holder)
        who = (f"the ranks of the ended launcher pid {holder.get('pid', '?')}: pid(s) {', '.join(map(str, ranks))} "
               f"on {holder['host']} still run")
        how = (f"wait for them to save and stop (they are killed {STOP_GRACE_S + LAUNCHER_POLL_S:.0f} s after "
               f"their launcher's end at the latest) or stop them (`kill {' '.join(map(str, ranks))}`)")
    else:
        who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
        how = f"wait for it to end or stop it (if it is gone, remove {lock})"
    since = f" since {holder['since']}" if holder.get("since") else ""
    return f"{key}={run_dir} is in use by {who}{since}; {how}, or give another {key}"
