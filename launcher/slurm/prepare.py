"""Resolve the job's config inside a plain ``sbatch slurm/train.sbatch`` job and write RUN_DIR/config.yaml.

    python -m launcher.slurm.prepare --run-dir runs/x --algorithm grpo [--config FILE] -- [key=value ...]

The sbatch template runs this once per start of the job (when CONFIG_PATH is not given); it prints the path of
the written config.yaml as its only stdout line. The allocation decides the world size: cluster.nodes and
cluster.tasks_per_node are taken from SLURM_JOB_NUM_NODES and SLURM_NTASKS. Errors are one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Mapping, Optional

from launcher.lock import acquire
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.private import private_umask


def allocation_overrides(env: Mapping[str, str]) -> list[str]:
    """cluster.nodes / cluster.tasks_per_node overrides that match the Slurm allocation in ``env`` (if any)."""
    nodes, ntasks = env.get("SLURM_JOB_NUM_NODES"), env.get("SLURM_NTASKS")
    if not nodes or not ntasks:
        return []
    nodes_n, ntasks_n = int(nodes), int(ntasks)
    if ntasks_n % nodes_n:
        raise ConfigError(f"the allocation has {ntasks_n} tasks on {nodes_n} nodes; give sbatch --ntasks-per-node "
                          "so that every node runs the same number of ranks")
    return [f"cluster.nodes={nodes_n}", f"cluster.tasks_per_node={ntasks_n // nodes_n}"]


def resolve(*, run_dir: str, algorithm: str, config: Optional[str], overrides: list[str],
            env: Mapping[str, str]) -> Path:
    """Load, check and write the config of this allocation; return the config.yaml path."""
    from launcher.job import prepare
    from megatron_rl.spec.config import load_config
    from megatron_rl.spec.config.loader import env_references, given_keys

    forced = [f"run.dir={Path(run_dir).expanduser().resolve()}", f"algorithm.name={algorithm}",
              "cluster.executor=slurm", *allocation_overrides(env)]
    everything = [*overrides, *forced]
    unresolved = env_references(config, everything)
    job = prepare(load_config(config, everything), given=given_keys(config, everything), unresolved=unresolved,
                  first_start=env.get("SLURM_RESTART_COUNT", "0") == "0")
    job_id = env.get("SLURM_JOB_ID")
    lock = acquire(job.run_dir, job_id=job_id)  # a requeued start of this job finds the lock its own
    try:
        path = job.write_config()
    except BaseException:
        lock.release()
        raise
    if job_id:
        lock.hand_to_job(job_id)
    else:
        lock.release()
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.slurm.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", required=True, help="run folder (run.dir)")
    parser.add_argument("--algorithm", required=True, help="algorithm.name (the template's ALGORITHM)")
    parser.add_argument("--config", default=None, help="YAML config (optional)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    private_umask()
    try:
        path = resolve(run_dir=args.run_dir, algorithm=args.algorithm, config=args.config,
                       overrides=args.overrides, env=os.environ)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
