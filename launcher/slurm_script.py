"""Render the sbatch templates of ``slurm/`` for a job: the script ``launch.py`` submits and ``--dry-run`` prints.

    python launch.py cluster.executor=slurm cluster.nodes=2 --dry-run      # shows the rendered script
    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch_render.py  # rewrite tests/golden/*.sbatch

Each template also works on its own (``sbatch slurm/grpo.sbatch`` with environment variables). Rendering
replaces three marked parts: the ``#SBATCH`` header (from ``cluster.*``), the setup lines (``cluster.setup``,
verbatim: they are commands) and the job settings (fixed values, each one shell-quoted). The body below them is
kept byte for byte, so launch.py and a plain sbatch share the srun, signal and requeue logic. Values that would
end an ``#SBATCH`` comment line (newlines) are rejected, since bash would run the rest of the line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from launcher.config.schema import ClusterConfig
from launcher.errors import ConfigError

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "slurm"
TRAIN_TEMPLATES = {"grpo": "grpo.sbatch", "rm": "rm.sbatch", "sft": "sft.sbatch", "pretrain": "pretrain.sbatch"}
CONVERT_TEMPLATE = "convert.sbatch"
REQUEUE_EXIT_CODE = 3  # megatron_rl.trainers.common.REQUEUE_EXIT_CODE; the templates requeue on it
PREEMPT_SIGNAL = "USR1"
SETUP_START, SETUP_END = "# ---- setup:", "# ---- end of setup ----"
SETTINGS_START, SETTINGS_END = "# ---- job settings", "# ---- end of job settings ----"
FLAG = re.compile(r"^--[a-z][a-z0-9-]*$")
# sbatch flags that a cluster key (or the launcher itself) already sets; sbatch_extra must not fight them.
OWNED_FLAGS = {
    "--job-name": "cluster.job_name", "--nodes": "cluster.nodes", "--ntasks-per-node": "cluster.tasks_per_node",
    "--gpus-per-node": "cluster.gpus_per_node", "--cpus-per-task": "cluster.cpus_per_task", "--mem": "cluster.mem",
    "--time": "cluster.time", "--partition": "cluster.partition", "--account": "cluster.account",
    "--qos": "cluster.qos", "--reservation": "cluster.reservation", "--constraint": "cluster.constraint",
    "--exclude": "cluster.exclude", "--signal": "cluster.signal_delay_s", "--output": "the launcher (run.dir/slurm)",
    "--error": "the launcher (run.dir/slurm)", "--open-mode": "the launcher (append, for requeues)",
}
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def slurm_time_seconds(text: str) -> int:
    """Seconds of a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    match = _TIME.match(text.strip())
    if match is None:
        raise ConfigError(f"cluster.time={text!r} is not a Slurm time; use HH:MM:SS or D-HH:MM:SS, e.g. 04:00:00")
    days, first, second, third = (int(g) if g is not None else None for g in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0)
    if third is not None:  # HH:MM:SS
        return first * 3600 + second * 60 + third
    return first * 60 + (second or 0)  # MM[:SS]


def _comment_safe(key: str, value: str) -> str:
    if any(ch in value for ch in "\n\r\0"):
        raise ConfigError(f"{key}={value!r} holds a line break; remove it (an #SBATCH line ends at a line break)")
    return value


def sbatch_options(cluster: ClusterConfig, *, output: str) -> list[str]:
    """The #SBATCH options (``--flag=value``, values shell-quoted) for ``cluster``, in a fixed order."""
    limit_s = slurm_time_seconds(cluster.time)
    if cluster.signal_delay_s and cluster.signal_delay_s >= limit_s:
        raise ConfigError(f"cluster.signal_delay_s={cluster.signal_delay_s} is not below cluster.time={cluster.time}"
                          f" ({limit_s} s); lower it so the checkpoint signal comes before the time limit")
    values: list[tuple[str, object, str]] = [
        ("--job-name", cluster.job_name, "cluster.job_name"), ("--nodes", cluster.nodes, "cluster.nodes"),
        ("--ntasks-per-node", cluster.tasks_per_node, "cluster.tasks_per_node"),
        ("--gpus-per-node", cluster.gpus_per_node or None, "cluster.gpus_per_node"),
        ("--cpus-per-task", cluster.cpus_per_task, "cluster.cpus_per_task"), ("--mem", cluster.mem, "cluster.mem"),
        ("--time", cluster.time, "cluster.time"), ("--partition", cluster.partition, "cluster.partition"),
        ("--account", cluster.account, "cluster.account"), ("--qos", cluster.qos, "cluster.qos"),
        ("--reservation", cluster.reservation, "cluster.reservation"),
        ("--constraint", cluster.constraint, "cluster.constraint"), ("--exclude", cluster.exclude, "cluster.exclude"),
        ("--signal", f"{PREEMPT_SIGNAL}@{cluster.signal_delay_s}" if cluster.signal_delay_s else None,
         "cluster.signal_delay_s"),
        ("--output", output, "run.dir"), ("--open-mode", "append", "-"),
    ]
    options = [f"{flag}={shlex.quote(_comment_safe(key, str(value)))}" for flag, value, key in values
               if value is not None]
    extra = [_extra_flag(item) for item in cluster.sbatch_extra]
    if not any(flag.split("=")[0] in ("--requeue", "--no-requeue") for flag in extra):
        options.append("--no-requeue")
    return options + extra


def _extra_flag(item: str) -> str:
    flag, sep, value = item.partition("=")
    if not FLAG.match(flag):
        raise ConfigError(f"cluster.sbatch_extra entry {item!r} is not a long sbatch option; write --flag=value")
    if flag in OWNED_FLAGS:
        raise ConfigError(f"cluster.sbatch_extra entry {item!r} sets {flag}, which {OWNED_FLAGS[flag]} already "
                          "sets; use that instead")
    return flag + (f"={shlex.quote(_comment_safe('cluster.sbatch_extra', value))}" if sep else "")


@dataclass(frozen=True, kw_only=True)
class Template:
    """A template split into its replaceable parts."""

    name: str
    """File name under slurm/, e.g. grpo.sbatch."""
    header: list[str]
    """The #SBATCH lines."""
    body: str
    """Everything after the job settings block, kept verbatim by render()."""


def load_template(name: str) -> Template:
    """slurm/NAME split at its marker lines."""
    path = TEMPLATE_DIR / name
    if not path.is_file():
        raise ConfigError(f"sbatch template {path} not found; the launcher needs the repository's slurm/ folder")
    lines = path.read_text().splitlines(keepends=True)
    end = next((i for i, line in enumerate(lines) if line.startswith(SETTINGS_END)), None)
    if end is None or not any(line.startswith(SETUP_START) for line in lines[:end]):
        raise ValueError(f"{path} lacks the marker lines {SETUP_START!r}... and {SETTINGS_END!r}")
    header = [line.rstrip("\n") for line in lines[:end] if line.startswith("#SBATCH")]
    return Template(name=name, header=header, body="".join(lines[end:]))


def render(template: Template, *, options: Sequence[str], setup: Sequence[str], settings: Sequence[str],
           note: str) -> str:
    """The filled script: shebang, a note, #SBATCH lines, setup lines, settings lines, then the template body."""
    lines = ["#!/bin/bash", f"# Rendered from slurm/{template.name} by launch.py; {note}"]
    lines += [f"#SBATCH {option}" for option in options]
    lines += ["", f"{SETUP_START} cluster.setup, run verbatim ----", *setup, SETUP_END, ""]
    lines += [f"{SETTINGS_START}: fixed by launch.py ----", *settings]
    return "\n".join(lines) + "\n" + template.body


def assign(name: str, value: object) -> str:
    """``NAME=value`` with the value shell-quoted."""
    return f"{name}={shlex.quote(str(value))}"


def assign_array(name: str, values: Sequence[str]) -> str:
    """``NAME=(a b ...)`` with each element shell-quoted."""
    return f"{name}=({shlex.join(values)})"


@dataclass(frozen=True, kw_only=True)
class TrainScript:
    """What render_train_script needs besides the cluster section."""

    algorithm: str
    """algorithm.name; picks the template."""
    run_dir: Path
    """Absolute run folder; logs go to run_dir/slurm."""
    config_path: Path
    """The resolved config.yaml every rank reads."""
    python: str
    """Interpreter of the tasks (and of submitit's entry point)."""
    task: Optional[Sequence[str]] = None
    """Command of each task; None runs ``python -u -m megatron_rl.main config_path``."""
    exports: Sequence[tuple[str, str]] = ()
    """Extra environment variables exported before srun (e.g. SUBMITIT_EXECUTOR=slurm)."""


def log_dir(run_dir: Path) -> Path:
    """run.dir/slurm: the batch log, the task logs and submitit's files."""
    if "%" in str(run_dir):
        raise ConfigError(f"run.dir={str(run_dir)!r} holds '%', which Slurm expands in log file names; rename it")
    return run_dir / "slurm"


def render_train_script(cluster: ClusterConfig, spec: TrainScript) -> str:
    """The sbatch script of a training job, from the algorithm's template."""
    template = load_template(TRAIN_TEMPLATES[spec.algorithm])
    options = sbatch_options(cluster, output=str(log_dir(spec.run_dir) / "%j_batch.log"))
    settings = [
        assign("ALGORITHM", spec.algorithm), assign("RUN_DIR", spec.run_dir), "CONFIG=''", "OVERRIDES=''",
        assign("CONFIG_PATH", spec.config_path), assign("MAX_REQUEUES", cluster.max_requeues),
        assign("PYTHON", spec.python), *_container_settings(cluster),
        assign_array("TASK", list(spec.task) if spec.task is not None else []),
        *(f"export {assign(name, value)}" for name, value in spec.exports),
    ]
    return render(template, options=options, setup=cluster.setup, settings=settings,
                  note=f"run folder {shlex.quote(str(spec.run_dir))}")


def render_convert_script(cluster: ClusterConfig, *, run_dir: Path, convert_args: Sequence[str], python: str,
                          repo_dir: Path) -> str:
    """The sbatch script of ``launch.py convert CONVERT_ARGS`` as a one-task job (resources from ``cluster``)."""
    template = load_template(CONVERT_TEMPLATE)
    options = sbatch_options(cluster, output=str(log_dir(run_dir) / "%j_batch.log"))
    settings = [
        assign("RUN_DIR", run_dir), assign("MAX_REQUEUES", 0), assign("PYTHON", python),
        *_container_settings(cluster),
        assign_array("TASK", [python, str(repo_dir / "launch.py"), "convert", *convert_args]),
    ]
    return render(template, options=options, setup=cluster.setup, settings=settings,
                  note=f"converts with: launch.py convert {shlex.join(convert_args)}")


def _container_settings(cluster: ClusterConfig) -> list[str]:
    for mount in cluster.container_mounts:
        if "," in mount or ":" not in mount:
            raise ConfigError(f"cluster.container_mounts entry {mount!r} must look like /src:/dst (no commas)")
    return [assign("CONTAINER_IMAGE", cluster.container_image or ""),
            assign("CONTAINER_MOUNTS", ",".join(cluster.container_mounts))]
