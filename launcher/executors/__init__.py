"""Executors start a prepared job: ``local`` (processes on this machine) or ``slurm`` (submitit / sbatch).

Each module offers ``describe(job) -> str`` (for --dry-run) and ``run(job, *, wait) -> int`` (exit code).
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXECUTORS = {"local": "launcher.executors.local", "slurm": "launcher.executors.slurm"}


def get_executor(name: str) -> ModuleType:
    return importlib.import_module(EXECUTORS[name])
