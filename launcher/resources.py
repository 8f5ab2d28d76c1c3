"""The sbatch templates the launcher ships (``train.sbatch``, ``convert.sbatch``).

They live in the top-level ``slurm/`` folder; ``launcher/shipped/slurm`` links to it and the wheel carries the
linked files as package data (pyproject.toml). The recipe configs and model presets are the spec's
(``megatron_rl.spec.resources``).
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.spec.resources import shipped


def templates_dir() -> Path:
    """Folder of the sbatch templates (``train.sbatch``, ``convert.sbatch``)."""
    return shipped("launcher", "slurm")
