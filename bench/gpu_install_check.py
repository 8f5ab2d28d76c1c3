"""Step 1's install check of ``bench/gpu_check.sh``: what the GPU check imports, from where, and a preset and a recipe
loaded by name. One line out; exit 1 naming what is wrong.

The project is not installed on the GPU machine: the checkout goes first on ``PYTHONPATH`` and the carried wheels
(megatron-core, omegaconf, submitit) after it. A checkout whose ``shipped/`` links do not resolve, or a package
imported from anywhere but the checkout, fails here, before the check spends device time.

Run: ``PYTHONPATH=REPO:SITE python bench/gpu_install_check.py REPO`` (from any folder).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(repo: Path) -> str:
    import megatron.core
    import omegaconf  # noqa: F401
    import submitit  # noqa: F401
    import torch
    import transformers  # noqa: F401

    import launcher
    import megatron_rl
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.spec.resources import presets_dir

    for package in (megatron_rl, launcher):
        if repo not in Path(package.__file__).resolve().parents:
            raise SystemExit(f"{package.__name__} imports from {package.__file__}, not the checkout {repo}")
    shape, cfg = load_model_shape("tiny-cpu"), load_config("grpo_tiny")
    return (f"checkout {repo}; megatron-core {megatron.core.__version__} from {Path(megatron.core.__file__).parent}; "
            f"torch {torch.__version__}; {len(list(presets_dir().glob('*.yaml')))} presets; "
            f"tiny-cpu {shape.num_params()} params; grpo_tiny {cfg.algorithm.name}")


if __name__ == "__main__":
    print(main(Path(sys.argv[1]).resolve()))
