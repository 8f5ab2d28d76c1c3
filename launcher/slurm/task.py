"""What every Slurm task runs when ``python launch.py cluster.executor=slurm`` submits through submitit.

The rendered sbatch script starts one task per rank with ``srun ... python -u -m submitit.core._submit FOLDER``;
submitit unpickles a ``TrainTask`` in each and calls it. The task exports its rank, world size and rendezvous
from the job environment (torchrun's names: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), runs
``python -m megatron_rl.main CONFIG`` as a child process and hands it SIGUSR1 (Slurm's ``--signal`` before the
time limit), SIGUSR2 (submitit's preemption signal, e.g. ``job._interrupt()``) and SIGTERM as a checkpoint
request. It exits with the trainer's code, so a preemption checkpoint (``REQUEUE_EXIT_CODE``) reaches the batch
script, which requeues the job; submitit's own requeue handler is replaced so that only one place requeues.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_rl.spec.local_ranks import is_stopped
from megatron_rl.spec.run_files import REQUEUE_EXIT_CODE

POLL_S = 0.5
FAILURE_MARK = "megatron-rl task failed:"  # the watcher looks for this line in the tasks' .err logs
STOPPED_MARK = "megatron-rl task stopped:"  # ... and this one, which names the cause over any rank's failure
CONTINUED_MARK = "megatron-rl task continued:"  # ... unless this one follows it
PLACEMENT_MARK = "megatron-rl task placement:"  # ... and for this one in their .out logs (no pickle is read)


@dataclass(frozen=True, kw_only=True)
class TrainTask:
    """The submitit function of a training job: one call per Slurm task."""

    config_path: str
    """The run's resolved config.yaml."""
    python: str
    """Interpreter that runs the trainer."""
    timeout_s: float
    """``parallel.timeout_s``: a trainer stopped for half of it is reported, as the others' collectives will time
    out waiting for it (srun then names only the first rank that failed, one of those)."""

    def __call__(self) -> dict[str, Any]:
        from submitit.helpers import TorchDistributedEnvironment

        from megatron_rl.spec.ports import rendezvous_port
        from megatron_rl.spec.private import private_umask

        private_umask()  # the trainer's checkpoints and submitit's result pickle are 0600
        # every task computes the same port; submitit's own pick (20000-60000) can fall on a port in use
        os.environ.setdefault("MASTER_PORT", str(rendezvous_port(int(os.environ.get("SLURM_JOB_ID", "0")),
                                                                 int(os.environ.get("SLURM_RESTART_COUNT", "0")))))
        dist = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        pending = []  # a checkpoint request the trainer could not take yet

        def forward(signum: int) -> None:
            if signum == signal.SIGTERM:
                stopped.ending = True  # Slurm's teardown continues a stopped trainer: that is no recovery
            if signum != signal.SIGTERM and not catches(child.pid, signal.SIGUSR1):
                pending[:] = [signum]  # still starting up: deliver once its handler is installed
                return
            pending.clear()
            try:  # os.kill, not Popen.send_signal: no locks inside a signal handler
                os.kill(child.pid, signal.SIGTERM if signum == signal.SIGTERM else signal.SIGUSR1)
            except ProcessLookupError:
                pass

        # The trainer starts with SIGUSR1 ignored, so a request while it still imports is held back, not fatal,
        # and is delivered once: a second one during its exit (after the save) would kill it.
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        child = subprocess.Popen([self.python, "-u", "-m", "megatron_rl.main", self.config_path])
        stopped = StoppedWatch(child.pid, report_after_s=self.timeout_s / 2, who=f"rank {dist.rank} on {node}")
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: forward(signum))
        while True:
            try:
                code = child.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                stopped.poll()
                if pending:
                    forward(pending[0])
        if code == 0:
            print(f"{PLACEMENT_MARK} rank {dist.rank} on {node}", flush=True)
            return {"rank": dist.rank, "world_size": dist.world_size, "node": node,
                    "master": f"{dist.master_addr}:{dist.master_port}"}
        if code == REQUEUE_EXIT_CODE:
            print(f"rank {dist.rank} on {node}: checkpoint saved for preemption (exit code {code})", flush=True)
        else:
            reason = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            print(f"{FAILURE_MARK} rank {dist.rank} on {node}: the trainer {reason}", file=sys.stderr, flush=True)
        # SystemExit passes through submitit (it records only Exceptions), so srun sees the trainer's code.
        raise SystemExit(code if code > 0 else 128 - code)


class StoppedWatch:
    """Reports a trainer that stays stopped (SIGSTOP, a debugger): at ``report_after_s`` one STOPPED_MARK line
    on stderr, and a CONTINUED_MARK line if it runs again before the job ends."""

    def __init__(self, pid: int, *, report_after_s: float, who: str) -> None:
        self.pid, self.report_after_s, self.who = pid, report_after_s, who
        self.since: Optional[float] = None
        self.reported = False
        self.ending = False

    def poll(self) -> None:
        now = time.monotonic()
        if is_stopped(self.pid):
            self.since = self.since or now
            if not self.reported and now - self.since >= self.report_after_s:
                self.reported = True
                print(f"{STOPPED_MARK} {self.who}: the trainer was stopped (SIGSTOP or a debugger) and never "
                      f"answered: the others' collectives timed out waiting for it (parallel.timeout_s)",
                      file=sys.stderr, flush=True)
        else:
            if self.reported and not self.ending:
                print(f"{CONTINUED_MARK} {self.who} after {now - self.since:.0f} s", file=sys.stderr, flush=True)
                self.reported = False
            self.since = None


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux /proc); True when that cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True
