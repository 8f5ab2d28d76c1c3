"""Cancel a run, or every stage of a pipeline folder.

    python launch.py cancel RUN_DIR

Slurm runs: ``scancel`` of the folder's jobs that have not ended (pending, running, requeued). Local runs: SIGINT
to the launcher named in ``.lock``, which stops its ranks' process groups as on Ctrl-C and releases the folder;
a launcher that ignores SIGINT (started with ``nohup`` or ``&``) has its ranks' process groups sent SIGTERM
instead (each rank leads its own session; the launcher then stops the rest and exits).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from launcher.lock import mark_cancelled
from launcher.runs.folder import RunFolder, open_folder
from launcher.runs.status import slurm_jobs
from launcher.slurm.query import FINAL_STATES, have_tool, scancel
from megatron_rl.spec.errors import ConfigError

LOCAL_STOP_WAIT_S = 40.0
"""How long cancel waits for a local launcher to stop its ranks: they save a preemption checkpoint first, within
the launcher's grace of 10 s, and it then joins their log pumps (5 s each)."""


def cancel_folder(path: str | Path) -> list[str]:
    """Cancel what still runs in the run or pipeline folder ``path``; one line per run saying what was done."""
    return [(f"stage {stage}: " if stage else "") + cancel_run(run) for stage, run in
            open_folder(path, command="cancel")]


def cancel_run(run: RunFolder) -> str:
    if run.executor == "slurm":
        return cancel_slurm(run)
    return cancel_local(run)


def cancel_slurm(run: RunFolder) -> str:
    jobs = slurm_jobs(run)
    active = [job.job_id for job in jobs if job.state not in FINAL_STATES and job.state != "UNKNOWN"]
    if not active:
        ended = ", ".join(f"{job.job_id} {job.state}" for job in jobs) or "no Slurm job id in the folder"
        return f"nothing to cancel in {run.path} ({ended})"
    if not have_tool("scancel"):
        raise ConfigError(f"cancel: `scancel` is not on PATH; run it on the cluster's login node (jobs "
                          f"{', '.join(active)})")
    result = scancel(active)
    if result.returncode != 0:
        raise ConfigError(f"cancel: scancel {' '.join(active)} failed: {' '.join(result.stderr.split())}")
    return f"cancelled Slurm job(s) {', '.join(active)} of {run.path}"


def cancel_local(run: RunFolder) -> str:
    pid = run.local_launcher()
    if pid is None:
        return f"nothing to cancel in {run.path} (no live launcher in its .lock)"
    mark_cancelled(run.path, pid)
    if _ignores_sigint(pid):
        for rank in _children(pid):
            _stop_rank(rank)
        how = "sent SIGTERM to its ranks' process groups"
    else:
        os.kill(pid, signal.SIGINT)
        how = "sent SIGINT (as Ctrl-C)"
    deadline = time.monotonic() + LOCAL_STOP_WAIT_S
    while run.local_launcher() == pid and time.monotonic() < deadline:  # it removes .lock as it ends
        time.sleep(0.2)
    done = "it stopped" if run.local_launcher() != pid else f"it is still stopping after {LOCAL_STOP_WAIT_S:.0f} s"
    return f"cancelled the local run {run.path}: launcher pid {pid} {how}; {done}"


def _ignores_sigint(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), "0")
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(name))
    return found


def _stop_rank(pid: int) -> None:
    """SIGTERM to the rank's process group when it leads one (the local executor starts each in its own)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGTERM)
        else:
            os.kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
