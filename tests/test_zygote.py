"""The zygote (megatron_rl/runtime/zygote.py) as ``start_ranks`` uses it: a forked rank is the process an
interpreter would have been (arguments, environment, working folder, ``sys.path``, output, exit status, its own
session), with torch and Megatron imported already; a request it cannot serve falls back to an interpreter.

    .venv/bin/python -m pytest tests/test_zygote.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.spec.local_ranks import ZYGOTE_ENV, RanksEnded, ZygoteRank, kill_leftovers, start_ranks, watch_ranks

SCRIPT = """
import json, os, sys, time
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "rank": os.environ["RANK"],
                  "mine": os.environ.get("ONLY_MINE"), "megatron": "megatron.core" in sys.modules,
                  "pid": os.getpid(), "pgid": os.getpgrp(), "name": __name__,
                  "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode().split("\\0")}),
      flush=True)
mode = sys.argv[1]
if mode == "sleep":
    time.sleep(60)
print("unflushed tail", end="")
time.sleep(1.0 if os.environ["RANK"] == "0" else 0.0)  # rank 1 has ended (0) when rank 0 fails
sys.exit(int(mode) if os.environ["RANK"] == "0" else 0)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "rank_script.py"
    path.write_text(SCRIPT)
    return path


def _env(**more) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **more}


def test_a_forked_rank_is_the_process_an_interpreter_would_be(_zygote, script, tmp_path):
    logs = [open(tmp_path / f"rank{r}.log", "w+") for r in range(2)]
    procs = start_ranks([sys.executable, str(script), "3"], 2, port=1, env=_env(ONLY_MINE="yes"), stdout=logs,
                        cwd=str(tmp_path))
    try:
        assert all(isinstance(p, ZygoteRank) for p in procs)
        ended = watch_ranks(procs, timeout=60)
    finally:
        kill_leftovers(procs)
    assert ended == RanksEnded(code=3, rank=0, how="failed with exit code 3")
    assert [p.returncode for p in procs] == [3, 0]
    for rank, log in enumerate(logs):
        log.seek(0)
        first, tail = log.read().split("\n", 1)
        seen = json.loads(first)
        assert seen["argv"] == [str(script), "3"] and seen["cwd"] == str(tmp_path)
        assert seen["cmdline"] == [sys.executable, str(script), "3"]  # what ps shows, and what finds a rank
        assert seen["path0"] == str(tmp_path) and seen["name"] == "__main__"
        assert seen["rank"] == str(rank) and seen["mine"] == "yes"
        assert seen["megatron"], "the zygote imports Megatron before it forks"
        assert seen["pgid"] == seen["pid"] == procs[rank].pid  # a session of its own: killpg reaches it
        assert tail == "unflushed tail"  # flushed at exit, as an interpreter flushes
        log.close()


def test_a_module_rank_writes_unbuffered_to_a_pipe_and_its_signal_is_its_status(_zygote, tmp_path):
    package = tmp_path / "pkg_rank"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hello.py").write_text("import sys, time\nprint('hello', sys.argv[1:], flush=False)\n"
                                      "time.sleep(60)\n")
    procs = start_ranks([sys.executable, "-m", "pkg_rank.hello", "x"], 1, port=1,
                        env=_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, cwd=str(tmp_path))
    try:
        assert isinstance(procs[0], ZygoteRank)
        assert procs[0].stdout.readline() == b"hello ['x']\n"  # unbuffered: here while the rank still runs
        assert procs[0].poll() is None
        os.killpg(procs[0].pid, signal.SIGKILL)
        assert procs[0].wait(timeout=30) == -signal.SIGKILL
    finally:
        kill_leftovers(procs)
        procs[0].stdout.close()


def test_a_rank_the_zygote_cannot_serve_starts_as_an_interpreter(_zygote, script, tmp_path):
    """Another OMP_NUM_THREADS than the zygote read at its imports, or a command that is not Python's."""
    with open(tmp_path / "log", "w") as log:
        declined = start_ranks([sys.executable, str(script), "0"], 1, port=1, env=_env(OMP_NUM_THREADS="2"),
                               stdout=log)
        other = start_ranks(["/bin/sh", "-c", "exit 0"], 1, port=1, env=_env(), stdout=log)
        assert [type(p) for p in declined + other] == [subprocess.Popen, subprocess.Popen]
        assert watch_ranks(declined + other, timeout=120).code == 0


def _start_from_another_process(rank_script, log, after: str, *, before: str = "") -> subprocess.CompletedProcess:
    """A Python process that runs ``before``, starts one rank of ``rank_script`` (its output in ``log``) with
    ``start_ranks`` as ``procs``, then runs ``after``; it must succeed."""
    code = ("import os, resource, sys, time\nfrom megatron_rl.spec.local_ranks import start_ranks, watch_ranks\n"
            f"{before}procs = start_ranks([sys.executable, {str(rank_script)!r}], 1, port=1, env=dict(os.environ), "
            f"stdout=open({str(log)!r}, 'w'))\n{after}")
    started = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env=_env(PYTHONPATH=os.getcwd()))
    assert started.returncode == 0, started.stderr
    return started


def test_a_forked_rank_stops_when_its_launcher_ends(_zygote, tmp_path):
    """The zygote is the rank's parent, so no parent-death signal reaches it: its watch_launcher thread sees the
    launcher's pid end and sends it SIGTERM, which the rank takes as a stop."""
    rank_script = tmp_path / "watching.py"
    rank_script.write_text("import signal, sys, time\nfrom megatron_rl.spec.local_ranks import watch_launcher\n"
                           "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\nwatch_launcher()\n"
                           "print('watching', flush=True)\ntime.sleep(60)\n")
    started = _start_from_another_process(rank_script, tmp_path / "rank.log",
                                          "print(procs[0].pid, flush=True)\ntime.sleep(3)\n")
    pid = int(started.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}"), "the rank outlived its launcher"
    assert (tmp_path / "rank.log").read_text().startswith("watching")


def test_a_forked_rank_takes_its_starters_file_mask_and_limits(_zygote, tmp_path):
    """As an exec'd rank inherits them from its launcher (a private umask; ulimit -f, which a test's save that
    cannot be written relies on)."""
    rank_script = tmp_path / "limits.py"
    rank_script.write_text("import json, os, resource\nmask = os.umask(0)\n"
                           "print(json.dumps([mask, resource.getrlimit(resource.RLIMIT_FSIZE)]), flush=True)\n")
    started = _start_from_another_process(rank_script, tmp_path / "rank.log",
                                          "print(type(procs[0]).__name__, watch_ranks(procs, timeout=60).code)\n",
                                          before="os.umask(0o027)\n"
                                                 "resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**21))\n")
    assert started.stdout.split() == ["ZygoteRank", "0"]
    assert json.loads((tmp_path / "rank.log").read_text()) == [0o027, [2**20, 2**21]]


def test_the_session_runs_its_ranks_through_the_zygote(_zygote):
    assert _zygote is None or os.environ[ZYGOTE_ENV] == _zygote
