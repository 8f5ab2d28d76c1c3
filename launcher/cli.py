"""Command line of ``launch.py``: run a job, plan a layout, or convert a checkpoint.

    python launch.py [--config FILE] [--dry-run] [--wait] [key=value ...]   run (locally or on Slurm)
    python launch.py plan --model MODEL --gpus N --gpu-type TYPE [...]        size a layout, run nothing
    python launch.py convert hf-to-megatron|megatron-to-hf ...              convert checkpoints
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

from launcher.errors import ConfigError

SUBCOMMANDS = {
    "plan": ("launcher.planner.cli", "size the parallel layout for a model and GPU count (no job is started)"),
    "convert": ("launcher.convert_cli", "convert checkpoints between Megatron and Hugging Face formats"),
}

EPILOG = """\
subcommands:
  plan      {plan}
  convert   {convert}

examples:
  python launch.py                                  # default job: GRPO on a tiny model, 2 local CPU processes
  python launch.py --config configs/grpo_tiny.yaml run.steps=50 parallel.tp=2
  python launch.py --config configs/grpo_llama70b.yaml cluster.nodes=8 --wait
  python launch.py --dry-run                        # print the resolved config and what would start
  python launch.py plan --model llama-3.1-405b --gpus 16384 --gpu-type h100-80gb

Overrides are section.key=value for the sections model, parallel, cluster, algorithm, generation,
optimizer, data, checkpoint, logging and run (see configs/ and launcher/config/schema.py).
""".format(plan=SUBCOMMANDS["plan"][1], convert=SUBCOMMANDS["convert"][1])


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise ConfigError(f"{message} (see python launch.py --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="launch.py", description="Launch Megatron-Core RL post-training (GRPO, reward models) "
                     "on local processes or a Slurm cluster.", epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: the built-in tiny CPU job)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config, the layout and the "
                        "processes or sbatch script that would run; start nothing")
    parser.add_argument("--wait", action="store_true", help="Slurm: block until the job ends, stream its progress "
                        "and exit with its status (local runs always wait)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.steps=10")
    return parser


def run_job(argv: list[str]) -> int:
    from launcher.config import load_config, to_yaml
    from launcher.executors import get_executor
    from launcher.job import prepare

    args = build_parser().parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    job = prepare(cfg)
    executor = get_executor(job.executor)
    if args.dry_run:
        print("# resolved config")
        print(to_yaml(job.cfg).rstrip())
        if job.plan is not None:
            print("\n# layout chosen by the planner")
            print(job.plan.explain().rstrip())
        print(f"\n# what would run ({job.executor} executor)")
        print(executor.describe(job))
        return 0
    return executor.run(job, wait=args.wait)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
            return module.main(argv[1:])
        return run_job(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
