"""Ranks as processes on this machine, with torchrun's environment, started and watched without torchrun's agent
(``python -m torch.distributed.run`` imports torch before it starts anything: ~2 s of every start).

The local executor starts a job's ranks with it (launcher/executors/local.py), the converter its workers
(megatron_rl/conversion/spawn.py), the tests their torchrun checks (tests/helpers.py). Each rank runs in its own
session, so stopping it stops what it started too, and ends with ``exit_process``. Torch-free.

Ranks die with their launcher, even one killed with SIGKILL: on Linux each rank gets SIGTERM when it ends
(``prctl(PR_SET_PDEATHSIG)``, set between fork and exec), which a trainer takes as a stop (it saves the current
step); the rank's ``watch_launcher`` thread sends it too (within ``LAUNCHER_POLL_S``: the only one where prctl is
missing, not Linux) and SIGKILLs the rank's process group ``STOP_GRACE_S`` later, as the launcher would have.
"""

from __future__ import annotations

import logging
import os
import json
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, NoReturn, Optional, Union

from megatron_rl.spec.run_files import REQUEUE_EXIT_CODE

STOP_GRACE_S = 10.0
"""Seconds a stopped rank gets between SIGTERM and SIGKILL."""
FAILED_GRACE_S = 3.0
"""The same once a rank has failed: the others cannot finish a collective (a save) without it, so they get only the
time to flush their logs (an async rollout worker, which leaves stopping to the trainers, would wait it out)."""
LAUNCHER_PID_ENV = "MEGATRON_RL_LAUNCHER_PID"
"""Set by ``start_ranks`` to the starting process's pid; a rank's ``watch_launcher`` reads (and removes) it."""
LAUNCHER_POLL_S = 1.0
"""How often a rank's ``watch_launcher`` thread looks whether its launcher still lives."""
PR_SET_PDEATHSIG = 1
"""prctl's option for the signal a process gets when its parent ends (linux/prctl.h)."""
ZYGOTE_ENV = "MEGATRON_RL_ZYGOTE"
"""The socket of a zygote (``megatron_rl.runtime.zygote``): when set, ``start_ranks`` has it fork the ranks of a
``python -m MODULE`` or ``python SCRIPT.py`` command instead of starting interpreters."""
ZYGOTE_CHILD_ENV = "MEGATRON_RL_ZYGOTE_CHILD"
"""Set in a rank the zygote forked: its parent is the zygote, not its launcher (``watch_launcher``)."""
ZYGOTE_HEADER = struct.Struct("!Q")
"""A request's length, ahead of its JSON; the rank's output descriptor travels with it."""
ZYGOTE_MAX_REQUEST = 16 * 2**20


def exit_process(code: Optional[int] = 0) -> NoReturn:
    """End this rank now with ``code`` (None: 0), skipping the interpreter's teardown: freeing torch's and
    Megatron's modules one by one takes ~1.1 s of CPU per process, paid by every rank of every job, converter and
    test. Call it once the process's work is closed (the trainers close their logs, manifest and checkpoints, and
    the process groups are shut down, before it); standard output, standard error and ``logging`` are flushed
    here. Atexit handlers do not run: the project registers none, and the metrics logger tears W&B down itself."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to flush
            pass
    logging.shutdown()
    os._exit(0 if code is None else code)


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun sets for a rank of a one-machine job."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


Output = Union[int, IO, None]


def start_ranks(cmd: Sequence[str], world: int, *, port: int, env: Mapping[str, str],
                stdout: Union[Output, Sequence[Output]] = None, cwd: Optional[str] = None) -> list:
    """``world`` processes of ``cmd``, rank r with ``env`` and ``rank_env(r, world, port)``; ``stdout`` (stderr
    joins it): one target for all, or one per rank. Each rank gets SIGTERM when this process ends (Linux; the
    kernel sends it when the starting *thread* ends, so a call from another thread sets no parent-death signal
    and leaves it to the rank's ``watch_launcher``). With a zygote (``ZYGOTE_ENV``) a Python command's ranks are
    forked from it (``ZygoteRank``; their ``watch_launcher`` stops them when this process ends)."""
    outputs = list(stdout) if isinstance(stdout, (list, tuple)) else [stdout] * world
    die_with_me = _parent_death_signal() if threading.current_thread() is threading.main_thread() else None
    env = {**env, LAUNCHER_PID_ENV: str(os.getpid())}
    # not inside a Slurm job: its processes belong to the job's cgroup, which a zygote's children would escape
    zygote = env.get(ZYGOTE_ENV) if _forkable(cmd) and "SLURM_JOB_ID" not in env else None
    ranks = []
    for rank in range(world):
        rank_environment = {**env, **rank_env(rank, world, port)}
        forked = ZygoteRank.start(zygote, list(cmd), env=rank_environment, stdout=outputs[rank],
                                  cwd=cwd or os.getcwd()) if zygote else None
        ranks.append(forked or subprocess.Popen(list(cmd), env=rank_environment, stdout=outputs[rank],
                                                stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                                                preexec_fn=die_with_me))
    return ranks


def inherited_state() -> dict:
    """What a process started from this one inherits besides its environment and folder: the file mode mask and
    the resource limits (``ulimit``), for a zygote's child to take on (a rank forked elsewhere)."""
    import resource

    limits = {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource)
              if name.startswith("RLIMIT_")}
    return {"umask": _umask(), "rlimits": limits}


def _umask() -> int:
    """This process's file mode mask, read without changing it where /proc tells it (Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def has_nvidia_gpu() -> bool:
    """Whether this machine has an NVIDIA GPU (its device files), found without starting CUDA: no zygote there,
    as CUDA cannot run in a forked child."""
    return any(os.path.exists(device) for device in ("/dev/nvidiactl", "/dev/nvidia0"))


def _forkable(cmd: Sequence[str]) -> bool:
    """``python -m MODULE ...`` or ``python SCRIPT.py ...`` with this interpreter: what a zygote can become."""
    return (len(cmd) >= 2 and os.path.realpath(cmd[0]) == os.path.realpath(sys.executable)
            and ((cmd[1] == "-m" and len(cmd) >= 3) or cmd[1].endswith(".py")))


class ZygoteRank:
    """A rank the zygote forked, with the part of ``subprocess.Popen`` the watchers use: ``pid`` (its session's
    leader: ``os.killpg`` reaches what it starts), ``args``, ``stdout`` (a pipe's reading end for
    ``subprocess.PIPE``), ``poll``, ``wait``, ``returncode``, ``send_signal``/``terminate``/``kill``. The exit
    status comes over the connection to the zygote, which is the rank's parent."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], stdout: Optional[IO]) -> None:
        self.conn, self.pid, self.args, self.stdout = conn, pid, args, stdout
        self.returncode: Optional[int] = None
        self._buffer = b""

    @classmethod
    def start(cls, path: str, cmd: list[str], *, env: Mapping[str, str], stdout: Output,
              cwd: str) -> Optional["ZygoteRank"]:
        """The rank, or None when the zygote cannot be reached (the caller starts an interpreter instead)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
        except OSError:
            conn.close()
            return None
        reader = None
        if stdout == subprocess.PIPE:
            reader, output = os.pipe()
        elif stdout is None:
            output = os.dup(1)
        else:
            output = os.dup(stdout if isinstance(stdout, int) else stdout.fileno())
        try:
            payload = json.dumps({"argv": cmd, "env": dict(env), "cwd": cwd, **inherited_state()}).encode()
            socket.send_fds(conn, [ZYGOTE_HEADER.pack(len(payload))], [output])
            conn.sendall(payload)
        finally:
            os.close(output)
        rank = cls(conn, -1, cmd, os.fdopen(reader, "rb") if reader is not None else None)
        answer = rank._message(timeout=60.0)
        if answer is not None and "declined" in answer:  # an environment the zygote's imports did not see
            conn.close()
            if rank.stdout is not None:
                rank.stdout.close()
            return None
        if answer is None or "pid" not in answer:
            raise RuntimeError(f"the zygote at {path} did not start {cmd[:3]}: {answer}")
        rank.pid = answer["pid"]
        return rank

    def _message(self, timeout: Optional[float]) -> Optional[dict]:
        """The zygote's next line (None when none came within ``timeout``); its end of the connection closing
        without a status means it is gone: the rank is taken as killed (SIGKILL's status)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.conn], [], [], left)[0]:
                return None
            part = self.conn.recv(4096)
            if not part:
                return {"returncode": -signal.SIGKILL}
            self._buffer += part
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def poll(self) -> Optional[int]:
        """The exit status, or None while the rank runs. The zygote reaps a rank as it ends, so a rank that is
        gone has its status on the way: waited for (where Popen's would still be a zombie to reap)."""
        code = self.wait(timeout=0.0, raising=False)
        if code is None and not _pid_alive(self.pid):
            code = self.wait(timeout=10.0, raising=False)
        return code

    def wait(self, timeout: Optional[float] = None, *, raising: bool = True) -> Optional[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            message = self._message(left)
            if message is None:
                if raising:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                return None
            if "returncode" in message:
                self.returncode = int(message["returncode"])
                self.conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _prctl():
    """libc's prctl, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _parent_death_signal():
    """A ``preexec_fn`` that has the child sent SIGTERM when this process ends; None without prctl."""
    prctl, parent, sigterm = _prctl(), os.getpid(), int(signal.SIGTERM)
    if prctl is None:
        return None

    def die_with_parent() -> None:  # in the child, between fork and exec: keep it to two system calls
        prctl(PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
        if os.getppid() != parent:  # the parent ended before the signal was set
            os.kill(os.getpid(), sigterm)
    return die_with_parent


def watch_launcher() -> None:
    """In a rank started by ``start_ranks`` (a no-op elsewhere, and when called again): a daemon thread that, once
    the launcher has ended, sends this rank SIGTERM (again, where prctl sent it: a stop flag set twice) and
    SIGKILLs its process group ``STOP_GRACE_S`` later: nobody else would end a rank that does not stop (a save
    that hangs, a peer that never answers). The variable is removed, so what the rank starts does not take the
    rank for its launcher. A rank a zygote forked (its parent is the zygote) watches the launcher's pid."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    forked = os.environ.pop(ZYGOTE_CHILD_ENV, None) is not None
    if launcher is None or (not forked and os.getppid() != int(launcher)):  # not a rank, or already orphaned
        return
    launcher_pid = int(launcher)

    def launcher_alive() -> bool:
        return _pid_alive(launcher_pid) if forked else os.getppid() == launcher_pid

    def watch() -> None:
        while launcher_alive():
            time.sleep(LAUNCHER_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(STOP_GRACE_S)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    threading.Thread(target=watch, name="watch-launcher", daemon=True).start()


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists and has not ended (a zombie, ended but not reaped, counts as ended)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def watch(procs: list[subprocess.Popen], *, timeout: Optional[float] = None, poll_s: float = 0.05) -> int:
    """Wait for the ranks: 0 when all succeed; else the first failing one's code (a signal n as 128 + n), after
    stopping the others. Past ``timeout`` seconds every rank is stopped and ``subprocess.TimeoutExpired`` raised."""
    return watch_ranks(procs, timeout=timeout, poll_s=poll_s).code


@dataclass(frozen=True)
class RanksEnded:
    """How the ranks ended (``watch_ranks``)."""

    code: int
    """0 when every rank succeeded; else the cause's exit code (a signal n as 128 + n)."""
    rank: Optional[int] = None
    """The rank that caused the end (None when all succeeded)."""
    how: str = ""
    """What happened to it, for the line that names it: "failed with exit code N", "was killed by signal N", or
    "was stopped (SIGSTOP or a debugger) and never answered: the others' collectives timed out"."""


def watch_ranks(procs: list[subprocess.Popen], *, timeout: Optional[float] = None,
                poll_s: float = 0.05) -> RanksEnded:
    """``watch``'s exit code and the rank that caused it. A rank that dies makes the others fail in their next
    collective: the first failure seen is the cause, and of failures seen in the same poll, a death by a signal
    (SIGKILL, SIGSEGV, the OOM killer) is taken over an exit with an error. A rank that is stopped (SIGSTOP) when
    another fails is the cause: the others failed waiting for it (parallel.timeout_s)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [rank for rank, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            stopped = [rank for rank, c in enumerate(codes) if c is None and is_stopped(procs[rank].pid)]
            preempted = all(codes[rank] == REQUEUE_EXIT_CODE for rank in failed)  # the others are saving too
            stop(procs, signal.SIGTERM, grace_s=STOP_GRACE_S if preempted else FAILED_GRACE_S)
            if stopped:
                return RanksEnded(code=128 + signal.SIGSTOP, rank=stopped[0],
                                  how="was stopped (SIGSTOP or a debugger) and never answered: the others' "
                                      "collectives timed out waiting for it (parallel.timeout_s)")
            first = min(failed, key=lambda rank: (codes[rank] > 0, rank))
            code = codes[first]
            if code < 0:
                return RanksEnded(code=128 - code, rank=first, how=f"was killed by signal {-code}")
            return RanksEnded(code=code, rank=first, how=f"failed with exit code {code}")
        if all(c == 0 for c in codes):
            return RanksEnded(code=0)
        if deadline is not None and time.monotonic() > deadline:
            stop(procs, signal.SIGTERM)
            raise subprocess.TimeoutExpired([str(a) for a in procs[0].args], timeout)
        time.sleep(poll_s)


def proc_stat(pid: int) -> Optional[list[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, start time at index 19), or None
    when there is no such process or no /proc (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped (state T: SIGSTOP, SIGTSTP; t: held by a debugger), from /proc (Linux)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] in ("T", "t")


def stop(procs: list[subprocess.Popen], sig: int, grace_s: float = STOP_GRACE_S) -> None:
    """Send ``sig`` to every rank still running (its whole process group), SIGKILL after ``grace_s``; SIGKILL at
    once to a stopped one, which would only take ``sig`` once continued."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL if is_stopped(p.pid) else sig)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def kill_leftovers(procs: list[subprocess.Popen]) -> None:
    """Whatever a rank started and left behind when it ended (a killed rank leaves Megatron's multiprocessing
    helpers orphaned) is still in its process group: end them too."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
