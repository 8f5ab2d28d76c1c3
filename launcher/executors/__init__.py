"""Executors start a prepared job: ``local`` (processes on this machine, beside this file) or ``slurm`` (submitit /
sbatch, in the ``launcher.slurm`` package with the rest of the Slurm code).

Each module offers ``describe(job) -> str`` (for --dry-run) and ``run(job, *, wait) -> int`` (exit code).
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXECUTORS = {"local": "launcher.executors.local", "slurm": "launcher.slurm.executor"}


def get_executor(name: str) -> ModuleType:
    return importlib.import_module(EXECUTORS[name])
