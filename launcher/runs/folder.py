"""What a run folder holds, read without touching the job: config.yaml, the tail of metrics.jsonl, the lock that
names the live launcher or Slurm job, the Slurm job ids and the log files.

    python launch.py status RUN_DIR

Local runs log to ``logs/rank<N>.log`` and hold ``.lock`` (the launcher's pid and host) while they run. Slurm runs
log to ``slurm/<jobid>_batch.log`` and ``slurm/<jobid>_<rank>_log.out|err``; every job ever submitted into the
folder (a relaunch resumes under a new id) leaves its files there, and ``.lock`` names the latest one.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from launcher.lock import CANCELLED_NAME, LOCK_NAME, pid_alive, read_holder
from launcher.slurm.query import FINAL_STATES, live_state
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.run_files import CONFIG_FILE, METRICS_FILE

STAGE_ORDER_FILE = "stages.txt"
"""A pipeline folder's stage order, one stage name a line (``launcher.pipeline``)."""
METRICS_TAIL_BYTES = 1 << 20
"""Only the end of metrics.jsonl is read: enough lines for the last step and the recent step times."""
JOB_FILE = re.compile(r"^(\d+)_")
LOCAL_LOG = re.compile(r"^rank(\d+)\.log$")
TASK_LOG = re.compile(r"^(\d+)_(\d+)_log\.(out|err)$")
MAIN_PHASES = (None, "train")
"""metrics.jsonl phases of the run's own steps (warm-up lines say "sft", held-out ones "eval")."""


@dataclass(kw_only=True)
class RunFolder:
    """One run folder (a ``run.dir``)."""

    path: Path
    """The folder, as given (absolute)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Its config.yaml."""

    def section(self, name: str) -> dict[str, Any]:
        value = self.config.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def executor(self) -> str:
        """"slurm" or "local": the executor of the latest launch into the folder (config.yaml is rewritten)."""
        executor = self.section("cluster").get("executor")
        if executor in ("local", "slurm"):
            return executor
        return "slurm" if self.job_ids() else "local"

    @property
    def steps(self) -> Optional[int]:
        steps = self.section("run").get("steps")
        return steps if isinstance(steps, int) else None

    def lock_holder(self) -> dict[str, Any]:
        """What ``.lock`` says ({} when there is none): pid, host, and slurm_job_id for a Slurm run."""
        return read_holder(self.path / LOCK_NAME)

    def cancelled(self) -> dict[str, Any]:
        """What ``.cancelled`` says ({} when the run was not cancelled): who cancelled it and when."""
        return read_holder(self.path / CANCELLED_NAME)

    def job_ids(self) -> list[str]:
        """Slurm job ids that wrote into the folder, oldest first."""
        found = {match.group(1) for name in _names(self.path / "slurm") if (match := JOB_FILE.match(name))}
        held = self.lock_holder().get("slurm_job_id")
        if held:
            found.add(str(held))
        return sorted(found, key=int)

    def local_launcher(self) -> Optional[int]:
        """The pid of the local launcher running in this folder on this host, or None."""
        holder = self.lock_holder()
        pid = holder.get("pid")
        if holder.get("slurm_job_id") or holder.get("host") != socket.gethostname() or not pid_alive(pid):
            return None
        return pid

    def is_running(self) -> bool:
        """Whether the run may still write: its local launcher lives, or its latest Slurm job has not ended."""
        if self.executor == "local":
            return self.local_launcher() is not None
        jobs = self.job_ids()
        seen = live_state(jobs[-1]) if jobs else None
        return seen is not None and seen.state not in FINAL_STATES

    def recent_metrics(self) -> list[dict[str, Any]]:
        """The last lines of metrics.jsonl (up to METRICS_TAIL_BYTES), parsed; a line being written is skipped."""
        path = self.path / METRICS_FILE
        try:
            with path.open("rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                handle.seek(max(0, size - METRICS_TAIL_BYTES))
                data = handle.read()
        except OSError:
            return []
        lines = data.split(b"\n")
        if size > METRICS_TAIL_BYTES:
            lines = lines[1:]  # starts mid-line
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def rank_logs(self, rank: int, job_id: Optional[str] = None) -> list[tuple[str, Path]]:
        """(kind, path) of the existing logs of ``rank``: kind "rank" for a local run; "batch", "stdout" and
        "stderr" of the latest (or the given) Slurm job."""
        if self.executor == "local":
            path = self.path / "logs" / f"rank{rank}.log"
            return [("rank", path)] if path.is_file() else []
        job_id = job_id or (self.job_ids() or [None])[-1]
        if job_id is None:
            return []
        folder = self.path / "slurm"
        ranks = [("stdout", folder / f"{job_id}_{rank}_log.out"), ("stderr", folder / f"{job_id}_{rank}_log.err")]
        found = [(kind, path) for kind, path in ranks if path.is_file()]
        batch = folder / f"{job_id}_batch.log"
        return [("batch", batch), *found] if found and batch.is_file() else found

    def ranks_with_logs(self, job_id: Optional[str] = None) -> list[int]:
        if self.executor == "local":
            return sorted(int(m.group(1)) for n in _names(self.path / "logs") if (m := LOCAL_LOG.match(n)))
        job_id = job_id or (self.job_ids() or [None])[-1]
        return sorted({int(m.group(2)) for n in _names(self.path / "slurm")
                       if (m := TASK_LOG.match(n)) and m.group(1) == job_id})


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def is_run_folder(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def stage_folders(path: Path) -> list[Path]:
    """The direct subfolders of ``path`` that are run folders: first those ``stages.txt`` lists (written by
    ``launch.py pipeline``: one stage name a line), in its order, then the others in the order their stages
    started (config.yaml's write time; the stage name breaks ties)."""
    stages = [path / name for name in _names(path) if (path / name).is_dir() and is_run_folder(path / name)]
    listed = {name: index for index, name in enumerate(stage_order(path))}
    return sorted(stages, key=lambda stage: (listed.get(stage.name, len(listed)),
                                             (stage / CONFIG_FILE).stat().st_mtime, stage.name))


def stage_order(path: Path) -> list[str]:
    """The stage names of ``path/stages.txt`` in order ([] without one)."""
    try:
        text = (path / STAGE_ORDER_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_run(path: Path) -> RunFolder:
    try:
        config = yaml.safe_load((path / CONFIG_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path / CONFIG_FILE} ({exc.__class__.__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'}); check the file") from None
    return RunFolder(path=path, config=config if isinstance(config, dict) else {})


def open_folder(path: str | Path, *, command: str) -> list[tuple[Optional[str], RunFolder]]:
    """[(None, run)] for a run folder, or [(stage name, run), ...] for a folder of run folders (a pipeline);
    ConfigError naming the path and the fix otherwise."""
    folder = Path(path).expanduser().absolute()
    usage = f"give a run folder (the run.dir of a launch, holding {CONFIG_FILE}) or a pipeline folder"
    if not folder.exists():
        raise ConfigError(f"{command}: {folder} does not exist; {usage}")
    if not folder.is_dir():
        raise ConfigError(f"{command}: {folder} is a file, not a folder; {usage}")
    if is_run_folder(folder):
        return [(None, read_run(folder))]
    stages = stage_folders(folder)
    if not stages:
        raise ConfigError(f"{command}: {folder} is not a run folder (no {CONFIG_FILE} in it or in its subfolders); "
                          f"{usage}")
    return [(stage.name, read_run(stage)) for stage in stages]


def open_run(path: str | Path, *, command: str) -> RunFolder:
    """The one run folder at ``path``; for a pipeline folder, ConfigError naming its stage folders."""
    runs = open_folder(path, command=command)
    if runs[0][0] is not None:
        names = " or ".join(str(run.path) for _, run in runs[:3])
        raise ConfigError(f"{command}: {Path(path).expanduser().absolute()} is a pipeline of {len(runs)} stages; "
                          f"give one stage's folder, e.g. {names}")
    return runs[0][1]
