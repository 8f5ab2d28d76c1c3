"""Render ``slurm/train.sbatch`` for a job: the script ``launch.py`` submits and ``--dry-run`` prints.

    python launch.py cluster.executor=slurm cluster.nodes=2 --dry-run      # shows the rendered script
    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch_render.py  # rewrite tests/golden/*.sbatch

One template serves every job: each training algorithm (``ALGORITHM``) and checkpoint conversion (a different
``TASK``); it also works on its own (``sbatch slurm/train.sbatch`` with environment variables, and
``slurm/convert.sbatch``, which hands over to it). Rendering replaces three marked parts: the ``#SBATCH`` header
(from ``cluster.*``), the setup lines (``cluster.setup``, verbatim: they are commands) and the job settings (fixed
values, each one shell-quoted). The body below them is kept byte for byte, so launch.py and a plain sbatch share
the srun, signal and requeue logic. Values that would end a comment line (newlines) are rejected, since bash would
run the rest of the line.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from launcher.resources import templates_dir
from megatron_rl.spec.config.schema import ClusterConfig
from megatron_rl.spec.errors import ConfigError

TEMPLATE = "train.sbatch"
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
    "--export": "cluster.env",
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


def _one_line(value: str, what: str) -> str:
    if any(ch in value for ch in "\n\r\0"):
        raise ConfigError(f"{what} holds a line break; remove it (a comment line of the job script ends there)")
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
        ("--export", ",".join(["ALL", *cluster.env]) if cluster.env else None, "cluster.env"),
    ]
    options = [f"{flag}={shlex.quote(_one_line(str(value), f'{key}={str(value)!r}'))}" for flag, value, key in values
               if value is not None]
    extra = [_extra_flag(item) for item in cluster.sbatch_extra]
    if not any(flag.split("=")[0] in ("--requeue", "--no-requeue") for flag in extra):
        # Requeueable, so that an admin's `scontrol requeue`, scheduler preemption (PreemptMode=REQUEUE) and a
        # node failure start the job again; each start resumes from the newest complete checkpoint.
        options.append("--requeue" if cluster.max_requeues > 0 else "--no-requeue")
    return options + extra


def _extra_flag(item: str) -> str:
    flag, sep, value = item.partition("=")
    if not FLAG.match(flag):
        raise ConfigError(f"cluster.sbatch_extra entry {item!r} is not a long sbatch option; write --flag=value")
    if flag in OWNED_FLAGS:
        raise ConfigError(f"cluster.sbatch_extra entry {item!r} sets {flag}, which {OWNED_FLAGS[flag]} already "
                          "sets; use that instead")
    return flag + (f"={shlex.quote(_one_line(value, f'cluster.sbatch_extra={value!r}'))}" if sep else "")


@dataclass(frozen=True, kw_only=True)
class Template:
    """A template split into its replaceable parts."""

    name: str
    """File name under slurm/, e.g. train.sbatch."""
    header: list[str]
    """The #SBATCH lines."""
    body: str
    """Everything after the job settings block, kept verbatim by render()."""


def load_template(name: str) -> Template:
    """slurm/NAME split at its marker lines."""
    path = templates_dir() / name
    if not path.is_file():
        raise ConfigError(f"sbatch template {path} not found; reinstall megatron-rl (its slurm/ folder is missing)")
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
    """algorithm.name (the template's ALGORITHM)."""
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
    """The sbatch script of a training job."""
    settings = job_settings(cluster, algorithm=spec.algorithm, run_dir=spec.run_dir, config_path=spec.config_path,
                            max_requeues=cluster.max_requeues, python=spec.python, task=spec.task or ())
    settings += [f"export {assign(name, value)}" for name, value in spec.exports]
    return _render_job(cluster, spec.run_dir, settings, note=f"run folder {shlex.quote(str(spec.run_dir))}")


def conversion_cluster(cluster: ClusterConfig) -> ClusterConfig:
    """``cluster`` as a conversion job runs it: one task, no checkpoint signal, never requeued (a rerun starts over)."""
    return dataclasses.replace(cluster, nodes=1, tasks_per_node=1, gpus_per_node=0, signal_delay_s=0,
                               max_requeues=0)


def render_convert_script(cluster: ClusterConfig, *, run_dir: Path, convert_args: Sequence[str], python: str) -> str:
    """The sbatch script of ``launch.py convert CONVERT_ARGS`` as a one-task job (resources from ``cluster``)."""
    for arg in convert_args:
        _one_line(arg, f"the convert argument {arg!r}")
    task = [python, "-u", "-m", "launcher.cli", "convert", *convert_args]  # as the template's CONVERT_ARGS runs it
    settings = job_settings(cluster, algorithm="", run_dir=run_dir, config_path="", max_requeues=0, python=python,
                            task=task)
    return _render_job(conversion_cluster(cluster), run_dir, settings,
                       note=f"converts with: launch.py convert {shlex.join(convert_args)}")


def job_settings(cluster: ClusterConfig, *, algorithm: str, run_dir: Path, config_path: Path | str, max_requeues: int,
                 python: str, task: Sequence[str]) -> list[str]:
    """Every job setting of the template, fixed and shell-quoted."""
    for mount in cluster.container_mounts:
        if "," in mount or ":" not in mount:
            raise ConfigError(f"cluster.container_mounts entry {mount!r} must look like /src:/dst (no commas)")
    return [assign("ALGORITHM", algorithm), assign("RUN_DIR", run_dir), "CONFIG=''", "OVERRIDES=''",
            assign("CONFIG_PATH", config_path), "CONVERT_ARGS=''", assign("MAX_REQUEUES", max_requeues),
            assign("PYTHON", python), assign("CONTAINER_IMAGE", cluster.container_image or ""),
            assign("CONTAINER_MOUNTS", ",".join(cluster.container_mounts)), assign_array("TASK", list(task))]


def _render_job(cluster: ClusterConfig, run_dir: Path, settings: list[str], *, note: str) -> str:
    options = sbatch_options(cluster, output=str(log_dir(run_dir) / "%j_batch.log"))
    return render(load_template(TEMPLATE), options=options, setup=cluster.setup, settings=settings, note=note)
