"""Files both sides read: the recipe configs and the model presets.

They live in the top-level ``configs/`` folder; ``megatron_rl/spec/shipped/configs`` links to it, and the wheel
carries the linked files as package data (pyproject.toml), so ``importlib.resources`` finds them the same way in
a checkout, an editable install and a wheel.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from megatron_rl.spec.errors import ConfigError


def shipped(package: str, folder: str) -> Path:
    """``<package>/shipped/<folder>``, resolved; ConfigError naming the mend when the link is missing."""
    path = Path(str(files(package) / "shipped" / folder)).resolve()
    if not path.is_dir():
        link = f"{package.replace('.', '/')}/shipped"
        raise ConfigError(f"{path} is missing: reinstall megatron-rl, or in a checkout restore the links in "
                          f"{link}/ (git checkout {link})")
    return path


def configs_dir() -> Path:
    """Folder of the shipped recipe configs (``grpo_tiny.yaml``, ...)."""
    return shipped("megatron_rl.spec", "configs")


def presets_dir() -> Path:
    """Folder of the model presets (``llama-3.1-405b.yaml``, ...)."""
    return configs_dir() / "models"
