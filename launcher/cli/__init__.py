"""Command line of ``launch.py`` and the ``megatron-rl`` script: run a job, plan a layout, convert or evaluate a
checkpoint, and follow runs.

    python launch.py [--config FILE] [--dry-run] [--wait] [key=value ...]   run locally or on Slurm (cli/run.py)
    python launch.py plan --model MODEL --gpus N --gpu-type TYPE [...]        size a layout, run nothing (cli/plan.py)
    python launch.py convert hf-to-megatron|megatron-to-hf ... [--slurm]    convert checkpoints (cli/convert.py)
    python launch.py eval --ckpt CKPT [--config FILE] [key=value ...]  held-out pass@k of a checkpoint (cli/eval.py)
    python launch.py pipeline [--config FILE] [--dry-run] [--wait] [key=value ...]  chained stages (cli/pipeline.py)
    python launch.py status RUN_DIR [--json]                 state, progress, metrics of a run (cli/status.py)
    python launch.py logs RUN_DIR [--follow] [--rank N]      print or follow a rank's log (cli/logs.py)
    python launch.py cancel RUN_DIR                          cancel a run or a pipeline's stages (cli/cancel.py)

Each module parses its arguments, calls the launcher and prints; bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.private import private_umask

SUBCOMMANDS = {
    "plan": "size the parallel layout for a model and GPU count (no job is started)",
    "convert": "convert checkpoints between Megatron and Hugging Face formats (here or as a Slurm job)",
    "eval": "held-out pass@1, pass@k, mean reward and length of a policy checkpoint (a job, like a run)",
    "pipeline": "run a pipeline file's stages (SFT -> RM -> GRPO -> eval) in order, or chained with afterok on Slurm",
    "status": "state, step/steps, last metrics, ETA and log paths of a run or a pipeline folder",
    "logs": "print a run's rank log (and Slurm batch log); --follow streams it until the run ends",
    "cancel": "cancel a run's Slurm jobs (every stage of a pipeline) or stop a local run",
}


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one-line ConfigErrors (exit 2) instead of a usage dump."""

    def error(self, message: str) -> None:
        command = self.prog.removeprefix("launch.py").strip()
        raise ConfigError(f"{command + ': ' if command else ''}{message} (see python {self.prog} --help)")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    name, rest = (argv[0], argv[1:]) if argv and argv[0] in SUBCOMMANDS else ("run", argv)
    private_umask()  # whatever is written from here on (run folder, pickles, logs, checkpoints) is 0700/0600
    try:
        return importlib.import_module(f"launcher.cli.{name}").main(rest)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
