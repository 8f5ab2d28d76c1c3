"""Files the launcher ships: recipe configs, model presets and sbatch templates.

They live in the top-level ``configs/`` and ``slurm/`` folders; ``launcher/shipped/`` links to both, and the
wheel carries the linked files as package data (pyproject.toml), so ``importlib.resources`` finds them the same
way in a checkout, an editable install and a wheel.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from launcher.errors import ConfigError


def _shipped(folder: str) -> Path:
    path = Path(str(files("launcher") / "shipped" / folder)).resolve()
    if not path.is_dir():
        raise ConfigError(f"{path} is missing: reinstall megatron-rl, or in a checkout restore the links in "
                          "launcher/shipped/ (git checkout launcher/shipped)")
    return path


def configs_dir() -> Path:
    """Folder of the shipped recipe configs (``grpo_tiny.yaml``, ...)."""
    return _shipped("configs")


def presets_dir() -> Path:
    """Folder of the model presets (``llama-3.1-405b.yaml``, ...)."""
    return configs_dir() / "models"


def templates_dir() -> Path:
    """Folder of the sbatch templates (``train.sbatch``, ``convert.sbatch``)."""
    return _shipped("slurm")
