"""The sandbox's first process: run by ``sandbox.run_python`` as ``python -I -S sandbox_init.py`` (standard library
only, never imported), it reads one JSON request on stdin, confines itself, then runs the generated code.

``namespaces`` (root with CAP_SYS_ADMIN): new network, mount, PID, IPC and UTS namespaces. This script's child is
the first process (PID 1) of the new PID namespace; in the new mount namespace it makes every mount of the host
read-only, hides the user's home, the run folder and ``/run`` (the host's service sockets) under empty read-only
mounts, gives the code its own ``/tmp``
(its working folder), ``/var/tmp``, ``/dev/shm`` and ``/run/lock`` as folders of one tmpfs capped at ``disk_mib``
(so all its files together count against the one cap), and mounts a fresh ``/proc`` that shows only this PID
namespace. The Python installation is bound back read-only wherever a mount covers it (it may live under the home
folder, or under a folder others may not enter, which is hidden too). The code runs as ``nobody`` under resource
limits; when the first process ends, or when the trainer kills this process group (each process here dies with its
parent), the kernel kills every process the code made, setsid or not. Nothing the code writes outlives the run.

``hooks`` (anyone else): the same resource limits, and a CPython audit hook that refuses sockets, processes,
signals, ctypes, and files outside the private folder and the Python installation. This is a best-effort guard,
not isolation: audit hooks are a policy, not a boundary (PEP 578), and the code runs as the caller with the
caller's files, processes and network a bypass away; it keeps honest mistakes and casual attacks out, not a
determined one. Use the namespaces tier for code you do not trust.

The exit status goes to the file descriptor ``status_fd`` as one JSON line: {"exit": code} or {"signal": number}, or
{"setup": "message"} when confinement failed (then no generated code ran).
"""

import ctypes
import errno
import json
import os
import resource
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_PRIVATE, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1 << 18, 1024, 2048, 1 << 21
MOUNT_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                 "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
"""The per-mount options of /proc/self/mountinfo that a read-only remount keeps."""
CODE_FOLDER = "/tmp"
"""The code's working folder in the namespaces tier (one of its private folders)."""
HIDDEN_ALWAYS = ("/run",)
"""Covered by an empty read-only mount in the namespaces tier: the host's services listen on Unix sockets there
(a database, the container runtime), and a read-only mount does not stop a connect() to a socket file."""
PRIVATE_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""The code's own writable folders in the namespaces tier: folders of one tmpfs capped at ``disk_mib``."""
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
    """In the new mount namespace, as PID 1 of the new PID namespace: every mount read-only, empty read-only mounts
    over the hidden folders, the private folders, and a fresh /proc; the Python installation bound back read-only
    where a mount covered it."""
    os.umask(0o022)  # the mount points made for the Python installation must be enterable by the sandbox user
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    _read_only_everywhere()
    prefixes = [p for p in request["python_prefixes"] if os.path.isdir(p)]
    for hidden in sorted(set(request["hide"]) | set(HIDDEN_ALWAYS) | _closed_ancestors(prefixes)):
        if not os.path.isdir(hidden) or os.path.commonpath([hidden, CODE_FOLDER]) == hidden:
            continue
        held = _hold(prefixes, [hidden])
        _mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        for folder in PRIVATE_FOLDERS:  # a private folder under it (/run/lock) gets its mount point back
            if os.path.dirname(folder) == hidden:
                os.mkdir(folder)
        _bind_back(held)
        _mount(None, hidden, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    _private_folders(int(request["limits"]["disk_mib"]), prefixes)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def _read_only_everywhere():
    """Remount every mount of this namespace read-only (a bind remount: the host's mounts keep their flags)."""
    with open("/proc/self/mountinfo") as table:
        mounts = {}
        for line in table:
            fields = line.split()
            mounts[_unescape(fields[4])] = fields[5].split(",")  # the last mount at a point is the one on top
    for point, options in mounts.items():
        if "ro" in options:
            continue
        keep = sum(MOUNT_OPTIONS.get(option, 0) for option in options)
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None)
        except OSError as error:
            if error.errno not in (errno.EINVAL, errno.ENOENT):  # not a mount point here: shadowed, or deleted
                raise


def _unescape(field):
    """A path of /proc/self/mountinfo: the kernel writes space, tab, newline and backslash as octal escapes."""
    first, *rest = field.split("\\")
    return first + "".join(chr(int(part[:3], 8)) + part[3:] for part in rest)


def _private_folders(disk_mib, prefixes):
    """One tmpfs capped at ``disk_mib``, its folders bound over PRIVATE_FOLDERS (those the host has)."""
    held = _hold(prefixes, PRIVATE_FOLDERS)
    _mount("tmpfs", CODE_FOLDER, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mib}m,nr_inodes=4096,mode=0755")
    handles = {}
    for folder in PRIVATE_FOLDERS:
        inside = os.path.join(CODE_FOLDER, folder.strip("/").replace("/", "_"))
        os.mkdir(inside)
        os.chmod(inside, 0o1777)
        handles[folder] = os.open(inside, os.O_PATH | os.O_DIRECTORY)
    for folder, handle in handles.items():  # by handle: binding over /tmp covers the tmpfs's root
        if os.path.isdir(folder):
            _mount(f"/proc/self/fd/{handle}", folder, None, MS_BIND, None)
        os.close(handle)
    _bind_back(held)


def _hold(prefixes, folders):
    """Handles on the Python installation's folders that lie under ``folders``, taken before mounts cover them."""
    return {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in prefixes
            if any(os.path.commonpath([folder, p]) == folder for folder in folders)}


def _bind_back(held):
    """Bind the held folders back read-only at their paths, over whatever now covers them."""
    for prefix, handle in held.items():
        os.makedirs(prefix, exist_ok=True)
        _mount(f"/proc/self/fd/{handle}", prefix, None, MS_BIND | MS_REC, None)
        _mount(None, prefix, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
        os.close(handle)


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
            request["workdir"] = CODE_FOLDER
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
