"""Ask Slurm about jobs and cancel them: ``squeue`` (live state), ``sacct`` (accounting, every start of a job),
``scancel``. Used by ``launch.py --wait`` (``watch``) and ``launch.py status|logs|cancel`` (``launcher.runs``).

    python launch.py status RUN_DIR        # sacct's state of each of the run's jobs

Every command is an argument list (no shell), so a job id or a path never reaches a shell as code.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence

FINAL_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                          "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"})
QUERY_TIMEOUT_S = 60


@dataclass(frozen=True, kw_only=True)
class JobState:
    """One observation of the job."""

    state: str
    """Slurm state, e.g. PENDING, RUNNING, COMPLETED (first word: sacct writes `CANCELLED by 0`)."""
    reason: str = ""
    """squeue's reason (pending reason or end reason)."""
    nodes: str = ""
    """Node list."""
    exit_code: str = ""
    """sacct's ExitCode `code:signal` ("" when unknown)."""
    elapsed: str = ""
    """sacct's Elapsed of the latest run."""
    starts: int = 1
    """How many times the job started (a requeued job starts again under the same id); 0 before its first start."""


def run_tool(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, stdin=subprocess.DEVNULL)


def have_tool(name: str) -> bool:
    return shutil.which(name) is not None


def squeue_state(job_id: str) -> Optional[JobState]:
    """The job as squeue sees it; None when squeue no longer knows it. Raises RuntimeError when squeue fails."""
    result = run_tool(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%r|%N"])
    if result.returncode != 0:
        if "Invalid job id" in result.stderr:
            return None
        raise RuntimeError(result.stderr.strip() or f"squeue exited {result.returncode}")
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if not lines:
        return None
    state, reason, nodes = (lines[0].split("|") + ["", ""])[:3]
    return JobState(state=state, reason=reason if reason != "None" else "", nodes=nodes)


def sacct_state(job_id: str) -> Optional[JobState]:
    """The latest run of the job as accounting recorded it; None before it is recorded."""
    return sacct_states([job_id]).get(job_id)


def sacct_states(job_ids: Sequence[str]) -> dict[str, JobState]:
    """Each job's latest run as accounting recorded it, with its number of starts, in one sacct call; jobs that
    accounting does not know (yet) are missing. Empty when sacct is missing or fails."""
    if not job_ids or not have_tool("sacct"):
        return {}
    try:
        result = run_tool(["sacct", "-X", "-D", "-n", "-P", "-j", ",".join(job_ids),
                           "-o", "JobID,State,ExitCode,NodeList,Elapsed,Start"])
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if result.returncode != 0:
        return {}
    runs: dict[str, list[list[str]]] = {}
    for line in result.stdout.splitlines():
        fields = (line.split("|") + [""] * 6)[:6]
        if fields[0]:
            runs.setdefault(fields[0], []).append(fields)
    return {job_id: _latest(rows) for job_id, rows in runs.items()}


def _latest(rows: list[list[str]]) -> JobState:
    _, state, exit_code, nodes, elapsed, start = rows[-1]
    starts = sum(1 for row in rows if row[5] not in ("", "Unknown", "None"))
    if state == "PENDING":  # accounting's exit code, elapsed and nodes of a job that has not started are noise
        exit_code, nodes, elapsed = "", "", ""
    return JobState(state=state.split()[0] if state else "UNKNOWN", exit_code=exit_code,
                    nodes=nodes if nodes != "None assigned" else "", elapsed=elapsed, starts=starts)


def live_state(job_id: str) -> Optional[JobState]:
    """squeue's view when the job is still listed, else accounting's; None when neither knows it."""
    try:
        seen = squeue_state(job_id) if have_tool("squeue") else None
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        seen = None
    return seen or sacct_state(job_id)


def scancel(job_ids: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """``scancel JOB_ID...`` (pending, running or requeued jobs; an ended one is ignored by Slurm)."""
    return run_tool(["scancel", *job_ids])
