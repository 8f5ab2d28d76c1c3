"""Start the conversion worker processes from a torch-free parent and report their errors in one line.

The parent never imports torch: it writes the task list into a work folder, starts N processes of
``python -m megatron_rl.conversion.worker TASKS.json`` with torchrun's environment (``megatron_rl.spec.local_ranks``:
no torchrun agent, which would cost ~2 s a conversion), logs everything to ``worker.log`` and turns a failed
rank's ``rank<R>.error`` file into a ``ConfigError`` (exit code 2) or a RuntimeError naming the log.
Workers always run on the CPU (``CUDA_VISIBLE_DEVICES=''``): conversion moves bytes, it does no math.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.local_ranks import kill_leftovers, start_ranks, watch
from megatron_rl.spec.ports import free_port


def worker_command(tasks_file: Path, script: Optional[str] = None) -> list[str]:
    """The command line of each worker (``script``: another entry point that wraps the worker, e.g. in tests)."""
    entry = [script] if script else ["-m", "megatron_rl.conversion.worker"]
    return [sys.executable, *entry, str(tasks_file)]


def run_worker(tasks: list[dict[str, Any]], nproc: int, *, workdir: Optional[Path] = None,
               timeout: Optional[float] = None, keep_workdir: bool = False,
               script: Optional[str] = None) -> list[dict[str, Any]]:
    """Run ``tasks`` on ``nproc`` worker processes; returns rank 0's per-task results."""
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="convert-")) if own else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    tasks_file = work / "tasks.json"
    tasks_file.write_text(json.dumps(tasks, indent=1))
    repo_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        p for p in (repo_root, os.environ.get("PYTHONPATH", "")) if p)}
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path = work / "worker.log"
    failed = False
    try:
        with open(log_path, "w") as log:
            procs = start_ranks(worker_command(tasks_file, script), nproc, port=free_port(), env=env, stdout=log,
                                cwd=repo_root)
            try:
                returncode = watch(procs, timeout=timeout)
            except subprocess.TimeoutExpired:
                failed = True
                raise RuntimeError(f"conversion workers timed out after {timeout} s (log: {log_path})") from None
            finally:
                kill_leftovers(procs)
        errors = sorted(work.glob("rank*.error"), key=lambda p: int(p.stem[4:]))
        if returncode != 0 or errors:
            failed = True
            reports = [json.loads(p.read_text()) for p in errors]
            config_errors = [r["message"] for r in reports if r["kind"] == "config"]
            if config_errors:
                raise ConfigError(config_errors[0])
            detail = reports[0]["message"] if reports else f"exit code {returncode}"
            raise RuntimeError(f"conversion workers failed: {detail} (log: {log_path})")
        result = work / "result.json"
        return json.loads(result.read_text()) if result.is_file() else []
    finally:
        if own and not failed and not keep_workdir:
            shutil.rmtree(work, ignore_errors=True)

