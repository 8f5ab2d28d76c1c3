"""Long single-rank work (a Hugging Face export, rank 0 only) is waited for past the short collective timeout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_rl.spec.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_other_ranks_wait_for_rank_zero_beyond_the_collective_timeout() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(REPO_ROOT / "tests" / "dist" / "rank_zero_wait.py")]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    by_rank = {line["rank"]: line for line in lines}
    assert set(by_rank) == {0, 1}, result.stdout[-2000:] + result.stderr[-3000:]
    # rank 1 came out of the wait only after rank 0's 6 s of work ended, however late either process started,
    # and so waited past the 2 s collective timeout without timing out
    assert by_rank[1]["wait_ended"] >= by_rank[0]["work_ended"]
    assert by_rank[1]["wait_ended"] - by_rank[1]["started"] > 2.0
    assert by_rank[1]["plain_barrier_timed_out"]  # while a plain collective still times out after 2 s
