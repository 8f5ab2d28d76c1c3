"""A zygote: one process that has imported what every rank imports (torch, and Megatron with this project's patches
applied, as ``distributed.initialize`` applies them), then forks ranks on request, so a rank starts in
milliseconds instead of the ~4 s of CPU its imports take.

    python -m megatron_rl.runtime.zygote SOCKET     # serves until its starter ends, or SIGTERM

``megatron_rl.spec.local_ranks.start_ranks`` uses it when ``MEGATRON_RL_ZYGOTE`` names its socket (the test suite
starts one for its session, tests/conftest.py): every local job, torchrun check and converter worker of the suite
then starts this way. A rank is asked for as a command line, ``python -m MODULE ARGS`` or ``python SCRIPT ARGS``
(the interpreter must be this one), with its whole environment, working folder and output file; the forked child
takes them (and its starter's file mode mask and resource limits), starts a session of its own, runs the module or script as ``__main__`` with the ``sys.path`` that
interpreter would have had, and exits with its code. Nothing of the project is imported before the fork (only
third-party modules, and the patches' own modules), so the child runs the code on disk as a fresh rank would.
The starter learns the child's pid at once and its exit status when it ends (``local_ranks.ZygoteRank``).

A child shows its own command line (``ps``, ``/proc/PID/cmdline``: what finds a job's ranks): it writes it over
the zygote's, which reserved the room by starting itself again with a long last argument. Differences from an
exec'd rank, by design: ``/proc/PID/environ`` shows the zygote's starting environment (the rank's is in
``os.environ``); the interpreter's flags and hash seed are the zygote's; warnings raised by the preloaded imports
were shown once, in the zygote's output.
"""

from __future__ import annotations

import io
import json
import os
import resource
import runpy
import select
import signal
import socket
import sys
import traceback
from typing import Any

from megatron_rl.spec.local_ranks import ZYGOTE_CHILD_ENV, ZYGOTE_HEADER, ZYGOTE_MAX_REQUEST, has_nvidia_gpu

COMMAND_ROOM = 8192
"""Bytes of command line the zygote reserves for its children's (``show_command_line``)."""
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED")
"""Variables the preloaded libraries (OpenMP's thread count) or the interpreter read once, at start: a request
whose value differs from the zygote's is declined, and its starter starts an interpreter instead. (CUDA's are
read when CUDA starts, in the child: a zygote runs only where there is no GPU, ``main``.)"""
PRELOADED = ("megatron.core.models.gpt.gpt_model", "megatron.core.optimizer", "megatron.core.distributed",
             "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing", "torch.distributed.checkpoint")
"""Megatron and torch modules every trainer rank imports, loaded once here after the patches."""


def preload() -> None:
    """What ``distributed.initialize`` does before Megatron's first import (``prepare_megatron_import``), then the
    modules every rank imports. The child's own ``initialize`` finds the preparation done."""
    import importlib

    from megatron_rl.runtime.distributed import prepare_megatron_import

    prepare_megatron_import()
    for name in PRELOADED:
        importlib.import_module(name)


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """(the request, the file descriptors sent with it): a length header carrying the descriptors, then JSON."""
    header, fds, _, _ = socket.recv_fds(conn, ZYGOTE_HEADER.size, 2)
    if len(header) < ZYGOTE_HEADER.size:
        header += _read_exactly(conn, ZYGOTE_HEADER.size - len(header))
    (size,) = ZYGOTE_HEADER.unpack(header)
    if size > ZYGOTE_MAX_REQUEST:
        raise ValueError(f"a request of {size} bytes")
    return json.loads(_read_exactly(conn, size)), fds


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            raise ConnectionError("the starter closed the connection mid-request")
        data += part
    return data


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:  # the starter is gone; its ranks still run and end on their own
        pass


def child_path(argv: list[str], env: dict[str, str], cwd: str, base_path: list[str]) -> list[str]:
    """``sys.path`` of ``python ARGV`` started in ``cwd`` with ``env``: the script's folder (or the working folder
    for ``-m``), then PYTHONPATH's entries, then the interpreter's own (``base_path``)."""
    first = cwd if argv[1] == "-m" else os.path.dirname(os.path.abspath(os.path.join(cwd, argv[1])))
    extra = [os.path.abspath(os.path.join(cwd, p)) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *extra, *base_path]


def show_command_line(argv: list[str]) -> bool:
    """Write ``argv`` over this process's command line (the memory ``/proc/self/cmdline`` reads, whose bounds
    ``/proc/self/stat`` gives), NUL-padded; cut to the room there is. CPython and the C library keep their own
    copies of the arguments after start, except ``program_invocation_name`` (argv[0]), which a rank's command
    begins with as the zygote's does. False where there is no /proc (not Linux)."""
    import ctypes

    try:
        with open("/proc/self/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of stat(5)
    room = end - start
    data = b"\0".join(os.fsencode(a) for a in argv)[:room - 1] + b"\0"
    ctypes.memmove(start, data.ljust(room, b"\0"), room)
    return True


def _stdio(unbuffered: bool) -> None:
    """Fresh text streams on descriptors 1 and 2, buffered as an interpreter started with this environment
    buffers them (PYTHONUNBUFFERED: write-through; else stdout by blocks unless a terminal, stderr by lines)."""
    def stream(fd: int, line_buffering: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                                line_buffering=line_buffering, write_through=unbuffered)

    sys.stdout = sys.__stdout__ = stream(1, os.isatty(1))
    sys.stderr = sys.__stderr__ = stream(2, True)


def run_child(request: dict, output: int, base_path: list[str]) -> int:
    """In the forked child: become the requested rank (see the module docstring) and run it; its exit code."""
    argv, env, cwd = request["argv"], request["env"], request["cwd"]
    os.setsid()
    os.umask(request["umask"])
    for name, (soft, hard) in request["rlimits"].items():
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError):  # above the zygote's hard limit: the rank keeps the zygote's
            pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    for fd in {null, output}:
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ[ZYGOTE_CHILD_ENV] = "1"
    show_command_line(argv)
    _stdio(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
    sys.path[:] = child_path(argv, env, cwd, base_path)
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            runpy.run_path(argv[1], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def serve(path: str) -> None:
    """Listen on the Unix socket ``path`` (0600) and fork a rank for each request until the process that started
    this one ends or SIGTERM comes. Single-threaded, so forking is safe: a child's end wakes the loop through
    SIGCHLD's wake-up descriptor, and the loop tells the child's starter its exit status."""
    starter = os.getppid()
    base_path = sys.path[1:]  # without the zygote's own first entry (its working folder)
    extra = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    base_path = [p for p in base_path if os.path.abspath(p) not in extra]
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old_mask)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    children: dict[int, socket.socket] = {}
    print(f"zygote: ready on {path}", flush=True)
    while not stopping and os.getppid() == starter:
        ready, _, _ = select.select([listener, wake_read], [], [], 1.0)
        if wake_read in ready:
            os.read(wake_read, 4096)
        if listener in ready:
            conn, _ = listener.accept()
            try:
                request, fds = _read_request(conn)
            except (OSError, ValueError) as error:
                _send(conn, {"error": f"{type(error).__name__}: {error}"})
                conn.close()
                continue
            declined = [key for key in IMPORT_TIME_ENV if request["env"].get(key) != os.environ.get(key)]
            if declined:
                for fd in fds:
                    os.close(fd)
                _send(conn, {"declined": f"{declined[0]} differs from the zygote's"})
                print(f"zygote: declined {request['argv'][1:3]}: {declined[0]} differs", flush=True)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGCHLD, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                listener.close()
                for other in children.values():
                    other.close()
                os.close(wake_read)
                os.close(wake_write)
                conn.close()
                os._exit(run_child(request, fds[0], base_path))
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            _send(conn, {"pid": pid})
            print(f"zygote: forked {pid} for {request['argv'][1:3]}", flush=True)
        _reap(children)
    listener.close()
    os.unlink(path)


def _reap(children: dict[int, Any]) -> None:
    """Tell each ended child's starter its exit status, as ``Popen.returncode`` gives it (-N for signal N)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            conn.close()


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m megatron_rl.runtime.zygote SOCKET", file=sys.stderr)
        return 2
    if has_nvidia_gpu():
        print("zygote: this machine has an NVIDIA GPU; CUDA cannot run in forked children, so the ranks here start "
              "as interpreters (leave MEGATRON_RL_ZYGOTE unset)", file=sys.stderr)
        return 2
    if len(argv) == 1:  # again, with room for the children's command lines (show_command_line)
        os.execv(sys.executable, [sys.executable, "-m", "megatron_rl.runtime.zygote", argv[0], "_" * COMMAND_ROOM])
    serve(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

