"""Follow a submitted Slurm job for ``launch.py --wait``: stream its logs, report state changes, explain the end.

    python launch.py cluster.executor=slurm cluster.nodes=2 --wait

Live state comes from ``squeue`` (cheap, no accounting query per poll); the final state and exit code come from
``sacct``. Rank 0's stdout and the batch script's log are streamed as they grow (a requeued run appends to the
same files). The exit code is 0 for COMPLETED, the job's exit code for FAILED, and 1 for every other end state,
each with a one-paragraph explanation on stderr.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from launcher.runs.logs import LogTail
from launcher.slurm.query import FINAL_STATES, JobState, run_tool, sacct_state, squeue_state
from launcher.slurm.task import CONTINUED_MARK, FAILURE_MARK, PLACEMENT_MARK, STOPPED_MARK
from megatron_rl.spec.config.schema import ClusterConfig
from megatron_rl.spec.run_files import GATE_EXIT_CODE, REQUEUE_EXIT_CODE

SQUEUE_FAILURE_LIMIT_S = 60.0
SACCT_WAIT_S = 30.0
# The first line of each run of the job in its batch log (see slurm/train.sbatch), and srun's report of a failed task.
RUN_START = re.compile(r"megatron-rl \[job \d+, start \d+\]: \d+ task\(s\) on")
SRUN_TASK_ERROR = re.compile(r"srun: error: (\S+): tasks? (\d+)[^:]*: (.*)")


@dataclass(kw_only=True)
class Watch:
    """Everything wait_for_job needs to know about a submitted job."""

    job_id: str
    """Slurm job id."""
    log_dir: Path
    """run.dir/slurm: the batch log and per-task logs."""
    num_tasks: int
    """Ranks in the job."""
    cluster: ClusterConfig
    """The cluster section (for the hints in failure messages)."""
    poll_s: float = 1.0
    """Seconds between squeue polls."""
    out: TextIO = sys.stdout
    """Where logs and state changes go."""
    err: TextIO = sys.stderr
    """Where the final explanation of a failure goes."""


def wait_for_job(watch: Watch) -> int:
    """Block until the job ends, streaming its progress; return 0 or the non-zero status explained on stderr."""
    tails = [LogTail(watch.log_dir / f"{watch.job_id}_batch.log", "[batch] "),
             LogTail(watch.log_dir / f"{watch.job_id}_0_log.out")]
    last: Optional[tuple[str, str]] = None
    ran = False
    nodes = ""
    failing_since: Optional[float] = None
    while True:
        try:
            seen = squeue_state(watch.job_id)
            failing_since = None
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > SQUEUE_FAILURE_LIMIT_S:
                print(f"slurm: job {watch.job_id}: squeue has failed for {SQUEUE_FAILURE_LIMIT_S:.0f} s ({exc}); "
                      f"stopped waiting (check `squeue -j {watch.job_id}`)", file=watch.err)
                return 1
            seen = JobState(state="UNKNOWN")
        for tail in tails:
            watch.out.write(tail.read_new())
        watch.out.flush()
        if seen is None or seen.state in FINAL_STATES:
            break
        if (seen.state, seen.reason) != last and seen.state != "UNKNOWN":
            _say_state(watch, seen, requeued=ran and seen.state in ("PENDING", "REQUEUED"))
            last = (seen.state, seen.reason)
        if seen.state == "RUNNING":
            ran, nodes = True, seen.nodes or nodes
        time.sleep(watch.poll_s)
    for tail in tails:
        watch.out.write(tail.read_new())
    final = _final_state(watch, seen)
    return explain(watch, final, nodes=nodes)


def _say_state(watch: Watch, seen: JobState, *, requeued: bool) -> None:
    where = f" on {seen.nodes}" if seen.state == "RUNNING" and seen.nodes else ""
    why = f" ({seen.reason})" if seen.reason and seen.state != "RUNNING" else ""
    prefix = "requeued; " if requeued else ""
    print(f"slurm: job {watch.job_id}: {prefix}{seen.state}{where}{why}", file=watch.out, flush=True)


def _final_state(watch: Watch, seen: Optional[JobState]) -> JobState:
    deadline = time.monotonic() + SACCT_WAIT_S
    while True:
        record = sacct_state(watch.job_id)
        if record is not None and record.state in FINAL_STATES:
            return record
        if time.monotonic() > deadline:
            return seen or record or JobState(state="UNKNOWN")
        time.sleep(0.5)


def explain(watch: Watch, final: JobState, *, nodes: str = "") -> int:
    """Print how the job ended (``nodes``: where it ran, as squeue saw it); return the launcher's exit code."""
    job, cluster = f"slurm: job {watch.job_id}", watch.cluster
    rerun = "rerun with the same run.dir to resume from its newest checkpoint"
    if final.state == "COMPLETED":
        where = placement(watch) or f"ran on {final.nodes or nodes or '?'}"
        print(f"{job} COMPLETED in {final.elapsed or '?'}; {where}", file=watch.out, flush=True)
        return 0
    code = _exit_code(final.exit_code)
    if final.state == "FAILED" and code == REQUEUE_EXIT_CODE:
        message = (f"{job} FAILED: it was requeued (preemption, scontrol requeue or a node failure) more often "
                   f"than cluster.max_requeues={cluster.max_requeues} allows; {rerun}")
    elif final.state == "FAILED" and code == GATE_EXIT_CODE:
        message = (f"{job} ended with exit code {GATE_EXIT_CODE}: the evaluation missed eval.min_pass_at_1 "
                   f"(eval.json in the run folder has the pass@1)")
    elif final.state == "FAILED":
        message = f"{job} FAILED with exit code {final.exit_code or '?'}{failure_details(watch)}"
    elif final.state == "CANCELLED":
        message = f"{job} was CANCELLED (scancel or an administrator) after {final.elapsed or '?'}; {rerun}"
    elif final.state == "NODE_FAIL":
        message = (f"{job} ended with NODE_FAIL: a node of the job{f' ({nodes})' if nodes else ''} stopped responding"
                   f"{_down_nodes()}; {rerun}, with cluster.exclude=<node> if it stays down")
    elif final.state == "TIMEOUT":
        message = (f"{job} hit its time limit cluster.time={cluster.time} without a preemption checkpoint; raise "
                   f"cluster.time or cluster.signal_delay_s={cluster.signal_delay_s} (the warning before the limit)")
    elif final.state == "OUT_OF_MEMORY":
        message = f"{job} ran out of memory (OUT_OF_MEMORY); raise cluster.mem (now {cluster.mem}) or shrink the job"
    else:
        message = f"{job} ended as {final.state} (exit code {final.exit_code or '?'}); {rerun}"
    print(message, file=watch.err, flush=True)
    return code if final.state == "FAILED" and code > 0 else 1


def _exit_code(text: str) -> int:
    code, _, sig = text.partition(":")
    try:
        return int(code) if int(code) else (128 + int(sig) if sig and int(sig) else 1)
    except ValueError:
        return 1


def placement(watch: Watch) -> str:
    """`rank 0 on n1, rank 1 on n2` from the line each task logs when it ends well; "" when none did (a plain
    job). Read from the text logs: the launcher never unpickles what a job wrote."""
    ranks, found = [], False
    for task in range(watch.num_tasks):
        try:
            lines = (watch.log_dir / f"{watch.job_id}_{task}_log.out").read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        marks = [line[len(PLACEMENT_MARK):].strip() for line in lines if line.startswith(PLACEMENT_MARK)]
        ranks.append(marks[-1] if marks else f"rank {task}: no result")
        found = found or bool(marks)
    return ", ".join(ranks) if found else ""


def first_failed_task(batch_log: Path) -> Optional[tuple[int, str]]:
    """(rank, srun's words) of the first task srun saw fail in the latest run of the batch log."""
    try:
        lines = batch_log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if RUN_START.search(line)]
    for line in lines[starts[-1] if starts else 0:]:
        match = SRUN_TASK_ERROR.search(line)
        if match:
            return int(match.group(2)), f"{match.group(3)} (on {match.group(1)})"
    return None


def failure_details(watch: Watch) -> str:
    """Which rank caused the failure (a trainer left stopped, else the first that srun saw fail), its own report
    and the last lines of its stderr log."""
    logs = {task: _task_err_lines(watch, task) for task in range(watch.num_tasks)}
    for task, lines in logs.items():
        marks = [line for line in lines if line.startswith((STOPPED_MARK, CONTINUED_MARK))]
        if marks and marks[-1].startswith(STOPPED_MARK):
            return _named(watch, task, marks[-1][len(STOPPED_MARK):].strip(), lines)
    found = first_failed_task(watch.log_dir / f"{watch.job_id}_batch.log")
    for task in [found[0]] if found else logs:
        lines = logs.get(task, [])
        marks = [line[len(FAILURE_MARK):].strip() for line in lines if line.startswith(FAILURE_MARK)]
        if found or marks:
            return _named(watch, task, marks[-1] if marks else f"rank {task}: {found[1]}", lines)
    return f"; see the task logs {watch.log_dir}/{watch.job_id}_<rank>_log.err"


def _task_err_lines(watch: Watch, task: int) -> list[str]:
    try:
        return (watch.log_dir / f"{watch.job_id}_{task}_log.err").read_text(errors="replace").splitlines()
    except OSError:
        return []


def _named(watch: Watch, task: int, what: str, lines: list[str]) -> str:
    tail = "\n".join("  " + line for line in lines[-12:])
    return f": {what}\nlast lines of {watch.log_dir / f'{watch.job_id}_{task}_log.err'}:\n{tail}"


def _down_nodes() -> str:
    try:
        result = run_tool(["sinfo", "-h", "-R", "-o", "%N: %E"])
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    return f" (nodes down or drained now: {'; '.join(lines)})" if result.returncode == 0 and lines else ""
