"""What every Slurm task runs when ``python launch.py cluster.executor=slurm`` submits through submitit.

The rendered sbatch script starts one task per rank with ``srun ... python -u -m submitit.core._submit FOLDER``;
submitit unpickles a ``TrainTask`` in each and calls it. The task exports its rank, world size and rendezvous
from the job environment (torchrun's names: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), runs
``python -m megatron_rl.main CONFIG`` as a child process and passes SIGUSR1 (Slurm's ``--signal`` before the time
limit), SIGUSR2 (submitit's preemption signal, e.g. ``job._interrupt()``) and SIGTERM to it as a checkpoint
request. It then exits with the trainer's code, so a preemption checkpoint (code 3) reaches the batch script,
which requeues the job; submitit's own requeue handler is replaced so that only one place requeues.
Imports no torch: the trainer child does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from launcher.slurm_script import REQUEUE_EXIT_CODE

RESEND_S = 2.0
FAILURE_MARK = "megatron-rl task failed:"  # the watcher looks for this line in the tasks' .err logs


@dataclass(frozen=True, kw_only=True)
class TrainTask:
    """The submitit function of a training job: one call per Slurm task."""

    config_path: str
    """The run's resolved config.yaml."""
    python: str
    """Interpreter that runs the trainer."""

    def __call__(self) -> dict[str, Any]:
        from submitit.helpers import TorchDistributedEnvironment

        dist = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        requested = []

        def ask_to_checkpoint(signum: int, frame: Any) -> None:
            requested.append(signum)
            try:  # os.kill, not Popen.send_signal: no locks inside a signal handler
                os.kill(child.pid, signal.SIGTERM if signum == signal.SIGTERM else signal.SIGUSR1)
            except ProcessLookupError:
                pass

        # The trainer starts with SIGUSR1 ignored, so a request that comes while it still imports is not fatal;
        # it is repeated every RESEND_S seconds until the trainer, once its handler is installed, acts on it.
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        child = subprocess.Popen([self.python, "-u", "-m", "megatron_rl.main", self.config_path])
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, ask_to_checkpoint)
        while True:
            try:
                code = child.wait(timeout=RESEND_S)
                break
            except subprocess.TimeoutExpired:
                if requested:
                    ask_to_checkpoint(signal.SIGUSR1, None)
        if code == 0:
            return {"rank": dist.rank, "world_size": dist.world_size, "node": node,
                    "master": f"{dist.master_addr}:{dist.master_port}"}
        if code == REQUEUE_EXIT_CODE:
            print(f"rank {dist.rank} on {node}: checkpoint saved for preemption (exit code {code})", flush=True)
        else:
            reason = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            print(f"{FAILURE_MARK} rank {dist.rank} on {node}: the trainer {reason}", file=sys.stderr, flush=True)
        # SystemExit passes through submitit (it records only Exceptions), so srun sees the trainer's code.
        raise SystemExit(code if code > 0 else 128 - code)
