"""The local ranks' watcher (megatron_rl/spec/local_ranks.py): which rank is named when one dies and the others
fail after it, with plain processes (no job).

    .venv/bin/python -m pytest tests/test_local_ranks.py -q
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from megatron_rl.spec.local_ranks import (LAUNCHER_POLL_S, STOP_GRACE_S, RanksEnded, kill_leftovers, start_ranks,
                                          watch_ranks)

# rank 1 sends itself `signal` (SIGKILL, or SIGSTOP: a hung rank) after `signal_s`; rank 0 fails with exit 1 after
# `fail_s` (as a rank whose collective lost its peer, or timed out waiting for it); a rank with nothing to do sleeps
# past the test.
SCRIPT = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
signal_s, fail_s, sig = float(sys.argv[1]), float(sys.argv[2]), getattr(signal, sys.argv[3])
if rank == 1:
    time.sleep(signal_s); os.kill(os.getpid(), sig); time.sleep(60)
time.sleep(fail_s); sys.exit(1)
"""


def _watch(signal_s: float, fail_s: float, poll_s: float = 0.05, sig: str = "SIGKILL"):
    procs = start_ranks([sys.executable, "-c", SCRIPT, str(signal_s), str(fail_s), sig], 2, port=1,
                        env=dict(os.environ), stdout=open(os.devnull, "w"))
    try:
        ended = watch_ranks(procs, timeout=30, poll_s=poll_s)
        return (ended.code, ended.rank), [p.returncode for p in procs], ended.how
    finally:
        kill_leftovers(procs)


def test_the_rank_that_died_first_is_named_not_the_one_that_failed_after_it():
    (code, rank), codes, how = _watch(signal_s=0.2, fail_s=0.6)
    assert (code, rank) == (137, 1) and how == "was killed by signal 9"


def test_of_failures_seen_in_one_poll_a_death_by_signal_is_the_cause():
    # rank 0 exits 1 at 0.1 s, rank 1 is killed at 0.3 s; a 1-second poll sees both at once
    (code, rank), codes, _ = _watch(signal_s=0.3, fail_s=0.1, poll_s=1.0)
    assert codes == [1, -9] and (code, rank) == (137, 1)


def test_a_stopped_rank_is_named_when_the_others_fail_waiting_for_it_and_killed_at_once():
    """SIGSTOP at 0.2 s: rank 0 fails at 1 s (its collective timed out); the stopped rank is the cause, and is
    SIGKILLed without the SIGTERM grace it could not take while stopped."""
    started = time.monotonic()
    (code, rank), codes, how = _watch(signal_s=0.2, fail_s=1.0, sig="SIGSTOP")
    assert (code, rank) == (128 + signal.SIGSTOP, 1) and codes == [1, -signal.SIGKILL]
    assert how.startswith("was stopped (SIGSTOP") and time.monotonic() - started < STOP_GRACE_S


def test_a_lone_failure_and_success():
    (code, rank), codes, how = _watch(signal_s=60, fail_s=0.1)  # rank 0 fails first; rank 1 is stopped (SIGTERM)
    assert (code, rank) == (1, 0) and codes[1] < 0 and how == "failed with exit code 1"
    procs = start_ranks([sys.executable, "-c", "pass"], 2, port=1, env=dict(os.environ))
    assert watch_ranks(procs, timeout=30) == RanksEnded(code=0)


# A launcher that starts two ranks and waits; each rank says it is ready (a file), then sleeps past the test. Rank 0
# keeps SIGTERM's default action: only the parent-death signal ends it. Rank 1 ignores SIGTERM (a rank that does
# not stop): its watch_launcher thread kills it STOP_GRACE_S (here 0.5 s) after the launcher's end.
ORPHAN_LAUNCHER = """
import os, sys
from megatron_rl.spec.local_ranks import start_ranks
procs = start_ranks([sys.executable, "-c", sys.argv[1], sys.argv[2]], 2, port=1, env=dict(os.environ),
                    stdout=open(os.devnull, "w"))
print(" ".join(str(p.pid) for p in procs), flush=True)
sys.stdin.read()
"""
ORPHAN_RANK = """
import os, signal, sys, time
from pathlib import Path
from megatron_rl.spec import local_ranks
rank = int(os.environ["RANK"])
if rank == 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    local_ranks.STOP_GRACE_S = 0.5
    local_ranks.watch_launcher()
Path(sys.argv[1], f"ready{rank}").write_text(os.environ.get(local_ranks.LAUNCHER_PID_ENV, "popped"))
time.sleep(60)
"""


def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path):
    """The parent-death signal (Linux prctl) ends rank 0 at once; rank 1, which ignores SIGTERM, is SIGKILLed by
    its watch_launcher thread within LAUNCHER_POLL_S + its grace. The rank does not pass the launcher's pid on."""
    import psutil

    launcher = subprocess.Popen([sys.executable, "-c", ORPHAN_LAUNCHER, ORPHAN_RANK, str(tmp_path)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ranks = []
    try:
        ranks = [psutil.Process(int(pid)) for pid in launcher.stdout.readline().split()]
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)):
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.05)
        assert (tmp_path / "ready1").read_text() == "popped"
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        gone, alive = psutil.wait_procs(ranks, timeout=LAUNCHER_POLL_S + 0.5 + 5)
        assert alive == [], f"ranks outlived their launcher: {alive}"
        assert time.monotonic() - killed < LAUNCHER_POLL_S + 0.5 + 5
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for rank in ranks:
            if rank.is_running():
                rank.kill()
