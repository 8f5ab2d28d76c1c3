"""``python launch.py eval --ckpt CKPT [--config FILE] [--dry-run] [--wait] [key=value ...]``: held-out pass@1,
pass@k, mean reward and response length of a policy checkpoint, run like any job (locally or on Slurm, at the
layout the config gives or the planner picks): ``algorithm.name=eval model.init_from=CKPT`` on the config
(megatron_rl/trainers/evaluate.py). The result is added to <run.dir>/eval.json under eval.stage (default
run.name).

    python launch.py eval --ckpt runs/default/checkpoints eval.samples=8 eval.stage=grpo run.dir=runs/eval
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launcher.cli import CliParser
from megatron_rl.spec.errors import ConfigError


def main(argv: list[str]) -> int:
    from launcher.cli import run

    parser = CliParser(prog="launch.py eval", description=__doc__.splitlines()[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, metavar="CKPT", help="checkpoint folder (a run's checkpoints/ or "
                        "one step's folder) of the policy to evaluate")
    parser.add_argument("--config", metavar="FILE", help="job config whose data, rewards, generation and layout "
                        "keys to use (default: the built-in tiny CPU job)")
    parser.add_argument("--dry-run", action="store_true", help="print what would run; start nothing")
    parser.add_argument("--wait", action="store_true", help="Slurm: block until the job ends")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. eval.samples=8")
    args = parser.parse_intermixed_args(argv)
    if not Path(args.ckpt).expanduser().exists():
        raise ConfigError(f"--ckpt {args.ckpt}: no such checkpoint folder; give a run's checkpoints/ folder or one "
                          "of its step_* folders")
    forwarded = [*(["--config", args.config] if args.config else []), *(["--dry-run"] if args.dry_run else []),
                 *(["--wait"] if args.wait else []),
                 "algorithm.name=eval", f"model.init_from={args.ckpt}", *args.overrides]
    return run.main(forwarded)
