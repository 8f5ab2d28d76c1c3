"""``python launch.py [--config FILE] [--dry-run] [--wait] [key=value ...]``: run a job locally or on Slurm."""

from __future__ import annotations

import argparse

from launcher.cli import SUBCOMMANDS, CliParser

EPILOG = """\
subcommands:
{subcommands}

examples:
  python launch.py                                  # default job: GRPO on a tiny model, 2 local CPU processes
  python launch.py --config configs/grpo_tiny.yaml run.steps=50 parallel.tp=2
  python launch.py --config configs/grpo_llama70b.yaml cluster.nodes=8 --wait
  python launch.py --dry-run                        # print the resolved config and what would start
  python launch.py plan --model llama-3.1-405b --gpus 16384 --gpu-type h100-80gb
  python launch.py plan --config configs/grpo_llama70b.yaml parallel.tp=4   # the layout that job would get

Overrides are section.key=value for the sections model, parallel, cluster, algorithm, generation, runtime,
eval, optimizer, data, checkpoint, logging and run (see configs/ and megatron_rl/spec/config/schema.py).
"""


def build_parser() -> argparse.ArgumentParser:
    subcommands = "\n".join(f"  {name:<9} {summary}" for name, summary in SUBCOMMANDS.items())
    parser = CliParser(prog="launch.py", description="Launch Megatron-Core RL post-training (GRPO, DPO, reward "
                       "models, SFT, evaluation) on local processes or a Slurm cluster.", epilog=EPILOG.format(subcommands=subcommands),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="YAML config file, or the name of a shipped config such as "
                        "grpo_tiny (default: the built-in tiny CPU job)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config, the layout and the "
                        "processes or sbatch script that would run; start nothing")
    parser.add_argument("--wait", action="store_true", help="Slurm: block until the job ends, stream its progress "
                        "and exit with its status (local runs always wait)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.steps=10")
    return parser


def main(argv: list[str]) -> int:
    from launcher.executors import get_executor
    from launcher.job import check_input_paths, prepare
    from launcher.lock import LOCK_NAME, holder_alive, read_holder
    from launcher.runs.completion import completion
    from megatron_rl.spec.config import load_config
    from megatron_rl.spec.config.loader import env_references, given_keys

    args = build_parser().parse_intermixed_args(argv)
    unresolved = env_references(args.config, args.overrides)  # first: it refuses a secret in cluster.setup
    job = prepare(load_config(args.config, args.overrides), given=given_keys(args.config, args.overrides),
                  unresolved=unresolved)
    holder = read_holder(job.run_dir / LOCK_NAME)
    # a folder a live job holds is in use, not complete: the executor's lock refuses it with the holder's name
    done = None if holder and holder_alive(holder) else completion(job.cfg, job.run_dir)
    complete = (f"run.dir={job.run_dir} is complete: {done}. Nothing to run; to train on from its last checkpoint "
                "raise run.steps, to start over give a new run.dir")
    if done is not None and not args.dry_run:  # a rerun of a finished job: start nothing, change nothing
        print(complete)
        return 0
    if job.executor == "local" and not args.dry_run:  # a Slurm job may read paths only its nodes see; a dry run
        check_input_paths(job.cfg, args.config)        # shows what would run before the inputs are there
    executor = get_executor(job.executor)
    if not args.dry_run:
        return executor.run(job, wait=args.wait)
    if done is not None:
        print(f"# {complete} (launch.py would start nothing; what it would run for more steps follows)\n")
    print("# resolved config")
    print(job.config_text().rstrip())
    if job.plan is not None:
        print("\n# layout chosen by the planner")
        print(job.plan.explain().rstrip())
    print(f"\n# what would run ({job.executor} executor)")
    print(executor.describe(job))
    return 0
