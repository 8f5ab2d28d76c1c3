"""The sandbox, attacked: secrets in the home and run folders, sockets, a fork bomb, a 10 GB write, an infinite loop,
a sleep, megabytes of output, memory, killing the trainer, and (namespaces) writing to every folder of the host it
can find, filling /dev/shm and /tmp past the cap, and listing the host's processes. Each is contained, ends as a
short observation within its limits, and leaves the test process (the trainer) unharmed and no process or file
behind. Both tiers run: namespaces where this machine allows them (root), and the audit-hook tier everywhere."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.environments import sandbox
from megatron_rl.environments.sandbox import SandboxLimits, run_python

TIERS = ["hooks"] + (["namespaces"] if sandbox.namespaces_available() else [])
LIMITS = SandboxLimits(wall_s=2.5, cpu_s=1, memory_mib=512, file_mib=8, disk_mib=32, processes=16,
                       output_bytes=8192)
SECRET = "s3cr3t-key-material"


@pytest.fixture
def secrets(tmp_path, monkeypatch):
    """A home folder with ~/.ssh/id_rsa and a run folder with a checkpoint, both holding SECRET."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text(SECRET)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"wandb_key: {SECRET}\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    return home, run_dir


def _sandbox_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["uids", "cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.info["uids"] and proc.info["uids"].real == sandbox.NOBODY or "sandbox_init.py" in cmdline \
                    or cmdline.endswith("main.py"):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _run(code: str, tier: str, run_dir=None, limits: SandboxLimits = LIMITS):
    started = time.monotonic()
    result = run_python(code, limits, isolation=tier, hide=[run_dir] if run_dir else [])
    elapsed = time.monotonic() - started
    assert elapsed < limits.wall_s + 3.0, f"{tier}: took {elapsed:.1f}s"
    assert len(result.observation()) <= 1000 + 60
    assert SECRET not in result.output
    assert result.isolation == tier
    return result


@pytest.mark.parametrize("tier", TIERS)
def test_plain_code_runs_and_a_crash_is_an_observation(tier):
    private = os.umask(0o077)  # the job's private umask (megatron_rl.spec.private): the sandbox must still run
    try:
        assert _run("print(6 * 7)", tier).observation() == "42"
    finally:
        os.umask(private)
    crash = _run("raise ValueError('boom')", tier)
    assert crash.reason == "error" and crash.exit_code == 1
    assert crash.observation().endswith("ValueError: boom\n[exit code 1]")


@pytest.mark.parametrize("tier", TIERS)
def test_secrets_in_the_home_and_run_folders_and_the_environment_stay_out(tier, secrets):
    home, run_dir = secrets
    for code in (f"print(open({str(home / '.ssh' / 'id_rsa')!r}).read())",
                 "import os; print(open(os.path.expanduser('~/.ssh/id_rsa')).read())",
                 f"print(open({str(run_dir / 'config.yaml')!r}).read())",
                 f"import os; print('LISTED', os.listdir({str(run_dir)!r}))",
                 "import os; print(os.environ)"):
        result = _run(code, tier, run_dir)
        assert "LISTED" not in result.output or "config.yaml" not in result.output.split("LISTED")[1], code
    assert _run("import os; print(os.environ.get('WANDB_API_KEY'))", tier).output.strip() == "None"


@pytest.mark.parametrize("tier", TIERS)
def test_no_network(tier):
    result = _run("import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=2)\nprint('connected')",
                  tier)
    assert result.reason == "error" and "connected" not in result.output
    listen = _run("import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 0))\ns.listen()\n"
                  "print('listening', s.getsockname())", tier)
    # A listening socket inside a network namespace is reachable from nowhere; the hook tier refuses the socket.
    assert listen.reason == ("ok" if tier == "namespaces" else "error")


@pytest.mark.parametrize("tier", TIERS)
def test_a_fork_bomb_is_contained_and_leaves_nothing_behind(tier):
    result = _run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", tier)
    assert result.reason in ("error", "timeout", "killed")
    deadline = time.monotonic() + 5
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _sandbox_processes()


@pytest.mark.parametrize("tier", TIERS)
def test_a_10_gb_write_fills_nothing(tier):
    free_before = shutil.disk_usage("/tmp").free
    result = _run("import os\nfor n in range(100):\n    with open(f'f{n}', 'wb') as f:\n"
                  "        for _ in range(100):\n            f.write(b'0' * (1 << 20))\nprint('wrote 10 GB')", tier)
    assert result.reason == "error" and "wrote" not in result.output
    assert "File too large" in result.output or "No space left" in result.output or "too many files" in result.output
    assert shutil.disk_usage("/tmp").free > free_before - (1 << 30)  # 1 GiB of slack for other tests' writes


@pytest.mark.parametrize("tier", TIERS)
def test_a_loop_a_sleep_and_a_flood_are_stopped(tier):
    loop = _run("while True:\n    pass", tier)
    assert loop.reason in ("killed", "timeout") and loop.seconds < LIMITS.wall_s + 1
    sleep = _run("import time\ntime.sleep(600)", tier)
    assert sleep.reason == "timeout" and sleep.observation() == "[timed out]"
    flood = _run("while True:\n    print('x' * 1000)", tier)
    assert flood.reason == "output_limit" and len(flood.output) <= LIMITS.output_bytes
    assert flood.observation(100).endswith("[output too long; stopped]")
    memory = _run("x = bytearray(4 << 30)\nprint('allocated')", tier)
    assert memory.reason in ("error", "killed") and "allocated" not in memory.output


@pytest.mark.parametrize("tier", TIERS)
def test_the_code_cannot_kill_the_trainer(tier):
    me = os.getpid()
    for code in (f"import os, signal\nos.kill({me}, signal.SIGKILL)", "import os, signal\nos.kill(-1, signal.SIGKILL)",
                 "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.killpg(0, signal.SIGKILL)"):
        _run(code, tier)
    assert psutil.pid_exists(me)
    assert _run("print('still here')", tier).output.strip() == "still here"


def test_the_hooks_tier_refuses_a_subprocess_and_ctypes():
    for code in ("import subprocess\nprint(subprocess.run(['id'], capture_output=True).stdout)",
                 "import ctypes\nprint(ctypes.CDLL(None).getpid())",
                 "import os\nos.system('id')"):
        result = _run(code, "hooks")
        assert result.reason == "error" and "not allowed" in result.output, code


_ESCAPE_PROBE = r'''
import json, os
MARKER = %(marker)r
folders = {"/tmp", "/var/tmp", "/dev/shm", "/run", "/run/lock", "/root", "/home", "/etc", "/var", "/", os.getcwd(),
           *%(callers)r}
for line in open("/proc/self/mountinfo"):
    folders.add(line.split()[4].encode().decode("unicode_escape"))

def walk(folder, depth):
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and entry.path not in ("/proc", "/sys"):
            folders.add(entry.path)
            if depth > 1:
                walk(entry.path, depth - 1)

walk("/", 3)
created = []
for folder in sorted(folders):
    try:
        fd = os.open(os.path.join(folder, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        continue
    os.write(fd, b"escaped")
    os.close(fd)
    created.append(folder)
filled = {}
for folder in ("/dev/shm", "/tmp"):
    written, error = 0, None
    try:
        for n in range(10):
            with open(os.path.join(folder, f"{MARKER}-fill-{n}"), "wb") as out:
                for _ in range(8):
                    out.write(b"0" * (1 << 20))
                    out.flush()
                    written += 1 << 20
    except OSError as exc:
        error = exc.errno
    filled[folder] = [written, error]
pids = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
import stat
sockets = []
for folder in sorted(folders):
    try:
        sockets += [entry.path for entry in os.scandir(folder)
                    if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)]
    except OSError:
        pass
print(json.dumps({"tried": sorted(folders), "created": created, "filled": filled, "pids": pids, "me": os.getpid(),
                  "sockets": sorted(set(sockets))}))
'''


@pytest.mark.skipif("namespaces" not in TIERS, reason="the namespaces tier needs root and the right to make namespaces")
def test_the_namespaces_tier_keeps_the_code_off_the_host(tmp_path):
    """Code that tries to create a file in every folder it can find (the mount table, a walk of the tree, the usual
    world-writable folders, the caller's folders and a world-writable scratch folder like a cluster's), fills /dev/shm
    and /tmp with 80 MiB each past disk_mib=64, lists /proc and looks for Unix sockets: nothing lands on the host,
    the fill stops at the cap, the code sees its own PID namespace only and no host service's socket."""
    marker = f"sandbox-escape-{os.getpid()}-{time.monotonic_ns()}"
    limits = SandboxLimits(wall_s=20.0, cpu_s=10, memory_mib=512, file_mib=16, disk_mib=64, output_bytes=1 << 20)
    scratch = tempfile.mkdtemp(prefix="sandbox-scratch-", dir="/")  # world-writable, like a cluster's /scratch
    os.chmod(scratch, 0o1777)
    callers = sorted({scratch, os.getcwd(), str(tmp_path), str(Path.home()), sys.prefix, os.path.dirname(__file__)})
    shm_before = shutil.disk_usage("/dev/shm").used
    tried: list[str] = []
    service = tempfile.mkdtemp(prefix="sandbox-service-", dir="/run")  # a host service's socket, as /run holds
    listening = socket.socket(socket.AF_UNIX)
    try:
        listening.bind(os.path.join(service, "service.sock"))
        listening.listen()
        result = run_python(_ESCAPE_PROBE % {"marker": marker, "callers": callers}, limits, isolation="namespaces")
        assert result.reason == "ok", result.observation()
        report = json.loads(result.output)
        tried = report["tried"]
        shm_grew = shutil.disk_usage("/dev/shm").used - shm_before
        assert {"/tmp", "/var/tmp", "/dev/shm", "/run/lock", scratch, *callers} <= set(tried)
        assert {"/tmp", "/var/tmp", "/dev/shm", "/run/lock"} <= set(report["created"])  # its private folders
        escaped = [folder for folder in tried if os.path.lexists(os.path.join(folder, marker))]
        escaped += glob.glob(f"/tmp/{marker}*") + glob.glob(f"/dev/shm/{marker}*")
        assert escaped == []
        assert all(error == errno.ENOSPC for _, error in report["filled"].values()), report["filled"]
        assert sum(written for written, _ in report["filled"].values()) <= limits.disk_mib << 20
        assert shm_grew < 32 << 20, f"/dev/shm grew by {shm_grew >> 20} MiB"
        assert 1 in report["pids"] and report["me"] in report["pids"] and len(report["pids"]) <= 3, report["pids"]
        assert report["sockets"] == []  # no host service's Unix socket (those under /run, say) to connect to
    finally:
        for folder in {*tried, *callers, "/tmp", "/var/tmp", "/dev/shm", "/run/lock"}:
            for path in glob.glob(os.path.join(glob.escape(folder), glob.escape(marker) + "*")):
                with contextlib.suppress(OSError):
                    os.remove(path)
        shutil.rmtree(scratch, ignore_errors=True)
        listening.close()
        shutil.rmtree(service, ignore_errors=True)
