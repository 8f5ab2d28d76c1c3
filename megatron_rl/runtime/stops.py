"""Stopping a job for requeue: the signals that ask for it, and the exit that follows the preemption save.

Slurm sends SIGUSR1 (``--signal=USR1@N``) or SIGTERM before a time limit or a preemption. The handler only sets a
flag; the trainer finishes its current step, every rank agrees on the flag, a checkpoint is saved, and the
process exits with ``REQUEUE_EXIT_CODE`` (``Preempted``) so the job script requeues it. Torch-free: the entry
point installs the handlers before its slow imports.
"""

from __future__ import annotations

import signal
from typing import Any

from megatron_rl.spec.local_ranks import watch_launcher
from megatron_rl.spec.run_files import REQUEUE_EXIT_CODE

_stop_signal = {"received": False}


def install_stop_handlers() -> None:
    """Catch SIGUSR1/SIGTERM from the first moment of the process: the flag waits for the next step's end. A
    local rank also stops (and is killed if it does not) when its launcher ends (``watch_launcher``)."""
    def request_stop(signum: int, frame: Any) -> None:
        _stop_signal["received"] = True

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, request_stop)
    watch_launcher()


def stop_signal_received() -> bool:
    """Whether SIGUSR1 or SIGTERM came since ``install_stop_handlers``."""
    return _stop_signal["received"]


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is saved; exits the process with REQUEUE_EXIT_CODE."""

    def __init__(self) -> None:
        super().__init__(REQUEUE_EXIT_CODE)
