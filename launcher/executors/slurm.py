"""Slurm executor: submit through submitit, as the rendered ``slurm/<algorithm>.sbatch`` template; --wait follows it.

    python launch.py cluster.executor=slurm cluster.nodes=2 cluster.tasks_per_node=1 parallel.tp=2 --wait
    python launch.py cluster.executor=slurm --dry-run     # the exact sbatch script that would be submitted

submitit pickles a ``launcher.slurm_task.TrainTask`` and submits the sbatch script; the script is our template
(``launcher.slurm_script``) rather than submitit's own, so ``--dry-run``, ``sbatch slurm/<x>.sbatch`` and this
executor share one srun line, one signal setup and one requeue rule. Files go to run.dir/slurm: submitit's
pickles and results, ``<jobid>_batch.log`` (the batch script) and ``<jobid>_<rank>_log.out/.err`` (each task).
"""

from __future__ import annotations

import contextlib
import io
import shlex
import shutil
import sys
from pathlib import Path

from launcher.config.schema import ClusterConfig
from launcher.errors import ConfigError
from launcher.job import PreparedJob
from launcher.slurm_script import TrainScript, log_dir, render_train_script, slurm_time_seconds
from launcher.slurm_task import TrainTask
from launcher.slurm_watch import Watch, wait_for_job

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


def require_tools(names: tuple[str, ...]) -> None:
    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        raise ConfigError(f"cluster.executor=slurm needs {', '.join(f'`{n}`' for n in missing)} on PATH, which this "
                          "machine lacks; run from a Slurm login node (with accounting for --wait) or set "
                          "cluster.executor=local")


def sbatch_error(stderr: str, cluster: ClusterConfig) -> ConfigError:
    """A one-line ConfigError from sbatch's complaint, naming the cluster key to fix."""
    said = [line.split("error:", 1)[1].strip() for line in stderr.splitlines() if "error:" in line]
    text = "; ".join(dict.fromkeys(said)) or " ".join(stderr.split()) or "no message"
    for word, key, how in SBATCH_HINTS:
        if word in text.lower():
            return ConfigError(f"sbatch rejected the job: {text} (check cluster.{key}="
                               f"{getattr(cluster, key)!r}; {how})")
    return ConfigError(f"sbatch rejected the job: {text} (check the cluster.* settings)")


def submit(job: PreparedJob, script: str) -> str:
    """Submit ``script`` through submitit with a TrainTask; return the job id."""
    import submitit
    from submitit.core.utils import FailedJobError

    class RenderedScriptExecutor(submitit.SlurmExecutor):
        """submitit's SlurmExecutor that submits our rendered template instead of its own sbatch file."""

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            if f"TASK=({shlex.join(shlex.split(command))})" not in script:
                raise RuntimeError(f"the rendered script does not run submitit's command {command!r}")
            return script

    cluster = job.cfg.cluster
    python = task_python(cluster)
    executor = RenderedScriptExecutor(folder=log_dir(job.run_dir), python=shlex.quote(python))
    executor.update_parameters(nodes=cluster.nodes, ntasks_per_node=cluster.tasks_per_node,
                               time=max(1, slurm_time_seconds(cluster.time) // 60))
    captured = io.StringIO()  # submitit prints sbatch's stderr itself; we turn it into one line instead
    try:
        with contextlib.redirect_stderr(captured):
            submitted = executor.submit(TrainTask(config_path=str(job.config_path), python=python))
    except FailedJobError as exc:
        raise sbatch_error(str(exc) or captured.getvalue(), cluster) from None
    return str(submitted.job_id)


def run(job: PreparedJob, *, wait: bool = False) -> int:
    """Submit the job; with ``wait``, follow it to the end and return its status (0 when it completed)."""
    require_tools(SUBMIT_TOOLS + (WAIT_TOOLS if wait else ()))
    script = script_for(job)  # checks the cluster values before anything is written
    job.write_config()
    folder = log_dir(job.run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    cluster = job.cfg.cluster
    job_id = submit(job, script)
    print(f"submitted Slurm job {job_id} ({cluster.nodes} node(s) x {cluster.tasks_per_node} task(s)) through "
          f"submitit\n  run folder: {job.run_dir}\n  batch log:  {folder / f'{job_id}_batch.log'}\n"
          f"  rank logs:  {folder / job_id}_<rank>_log.out and .err\n"
          f"  script:     {folder / f'{job_id}_submission.sh'}\n"
          f"  follow with: tail -f {shlex.quote(str(folder / f'{job_id}_0_log.out'))}; cancel with: scancel {job_id}",
          flush=True)
    if not wait:
        return 0
    try:
        return wait_for_job(Watch(job_id=job_id, log_dir=folder, num_tasks=cluster.world_size, cluster=cluster))
    except KeyboardInterrupt:
        print(f"\nstopped waiting; job {job_id} keeps running (cancel it with: scancel {job_id})", file=sys.stderr)
        return 130
