"""The sandbox's first process: run by ``sandbox.run_python`` as ``python -I -S sandbox_init.py`` (standard library
only, never imported), it reads one JSON request on stdin, confines itself, then runs the generated code.

``namespaces`` (root with CAP_SYS_ADMIN): new network, mount, PID, IPC and UTS namespaces. The code runs as
``nobody`` under resource limits, in a size-capped tmpfs over its private folder, with the user's home and the run
folder hidden under empty read-only mounts (the Python installation bound back read-only when it lives there, or
under a folder others may not enter). Its
PID namespace's first process is this script's child: when it ends, or when the trainer kills this process group
(each process here dies with its parent), the kernel kills every process the code made, setsid or not.

``hooks`` (anyone else): the same resource limits, and a CPython audit hook that refuses sockets, processes,
signals, ctypes, and files outside the private folder and the Python installation. Audit hooks are a policy, not
a boundary (PEP 578): this tier keeps honest mistakes and casual attacks out, not a determined one.

The exit status goes to the file descriptor ``status_fd`` as one JSON line: {"exit": code} or {"signal": number}, or
{"setup": "message"} when confinement failed (then no generated code ran).
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
STATUS_FD = [-1]

_libc = ctypes.CDLL(None, use_errno=True)


def _report(status):
    with os.fdopen(STATUS_FD[0], "w") as out:
        out.write(json.dumps(status) + "\n")


def _die_with_parent():
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _mount(source, target, fstype, flags, data):
    def b(text):
        return None if text is None else text.encode()
    if _libc.mount(b(source), b(target), b(fstype), flags, b(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype or source} on {target}: {os.strerror(errno)}")


def _limits(request):
    limits = request["limits"]
    cpu = int(limits["cpu_s"])
    memory = int(limits["memory_mib"]) << 20
    file_bytes = int(limits["file_mib"]) << 20
    for name, value in (("RLIMIT_CPU", (cpu, cpu + 1)), ("RLIMIT_AS", (memory, memory)),
                        ("RLIMIT_FSIZE", (file_bytes, file_bytes)), ("RLIMIT_CORE", (0, 0)),
                        ("RLIMIT_NOFILE", (64, 64))):
        resource.setrlimit(getattr(resource, name), value)
    # A write past the file limit raises OSError (EFBIG) in the code instead of killing it.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _confine_mounts(request):
    """In the new mount namespace: a size-capped tmpfs over the work folder, empty read-only mounts over the hidden
    folders, and the Python installation bound back read-only where a hidden folder covered it."""
    work = request["workdir"]
    limits = request["limits"]
    os.umask(0o022)  # the mount points made for the Python installation must be enterable by the sandbox user
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={int(limits['disk_mib'])}m,nr_inodes=4096,mode=0700,uid={request['uid']},gid={request['uid']}")
    prefixes = [p for p in request["python_prefixes"] if os.path.isdir(p)]
    for hidden in sorted(set(request["hide"]) | _closed_ancestors(prefixes)):
        if not os.path.isdir(hidden) or os.path.commonpath([hidden, work]) == hidden:
            continue
        covered = [p for p in prefixes if os.path.commonpath([hidden, p]) == hidden]
        handles = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in covered}
        _mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        for prefix, handle in handles.items():
            os.makedirs(prefix, exist_ok=True)
            _mount(f"/proc/self/fd/{handle}", prefix, None, MS_BIND | MS_REC, None)
            _mount(None, prefix, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
            os.close(handle)
        _mount(None, hidden, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=0755")


def _closed_ancestors(paths):
    """The first folder above each path that others may not enter (a 0700 home holding the Python installation):
    hidden like the home folder, so that the installation can be bound back where ``nobody`` reaches it."""
    closed = set()
    for path in paths:
        parts = path.strip("/").split("/")
        for depth in range(1, len(parts)):
            folder = "/" + "/".join(parts[:depth])
            if not os.stat(folder).st_mode & 0o001:
                closed.add(folder)
                break
    return closed


def _write_code(request, owner):
    path = os.path.join(request["workdir"], "main.py")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(request["code"])
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def _exec_code(request, argv):
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": request["workdir"], "TMPDIR": request["workdir"],
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
    os.chdir(request["workdir"])
    os.execve(request["python"], argv, env)


def _run_in_namespaces(request):
    os.unshare(os.CLONE_NEWNS | os.CLONE_NEWNET | os.CLONE_NEWPID | os.CLONE_NEWIPC | os.CLONE_NEWUTS)
    first = os.fork()  # PID 1 of the new PID namespace: when it exits, the kernel kills the rest
    if first == 0:
        try:
            _die_with_parent()
            _confine_mounts(request)
            _write_code(request, request["uid"])
        except Exception as error:  # noqa: BLE001 - reported as a setup failure, no code ran
            _report({"setup": f"{type(error).__name__}: {error}"})
            os._exit(0)
        code_pid = os.fork()
        if code_pid == 0:
            try:
                _die_with_parent()
                _limits(request)
                resource.setrlimit(resource.RLIMIT_NPROC, (int(request["limits"]["processes"]),) * 2)
                os.setgroups([])
                os.setgid(request["uid"])
                os.setuid(request["uid"])
                _exec_code(request, [request["python"], "-I", "-S", "-B", "main.py"])
            except Exception as error:  # noqa: BLE001 - no code ran
                _report({"setup": f"{type(error).__name__}: {error}"})
            os._exit(127)
        deadline = time.monotonic() + float(request["limits"]["wall_s"]) + 1.0
        signal.signal(signal.SIGALRM, lambda *_: None)
        status = None
        while status is None and time.monotonic() < deadline:
            signal.setitimer(signal.ITIMER_REAL, max(0.01, deadline - time.monotonic()))
            try:
                pid, raw = os.wait()  # as PID 1 this also reaps the code's orphans
            except InterruptedError:
                continue
            except ChildProcessError:
                break
            if pid == code_pid:
                status = raw
        signal.setitimer(signal.ITIMER_REAL, 0)
        if status is None:
            _report({"signal": int(signal.SIGKILL)})
        elif os.WIFSIGNALED(status):
            _report({"signal": os.WTERMSIG(status)})
        else:
            _report({"exit": os.WEXITSTATUS(status)})
        os._exit(0)
    os.waitpid(first, 0)


_HOOK = r'''
import os as _os, sys as _sys
_WORK = _os.path.realpath(%(workdir)r)
_READ = tuple(_os.path.realpath(p) for p in %(python_prefixes)r) + ("/dev/null", "/dev/urandom")
_REFUSED = ("socket.", "ctypes.", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
            "subprocess.", "pty.", "os.kill", "os.killpg", "signal.pthread_kill", "sys.addaudithook", "os.setuid",
            "os.chroot", "os.unshare", "os.setns", "resource.setrlimit", "resource.prlimit", "sys.setprofile")
_PATH_EVENTS = {"open", "os.listdir", "os.scandir", "os.chdir", "os.remove", "os.rename", "os.rmdir", "os.mkdir",
                "os.chmod", "os.chown", "os.truncate", "os.link", "os.symlink", "os.utime", "shutil.rmtree",
                "shutil.copyfile", "shutil.move", "os.walk", "glob.glob", "pathlib.Path.glob"}
_READ_EVENTS = {"open", "os.listdir", "os.scandir", "os.walk", "glob.glob", "pathlib.Path.glob"}
_MODULES = ("_posixsubprocess", "_ctypes", "_socket", "_multiprocessing", "fcntl", "_posixshmem")
_files = [0]

def _inside(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

def _hook(event, args):
    if event.startswith(_REFUSED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0] in _MODULES:
        raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
    if event in _PATH_EVENTS and args and isinstance(args[0], (str, bytes, _os.PathLike)):
        path = _os.path.realpath(_os.fsdecode(args[0]))
        writing = event not in _READ_EVENTS or (event == "open" and (
            (len(args) > 2 and isinstance(args[2], int) and args[2] & 0o3) or
            (len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"))))
        if _inside(path, (_WORK,)):
            if event == "open" and writing and not _os.path.exists(path):
                _files[0] += 1
                if _files[0] > %(max_files)d:
                    raise PermissionError("sandbox: too many files")
            return
        if not writing and _inside(path, _READ):
            return
        raise PermissionError(f"sandbox: {path} is outside the sandbox")

for _name in _MODULES:
    _sys.modules.pop(_name, None)
_code = open("main.py").read()
_sys.addaudithook(_hook)
_sys.argv = ["main.py"]
del _name
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''


def _run_with_hooks(request):
    _write_code(request, None)
    _limits(request)
    prelude = _HOOK % {"workdir": request["workdir"], "python_prefixes": request["python_prefixes"],
                       "max_files": max(1, int(request["limits"]["disk_mib"]) // max(1, int(request["limits"]["file_mib"])))}
    pid = os.fork()
    if pid == 0:
        try:
            _exec_code(request, [request["python"], "-I", "-S", "-B", "-c", prelude])
        except Exception as error:  # noqa: BLE001 - no code ran
            _report({"setup": f"{type(error).__name__}: {error}"})
        os._exit(127)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        _report({"signal": os.WTERMSIG(status)})
    else:
        _report({"exit": os.WEXITSTATUS(status)})


def main():
    _die_with_parent()
    request = json.loads(sys.stdin.readline())
    STATUS_FD[0] = int(request["status_fd"])
    if os.getppid() != int(request["parent"]):
        os._exit(1)  # the trainer died before PDEATHSIG was set
    sys.stdin.close()
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 for the code: nothing to read
    try:
        if request["isolation"] == "namespaces":
            _run_in_namespaces(request)
        else:
            _run_with_hooks(request)
    except Exception as error:  # noqa: BLE001 - reported as a setup failure
        _report({"setup": f"{type(error).__name__}: {error}"})


if __name__ == "__main__":
    main()
