"""Slurm executor: submit a training job through submitit, or a conversion with sbatch, as the rendered
``slurm/train.sbatch``; --wait follows either to its end.

    python launch.py cluster.executor=slurm cluster.nodes=2 cluster.tasks_per_node=1 parallel.tp=2 --wait
    python launch.py cluster.executor=slurm --dry-run     # the exact sbatch script that would be submitted
    python launch.py convert hf-to-megatron --hf DIR --out DIR --tp 8 --slurm cluster.partition=cpu --wait

submitit pickles a ``launcher.slurm.task.TrainTask`` and submits the sbatch script; the script is our template
(``launcher.slurm.script``) rather than submitit's own, so ``--dry-run``, ``sbatch slurm/train.sbatch`` and this
executor share one srun line, one signal setup and one requeue rule. ``launch.py pipeline`` submits its
stages through ``submit_run(job, after=[previous job id])`` (``--dependency=afterok:ID --kill-on-invalid-dep=yes``).
Files go to run.dir/slurm: submitit's pickles and results, ``<jobid>_batch.log`` (the batch script) and
``<jobid>_<rank>_log.out/.err`` (each task).
"""

from __future__ import annotations

import contextlib
import io
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from launcher.job import PreparedJob, check_env
from launcher.lock import acquire
from launcher.slurm.script import (
    TrainScript,
    conversion_cluster,
    log_dir,
    render_convert_script,
    render_train_script,
    slurm_time_seconds,
)
from launcher.slurm.task import TrainTask
from launcher.slurm.watch import Watch, wait_for_job
from megatron_rl.spec.config.schema import ClusterConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.private import check_run_dir, make_private_dir, write_private_text

SUBMIT_TOOLS = ("sbatch", "srun", "scontrol")
WAIT_TOOLS = ("squeue", "sacct")
SBATCH_HINTS = (  # words in sbatch's error -> the key to fix
    ("partition", "partition", "list the partitions with `sinfo -s`"),
    ("account", "account", "list yours with `sacctmgr show assoc user=$USER`"),
    ("qos", "qos", "list yours with `sacctmgr show assoc user=$USER format=qos`"),
    ("reservation", "reservation", "list them with `scontrol show reservation`"),
    ("feature", "constraint", "list node features with `sinfo -o '%N %f'`"),
    ("time limit", "time", "see the partition's MaxTime in `sinfo -s`"),
    ("node configuration", "nodes", "the partition has fewer or smaller nodes; see `sinfo -N -l`"),
)


def task_python(cluster: ClusterConfig) -> str:
    """This interpreter (a shared venv) or, inside a container image, the image's `python3`."""
    return "python3" if cluster.container_image else sys.executable


def submitit_command(python: str, folder: Path) -> list[str]:
    """What submitit runs in each task (SlurmExecutor._submitit_command_str, as a list)."""
    return [python, "-u", "-m", "submitit.core._submit", str(folder)]


def script_for(job: PreparedJob) -> str:
    """The sbatch script this executor submits for ``job``."""
    python = task_python(job.cfg.cluster)
    spec = TrainScript(algorithm=job.cfg.algorithm.name, run_dir=job.run_dir, config_path=job.config_path,
                       python=python, task=submitit_command(python, log_dir(job.run_dir)),
                       exports=[("SUBMITIT_EXECUTOR", "slurm")])
    return render_train_script(job.cfg.cluster, spec)


def describe(job: PreparedJob) -> str:
    """The sbatch script that would be submitted, with a line on how it runs."""
    cluster = job.cfg.cluster
    return (f"# slurm executor: submitit submits this script; {cluster.nodes} node(s) x {cluster.tasks_per_node} "
            f"task(s) each run python -m megatron_rl.main {shlex.quote(str(job.config_path))}; logs in "
            f"{shlex.quote(str(log_dir(job.run_dir)))}\n" + script_for(job))


def require_tools(names: tuple[str, ...], *, what: str = "cluster.executor=slurm",
                  otherwise: str = "set cluster.executor=local") -> None:
    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        raise ConfigError(f"{what} needs {', '.join(f'`{n}`' for n in missing)} on PATH, which this machine lacks; "
                          f"run from a Slurm login node (with accounting for --wait) or {otherwise}")


def sbatch_error(stderr: str, cluster: ClusterConfig) -> ConfigError:
    """A one-line ConfigError from sbatch's complaint, naming the cluster key to fix."""
    said = [line.split("error:", 1)[1].strip() for line in stderr.splitlines() if "error:" in line]
    text = "; ".join(dict.fromkeys(said)) or " ".join(stderr.split()) or "no message"
    for word, key, how in SBATCH_HINTS:
        if word in text.lower():
            return ConfigError(f"sbatch rejected the job: {text} (check cluster.{key}="
                               f"{getattr(cluster, key)!r}; {how})")
    return ConfigError(f"sbatch rejected the job: {text} (check the cluster.* settings)")


def dependency_args(after: Sequence[str]) -> list[str]:
    """sbatch options that hold a job until every job in ``after`` COMPLETED (``afterok``) and make Slurm cancel it
    when one of them fails, times out or is cancelled (``--kill-on-invalid-dep=yes``): a pipeline's chain."""
    if not after:
        return []
    return [f"--dependency=afterok:{':'.join(after)}", "--kill-on-invalid-dep=yes"]


def submit(job: PreparedJob, script: str, *, after: Sequence[str] = ()) -> str:
    """Submit ``script`` through submitit with a TrainTask, held until the jobs ``after`` completed
    (``dependency_args``); return the job id."""
    import submitit
    from submitit.core.utils import FailedJobError

    class RenderedScriptExecutor(submitit.SlurmExecutor):
        """submitit's SlurmExecutor that submits our rendered template instead of its own sbatch file."""

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            if f"TASK=({shlex.join(shlex.split(command))})" not in script:
                raise RuntimeError(f"the rendered script does not run submitit's command {command!r}")
            return script

        def _make_submission_command(self, submission_file_path: Path) -> list[str]:
            return ["sbatch", *dependency_args(after), str(submission_file_path)]

    cluster = job.cfg.cluster
    python = task_python(cluster)
    executor = RenderedScriptExecutor(folder=log_dir(job.run_dir), python=shlex.quote(python))
    executor.update_parameters(nodes=cluster.nodes, ntasks_per_node=cluster.tasks_per_node,
                               time=max(1, slurm_time_seconds(cluster.time) // 60))
    captured = io.StringIO()  # submitit prints sbatch's stderr itself; we turn it into one line instead
    try:
        with contextlib.redirect_stderr(captured):
            submitted = executor.submit(TrainTask(config_path=str(job.config_path), python=python,
                                                     timeout_s=job.cfg.parallel.timeout_s))
    except FailedJobError as exc:
        raise sbatch_error(str(exc) or captured.getvalue(), cluster) from None
    return str(submitted.job_id)


def run(job: PreparedJob, *, wait: bool = False) -> int:
    """Submit the job; with ``wait``, follow it to the end and return its status (0 when it completed)."""
    require_tools(SUBMIT_TOOLS + (WAIT_TOOLS if wait else ()))
    job_id = submit_run(job)
    if not wait:
        return 0
    return follow_run(job, job_id)


def submit_run(job: PreparedJob, *, after: Sequence[str] = ()) -> str:
    """Take the run folder, write its config and submit the job (held until the jobs ``after`` completed);
    return the job id. ``run`` and ``launch.py pipeline`` submit through it."""
    script = script_for(job)  # checks the cluster values before anything is written
    check_env(job.cfg)
    lock = acquire(job.run_dir)  # before anything is written: a second launch into the folder stops here
    try:
        job.write_config()
        make_private_dir(log_dir(job.run_dir))
        job_id = submit(job, script, after=after)
    except BaseException:
        lock.release()
        raise
    lock.hand_to_job(job_id)  # the folder is the job's (and its requeued runs') while squeue lists it
    cluster = job.cfg.cluster
    _announce(job_id, job.run_dir, f"({cluster.nodes} node(s) x {cluster.tasks_per_node} task(s)) through submitit"
              + (f", after job(s) {', '.join(after)} (afterok)" if after else ""))
    return job_id


def follow_run(job: PreparedJob, job_id: str) -> int:
    """Follow a submitted job to its end (``--wait``); its status, 0 when it completed."""
    cluster = job.cfg.cluster
    return _follow(Watch(job_id=job_id, log_dir=log_dir(job.run_dir), num_tasks=cluster.world_size,
                         cluster=cluster))


# ---------------- checkpoint conversion as a one-task job ----------------
CONVERSION_DEFAULTS = ("run.dir=runs/convert", "cluster.job_name=megatron-rl-convert")
CONVERSION_FIXED_KEYS = ("nodes", "tasks_per_node", "gpus_per_node", "signal_delay_s", "max_requeues")


def conversion_job(overrides: Sequence[str]) -> tuple[ClusterConfig, Path]:
    """The cluster section and run folder of a conversion job, from ``cluster.*`` and ``run.dir`` overrides."""
    from megatron_rl.spec.config import load_config

    for item in overrides:
        key = item.partition("=")[0]
        if not key.startswith("cluster.") and key != "run.dir":
            raise ConfigError(f"convert --slurm takes cluster.* and run.dir overrides; {item!r} is neither")
        if key.removeprefix("cluster.") in CONVERSION_FIXED_KEYS:
            raise ConfigError(f"convert --slurm runs one CPU task on one node and never requeues; drop {item!r}")
    cfg = load_config(None, [*CONVERSION_DEFAULTS, *overrides])
    return cfg.cluster, Path(cfg.run.dir).expanduser().resolve()


def conversion_script(cluster: ClusterConfig, run_dir: Path, convert_args: Sequence[str]) -> str:
    """The sbatch script that runs ``launch.py convert CONVERT_ARGS``."""
    return render_convert_script(cluster, run_dir=run_dir, convert_args=convert_args, python=task_python(cluster))


def run_conversion(cluster: ClusterConfig, run_dir: Path, convert_args: Sequence[str], *, dry_run: bool = False,
                   wait: bool = False) -> int:
    """Submit ``launch.py convert CONVERT_ARGS`` with sbatch (``dry_run``: print the script instead)."""
    script = conversion_script(cluster, run_dir, convert_args)
    if dry_run:
        print(script, end="")
        return 0
    require_tools(("sbatch",) + (WAIT_TOOLS if wait else ()), what="convert --slurm",
                  otherwise="drop --slurm to convert on this machine")
    check_run_dir(run_dir)
    lock = acquire(run_dir)  # one job per run folder, conversions included
    try:
        folder = make_private_dir(log_dir(run_dir))
        result = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise sbatch_error(result.stderr, cluster)
    except BaseException:
        lock.release()
        raise
    job_id = result.stdout.strip().split(";")[0]
    lock.hand_to_job(job_id)
    write_private_text(folder / f"{job_id}_submission.sh", script)
    _announce(job_id, run_dir, f"(one task: launch.py convert {shlex.join(convert_args)})")
    if not wait:
        return 0
    return _follow(Watch(job_id=job_id, log_dir=folder, num_tasks=1, cluster=conversion_cluster(cluster)))


def _announce(job_id: str, run_dir: Path, what: str) -> None:
    folder = log_dir(run_dir)
    print(f"submitted Slurm job {job_id} {what}\n  run folder: {run_dir}\n"
          f"  batch log:  {folder / f'{job_id}_batch.log'}\n  rank logs:  {folder / job_id}_<rank>_log.out and .err\n"
          f"  script:     {folder / f'{job_id}_submission.sh'}\n"
          f"  follow with: tail -f {shlex.quote(str(folder / f'{job_id}_0_log.out'))}; cancel with: scancel {job_id}",
          flush=True)


def _follow(watch: Watch) -> int:
    try:
        return wait_for_job(watch)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; job {watch.job_id} keeps running (cancel it with: scancel {watch.job_id})",
              file=sys.stderr)
        return 130
