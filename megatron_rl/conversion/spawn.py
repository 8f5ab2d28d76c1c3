"""Start the conversion worker processes (torchrun) from a torch-free parent and report their errors in one line.

The parent never imports torch: it writes the task list into a work folder, starts
``python -m torch.distributed.run --standalone --nproc-per-node N -m megatron_rl.conversion.worker TASKS.json``
(a single process runs without torchrun), logs everything to ``worker.log`` and turns a failed rank's
``rank<R>.error`` file into a ``ConfigError`` (exit code 2) or a RuntimeError naming the log.
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
from megatron_rl.spec.ports import free_port


def worker_command(nproc: int, tasks_file: Path, script: Optional[str] = None) -> list[str]:
    """The command line of the workers (``script``: another entry point that wraps the worker, e.g. in tests)."""
    entry = [script] if script else ["-m", "megatron_rl.conversion.worker"]
    if nproc == 1:
        return [sys.executable, *entry, str(tasks_file)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *entry, str(tasks_file)]


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
    if nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    log_path = work / "worker.log"
    failed = False
    try:
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run(worker_command(nproc, tasks_file, script), stdout=log, stderr=subprocess.STDOUT,
                                      env=env, timeout=timeout, cwd=repo_root)
            except subprocess.TimeoutExpired:
                failed = True
                raise RuntimeError(f"conversion workers timed out after {timeout} s (log: {log_path})") from None
        errors = sorted(work.glob("rank*.error"), key=lambda p: int(p.stem[4:]))
        if proc.returncode != 0 or errors:
            failed = True
            reports = [json.loads(p.read_text()) for p in errors]
            config_errors = [r["message"] for r in reports if r["kind"] == "config"]
            if config_errors:
                raise ConfigError(config_errors[0])
            detail = reports[0]["message"] if reports else f"exit code {proc.returncode}"
            raise RuntimeError(f"conversion workers failed: {detail} (log: {log_path})")
        result = work / "result.json"
        return json.loads(result.read_text()) if result.is_file() else []
    finally:
        if own and not failed and not keep_workdir:
            shutil.rmtree(work, ignore_errors=True)

