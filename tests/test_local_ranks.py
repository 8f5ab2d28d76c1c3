"""The local ranks' watcher (megatron_rl/spec/local_ranks.py): which rank is named when one dies and the others
fail after it, with plain processes (no job).

    .venv/bin/python -m pytest tests/test_local_ranks.py -q
"""

from __future__ import annotations

import os
import sys

from megatron_rl.spec.local_ranks import kill_leftovers, start_ranks, watch_ranks

# rank 1 is killed (SIGKILL) after `kill_s`; rank 0 fails with exit 1 after `fail_s` (as a rank whose collective
# lost its peer); a rank with nothing to do sleeps past the test.
SCRIPT = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
kill_s, fail_s = float(sys.argv[1]), float(sys.argv[2])
if rank == 1:
    time.sleep(kill_s); os.kill(os.getpid(), signal.SIGKILL)
time.sleep(fail_s); sys.exit(1)
"""


def _watch(kill_s: float, fail_s: float, poll_s: float = 0.05):
    procs = start_ranks([sys.executable, "-c", SCRIPT, str(kill_s), str(fail_s)], 2, port=1, env=dict(os.environ),
                        stdout=open(os.devnull, "w"))
    try:
        return watch_ranks(procs, timeout=30, poll_s=poll_s), [p.returncode for p in procs]
    finally:
        kill_leftovers(procs)


def test_the_rank_that_died_first_is_named_not_the_one_that_failed_after_it():
    (code, rank), codes = _watch(kill_s=0.2, fail_s=0.6)
    assert (code, rank) == (137, 1)


def test_of_failures_seen_in_one_poll_a_death_by_signal_is_the_cause():
    # rank 0 exits 1 at 0.1 s, rank 1 is killed at 0.3 s; a 1-second poll sees both at once
    (code, rank), codes = _watch(kill_s=0.3, fail_s=0.1, poll_s=1.0)
    assert codes == [1, -9] and (code, rank) == (137, 1)


def test_a_lone_failure_and_success():
    (code, rank), codes = _watch(kill_s=60, fail_s=0.1)  # rank 0 fails first; rank 1 is stopped (SIGTERM)
    assert (code, rank) == (1, 0) and codes[1] < 0
    procs = start_ranks([sys.executable, "-c", "pass"], 2, port=1, env=dict(os.environ))
    assert watch_ranks(procs, timeout=30) == (0, None)
