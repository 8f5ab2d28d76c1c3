"""Run generated Python in a sandbox; whatever the code does, the caller gets a short result within ``wall_s``.

``run_python(code, limits)`` starts ``sandbox_init.py`` (a script of the standard library only) as a new process
group and hands it the code. Where this process is root and may make namespaces (``isolation="namespaces"``), the
code runs as ``nobody`` with no network, in its own PID namespace (a fresh ``/proc`` shows only its processes) and
mount namespace: every host mount read-only, the home and run folders hidden, and a private ``/tmp`` (its working
folder), ``/var/tmp``, ``/dev/shm`` and ``/run/lock``, all folders of one tmpfs capped at ``disk_mib`` that vanishes
with the run. Elsewhere (``"hooks"``) it runs as the caller under an audit hook that refuses sockets, processes,
signals and files outside its folder: a best-effort guard against mistakes, not isolation (a hook is a policy, not
a boundary; code that gets around it has the caller's rights). Both tiers set CPU-time, memory and file-size
limits; the caller kills the whole group at ``wall_s`` and as soon as the output passes ``output_bytes``. In the
namespaces tier nothing the code does reaches the caller but the result: a hang, a crash, a fork bomb, a full disk
or megabytes of output each become a short ``SandboxResult.observation()``.

Test: ``.venv/bin/python -m pytest tests/test_sandbox.py -q``
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Sequence

INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")

NOBODY = 65534
"""The user and group the code runs as in the namespaces tier."""

Isolation = Literal["auto", "namespaces", "hooks"]


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What one run of generated code may use."""

    wall_s: float = 10.0
    """Wall-clock seconds before the whole process group is killed."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU)."""
    memory_mib: int = 1024
    """Address space (RLIMIT_AS)."""
    file_mib: int = 16
    """Largest file the code may write (RLIMIT_FSIZE); a larger write raises OSError in the code."""
    disk_mib: int = 64
    """All files together: the size of the one tmpfs behind the private /tmp, /var/tmp, /dev/shm and /run/lock
    (namespaces), or that many files of ``file_mib`` in its folder (hooks)."""
    processes: int = 16
    """Processes of the sandbox user (RLIMIT_NPROC; namespaces). The hooks tier allows no new process."""
    output_bytes: int = 16384
    """Output (stdout and stderr together) read before the code is killed; the observation keeps less."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {value}")


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    output: str
    """What the code printed (stdout and stderr, in order), cut at ``output_bytes``."""
    reason: Literal["ok", "error", "timeout", "killed", "output_limit", "setup"]
    """ok: exit 0; error: another exit code; timeout: killed at wall_s; killed: a signal (CPU or memory limit);
    output_limit: killed for printing too much; setup: the sandbox could not be made (no code ran)."""
    exit_code: int | None
    isolation: str
    seconds: float

    def observation(self, max_chars: int = 1000) -> str:
        """The short text an environment shows the policy: the output's end, and why the run stopped if not ok."""
        text = self.output
        if len(text) > max_chars:
            text = "..." + text[-(max_chars - 3):]
        notes = {"ok": "", "error": f"[exit code {self.exit_code}]", "timeout": "[timed out]",
                 "killed": "[killed: out of CPU time or memory]", "output_limit": "[output too long; stopped]",
                 "setup": "[sandbox error]"}
        return (text.rstrip() + ("\n" if text.strip() and notes[self.reason] else "") + notes[self.reason]).strip()


_HIDDEN: set[str] = set()


def hide_always(folders: Sequence[str | os.PathLike]) -> None:
    """Hide these folders (the run folder) from every later sandbox of this process, besides the home folder."""
    _HIDDEN.update(os.path.realpath(folder) for folder in folders)


@functools.cache
def namespaces_available() -> bool:
    """Root with the capability to make namespaces (checked once, in a child process)."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and hasattr(os, "unshare")):
        return False
    probe = subprocess.run([sys.executable, "-I", "-S", "-c",
                            "import os; os.unshare(os.CLONE_NEWNS | os.CLONE_NEWNET | os.CLONE_NEWPID)"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def python_prefixes() -> list[str]:
    """The folders the sandboxed interpreter reads (its installation)."""
    return sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)})


def base_python() -> str:
    """The interpreter the code runs on: the installation's own, not a virtual environment's (standard library
    only, ``-I -S``)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (Path(sys.base_prefix) / "bin" / version, Path(sys.base_prefix) / "bin" / "python3"):
        if candidate.exists():
            return str(candidate.resolve())
    return os.path.realpath(sys.executable)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, hide: Sequence[str | os.PathLike] = (),
               isolation: Isolation = "auto") -> SandboxResult:
    """Run ``code`` in the sandbox and return what it printed and how it ended, within ``limits.wall_s`` (plus the
    sandbox's start, tens of milliseconds). ``hide``: folders the code must not see besides the home folder and
    those of ``hide_always``."""
    if isolation == "auto":
        isolation = "namespaces" if namespaces_available() else "hooks"
    elif isolation == "namespaces" and not namespaces_available():
        raise ValueError("sandbox isolation 'namespaces' needs root and the right to make namespaces; use 'hooks'")
    started = time.monotonic()
    # The namespaces tier's code works in its private /tmp, made in its mount namespace: nothing on the host.
    workdir = tempfile.mkdtemp(prefix="sandbox-") if isolation == "hooks" else None
    hidden = sorted({os.path.realpath(p) for p in [Path.home(), *hide]} | _HIDDEN)
    request = {"code": code, "limits": asdict(limits), "isolation": isolation, "workdir": workdir, "hide": hidden,
               "python": base_python(), "python_prefixes": python_prefixes(), "parent": os.getpid(), "uid": NOBODY}
    status_read, status_write = os.pipe()
    request["status_fd"] = status_write
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(INIT_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, pass_fds=(status_write,), start_new_session=True, cwd=workdir or "/",
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        os.close(status_write)
        status_write = -1
        output, stopped = _read_output(proc, request, limits, started)
        status = _read_status(status_read)
    finally:
        if status_write >= 0:
            os.close(status_write)
        os.close(status_read)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    text = output.decode("utf-8", errors="replace")
    seconds = time.monotonic() - started
    if stopped:
        return SandboxResult(output=text, reason=stopped, exit_code=None, isolation=isolation, seconds=seconds)
    if "setup" in status:
        return SandboxResult(output=status["setup"], reason="setup", exit_code=None, isolation=isolation,
                             seconds=seconds)
    if "signal" in status:
        return SandboxResult(output=text, reason="killed", exit_code=None, isolation=isolation, seconds=seconds)
    code_exit = status.get("exit")
    return SandboxResult(output=text, reason="ok" if code_exit == 0 else "error", exit_code=code_exit,
                         isolation=isolation, seconds=seconds)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group; in the namespaces tier that ends its PID namespace, and with it every
    process the code made."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_output(proc: subprocess.Popen, request: dict, limits: SandboxLimits, started: float) -> tuple[bytes, str]:
    """The code's output, and "" when it ended by itself, or why it was killed ("timeout", "output_limit")."""
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write((json.dumps(request) + "\n").encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    deadline = started + limits.wall_s
    chunks: list[bytes] = []
    size = 0
    stopped = ""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = "timeout"
                break
            if not selector.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            chunks.append(chunk[: limits.output_bytes - size])
            size += len(chunk)
            if size > limits.output_bytes:
                stopped = "output_limit"
                break
    if stopped:
        _kill_group(proc)
    else:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stopped = "timeout"
        _kill_group(proc)  # whatever the code left behind in the group
    proc.stdout.close()
    return b"".join(chunks), stopped


def _read_status(fd: int) -> dict:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        data = b""
    try:
        return json.loads(data.decode().partition("\n")[0] or "{}")
    except ValueError:
        return {}
