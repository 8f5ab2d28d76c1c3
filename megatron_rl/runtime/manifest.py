"""The run's audit record, ``run.dir/manifest.json``: what ran, from what, where, when, and what it produced.

Test: ``.venv/bin/python -m pytest tests/test_manifest.py -q`` (plus the manifest checks of the real runs in
tests/test_local_runs.py, tests/test_grpo_run.py and tests/test_reliability_launcher.py).

Every algorithm writes it through ``TrainerContext`` (``start`` when the context is made, ``checkpoint_saved``
after each save, ``export_written`` after a Hugging Face export, ``finished`` when the process ends), and
``launch.py convert megatron-to-hf`` adds its export to the manifest of the run the checkpoint came from. Keys:

    config        the resolved config, with every ``${oc.env:NAME}`` key kept as that text (as config.yaml)
    source        {"path", "commit", "dirty", "changes"}: git of the folder holding launcher/ (null without git)
    python, platform, packages   interpreter, OS, and importlib.metadata versions (null: not installed)
    inputs        [{"key", "path", "sha256", "bytes", "files", "attempt"}]: data files (data.train_path,
                  data.eval_path, the synthetic data under run.dir/data), model.tokenizer, model.init_from and
                  algorithm.reward_model (the step folder they resolve to), hashed once per attempt, after the
                  first save (the trainer has then read them) or at the end; a new entry only when one changed
    attempts      one per process start (a local rerun, a Slurm requeue): index, started_at, ended_at, status
                  (running, completed, preempted, exited N, failed: Error, lost: killed before it could
                  record its end), world_size, hosts ({host: "0-7"}),
                  slurm ({job_id, restart_count, array_job_id, array_task_id, nodelist}) or null,
                  resumed_from_step
    requeues      attempts with SLURM_RESTART_COUNT > 0;  slurm_job_ids: every job id seen
    checkpoints   [{"step", "path", "sha256", "files", "bytes", "saved_at", "save_s", "hash_s", "attempt"}]
    exports       [{"path", "checkpoint", "sha256", "files", "bytes", "exported_at", "attempt"}]
    started_at, ended_at, updated_at   ISO 8601 UTC

Hashes. A file's ``sha256`` is that of its bytes (``sha256sum FILE``). A folder's (a checkpoint step folder, an
export, a tokenizer) is the SHA-256 of the ``sha256sum`` lines of its files, sorted by relative path::

    sha256( "".join(f"{sha256(file)}  {relative/posix/path}\\n" for file in sorted files) )

so ``cd FOLDER && find . -type f -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum`` gives it
too. Files are read in 1 MiB chunks on a few threads (hashlib releases the GIL).

Cost. Only global rank 0 hashes, in one background thread, so training goes on while it reads; the next save
first waits for the previous checkpoint's hash (so retention never deletes a folder being read), and the end
of the process (completed, preempted or failed) waits for all of them. The file is rewritten under a lock
(``.manifest.lock``) by read-modify-write, so an export from another process is never lost; it is private
(0600) and replaced atomically (``megatron_rl.spec.private.write_private_text``). This module imports no torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from megatron_rl.spec.run_files import CONFIG_FILE, MANIFEST_FILE

LOCK_FILE = ".manifest.lock"
CHUNK = 1 << 20
"""Bytes read per hash update."""
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
PACKAGES = ("megatron-rl", "torch", "megatron-core", "transformers", "tokenizers", "safetensors", "numpy",
            "omegaconf", "submitit", "datasets", "peft", "trl", "transformer-engine", "wandb")
"""Distributions whose version is recorded (null when not installed)."""
SOURCE_TREE = Path(__file__).resolve().parents[2]
"""The project's source folder: the one holding launcher/ and megatron_rl/."""
MAX_CHANGES = 200
"""Lines of ``git status --porcelain`` kept."""


def now_utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------------------------------- hashing
def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def content_hash(path: str | Path) -> dict[str, Any]:
    """{"sha256", "bytes", "files"} of a file, or of a folder (the module docstring's definition)."""
    path = Path(path)
    if not path.is_dir():
        return {"sha256": file_sha256(path), "bytes": path.stat().st_size, "files": 1}
    files = sorted((os.path.relpath(os.path.join(folder, name), path).replace(os.sep, "/")
                    for folder, _, names in os.walk(path) for name in names), key=lambda rel: rel.encode())
    files = [rel for rel in files if (path / rel).is_file()]
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        hashes = list(pool.map(lambda rel: file_sha256(path / rel), files))
    lines = "".join(f"{digest}  {rel}\n" for digest, rel in zip(hashes, files, strict=True))
    return {"sha256": hashlib.sha256(lines.encode()).hexdigest(),
            "bytes": sum((path / rel).stat().st_size for rel in files), "files": len(files)}


def _hash_or_error(path: Path) -> dict[str, Any]:
    """content_hash, or {"sha256": None, "error": ...}: an unreadable input is recorded, never fatal."""
    try:
        return content_hash(path)
    except OSError as exc:
        return {"sha256": None, "error": f"{type(exc).__name__}: {exc.strerror or exc}"}


# ---------------------------------------------------------------------------------------------- environment
def source_state(tree: Path = SOURCE_TREE) -> dict[str, Any]:
    """git commit, dirty flag and changed paths of ``tree``; commit null when it is not its own git checkout
    (an installed package, no git)."""
    state: dict[str, Any] = {"path": str(tree), "commit": None, "dirty": None, "changes": []}

    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != tree.resolve():
        return state  # not a checkout, or a checkout that merely contains the installed package
    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain")
    state["commit"] = commit.strip() if commit else None
    if status is not None:
        lines = status.splitlines()
        state.update(dirty=bool(lines), changes=lines[:MAX_CHANGES])
    return state


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, Optional[str]]:
    from importlib import metadata

    versions: dict[str, Optional[str]] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def hosts_of(rank_hosts: list[str]) -> dict[str, str]:
    """Every rank's hostname (index: rank) as {host: its ranks}."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(rank_hosts):
        by_host.setdefault(host, []).append(rank)
    return {host: rank_ranges(ranks) for host, ranks in by_host.items()}


def slurm_attempt(env: dict[str, str] = os.environ) -> Optional[dict[str, Any]]:
    """The Slurm job this process runs in (null outside Slurm); restart_count counts its requeues."""
    if "SLURM_JOB_ID" not in env:
        return None
    return {"job_id": env["SLURM_JOB_ID"], "restart_count": int(env.get("SLURM_RESTART_COUNT", "0") or 0),
            "array_job_id": env.get("SLURM_ARRAY_JOB_ID"), "array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
            "nodelist": env.get("SLURM_JOB_NODELIST"), "cluster": env.get("SLURM_CLUSTER_NAME")}


def config_record(cfg: Any, config_path: Optional[str | Path]) -> dict[str, Any]:
    """The resolved config as a mapping, each key the config file set through ``${oc.env:...}`` kept as that
    text (the same rule as config.yaml: ``megatron_rl.spec.config.loader.env_references``), so no secret is in it."""
    import yaml

    from megatron_rl.spec.config.loader import env_references, to_yaml

    unresolved = env_references(config_path) if config_path and Path(config_path).is_file() else {}
    return yaml.safe_load(to_yaml(cfg, unresolved))


def input_paths(cfg: Any) -> list[tuple[str, Path]]:
    """(config key, local path) of everything the job reads besides its own checkpoints: data files, the
    synthetic data it wrote under run.dir/data, tokenizer, init_from and reward-model checkpoints."""
    from megatron_rl.runtime.checkpoint import resolve_checkpoint

    found: list[tuple[str, Path]] = []
    for key, value in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path),
                       ("model.tokenizer", cfg.model.tokenizer), ("model.name", cfg.model.name)):
        if value and Path(value).expanduser().exists():
            found.append((key, Path(value).expanduser().absolute()))
    synthetic = Path(cfg.run.dir) / "data"
    if synthetic.is_dir():
        found += [("data.synthetic", p.absolute()) for p in sorted(synthetic.iterdir()) if p.is_file()]
    checkpoints = (("model.init_from", cfg.model.init_from), ("algorithm.reward_model", cfg.algorithm.reward_model))
    for key, value in checkpoints:
        if value:
            try:
                found.append((key, resolve_checkpoint(Path(value).expanduser()).absolute()))
            except (OSError, FileNotFoundError):
                found.append((key, Path(value).expanduser().absolute()))
    return found


# ---------------------------------------------------------------------------------------------- the file
def update_manifest(run_dir: str | Path, change: Callable[[dict], None]) -> dict:
    """Read ``run_dir/manifest.json``, apply ``change`` to it, write it back (0600, atomic), all under the
    manifest's lock; returns the new contents. A manifest that cannot be parsed is kept aside, not lost."""
    from megatron_rl.spec.private import make_private_dir, open_private, write_private_text

    run_dir = make_private_dir(Path(run_dir))
    path = run_dir / MANIFEST_FILE
    fd = open_private(run_dir / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data: dict = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except ValueError:
                os.replace(path, path.with_name(f"{MANIFEST_FILE}.unreadable-{time.time_ns()}"))
        change(data)
        data["updated_at"] = now_utc()
        write_private_text(path, json.dumps(data, indent=1) + "\n")
        return data
    finally:
        os.close(fd)  # releases the flock


def find_run_manifest(checkpoint: str | Path) -> Optional[Path]:
    """The run folder whose manifest lists ``checkpoint``'s checkpoint folder (searched upwards from it: the
    default <run.dir>/checkpoints/step_N layout), or None."""
    folder = Path(checkpoint).resolve()
    for parent in list(folder.parents)[:3]:
        manifest = parent / MANIFEST_FILE
        if manifest.is_file():
            try:
                ckpt_dir = json.loads(manifest.read_text()).get("checkpoint_dir")
            except (OSError, ValueError):
                continue
            if ckpt_dir and Path(ckpt_dir).resolve() in (folder, *folder.parents):
                return parent
    return None


def export_entry(step_folder: Path, out_dir: Path, attempt: Optional[int]) -> dict[str, Any]:
    return {"path": str(Path(out_dir).resolve()), "checkpoint": str(Path(step_folder).resolve()),
            **_hash_or_error(Path(out_dir)), "exported_at": now_utc(), "attempt": attempt}


def record_export(checkpoint: str | Path, out_dir: str | Path) -> Optional[Path]:
    """Add the Hugging Face export ``out_dir`` of ``checkpoint`` (step folder or checkpoint root) to the manifest
    of the run it came from, when there is one (``launch.py convert``); returns that manifest's path."""
    from megatron_rl.runtime.checkpoint import resolve_checkpoint

    step_folder = resolve_checkpoint(checkpoint)
    run_dir = find_run_manifest(step_folder)
    if run_dir is None:
        return None
    entry = export_entry(step_folder, Path(out_dir), None)
    update_manifest(run_dir, lambda data: data.setdefault("exports", []).append(entry))
    return run_dir / MANIFEST_FILE


class RunManifest:
    """One process's writer of the run's manifest. Every method is a no-op where ``enabled`` is false (every
    rank but global rank 0); the hashing runs in one background thread, in order."""

    def __init__(self, cfg: Any, *, enabled: bool, config_path: Optional[str | Path] = None) -> None:
        self.cfg, self.enabled = cfg, enabled
        self.run_dir = Path(cfg.run.dir).absolute()
        default_config = self.run_dir / CONFIG_FILE
        self.config_path = config_path or (default_config if default_config.is_file() else None)
        self.attempt: dict[str, Any] = {}
        self._inputs_hashed = False
        self._tasks: queue.Queue = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._errors: list[str] = []

    @property
    def path(self) -> Path:
        return self.run_dir / MANIFEST_FILE

    def start(self, *, rank_hosts: list[str]) -> None:
        """A new attempt: config, source, versions, hosts and the Slurm job; earlier attempts are kept."""
        if not self.enabled:
            return
        slurm = slurm_attempt()
        record = {"config": config_record(self.cfg, self.config_path), "source": source_state(),
                  "python": sys.version.split()[0], "platform": platform.platform(),
                  "packages": package_versions(), "checkpoint_dir": str(Path(self.cfg.checkpoint_dir).absolute())}

        def change(data: dict) -> None:
            attempts = data.setdefault("attempts", [])
            for earlier in attempts:  # killed (SIGKILL, node failure) before it could record its end
                if earlier.get("status") == "running":
                    earlier["status"] = "lost: ended without recording its end"
            self.attempt = {"index": len(attempts) + 1, "started_at": now_utc(), "ended_at": None,
                            "status": "running", "world_size": len(rank_hosts), "hosts": hosts_of(rank_hosts),
                            "slurm": slurm, "resumed_from_step": None, "pid": os.getpid()}
            attempts.append(self.attempt)
            data.update(record)
            data.setdefault("started_at", self.attempt["started_at"])
            data["ended_at"] = None
            for key in ("inputs", "checkpoints", "exports"):
                data.setdefault(key, [])
            _count_jobs(data)

        update_manifest(self.run_dir, change)
        self._worker = threading.Thread(target=self._work, name="manifest-hash", daemon=True)
        self._worker.start()

    def resumed(self, step: int) -> None:
        """The attempt continues the run from checkpoint ``step`` (recorded with the next write)."""
        self.attempt["resumed_from_step"] = step

    def checkpoint_saved(self, folder: Path, step: int, *, save_s: float, kind: Optional[str] = None) -> None:
        """Hash the published checkpoint ``folder`` (and, the first time, the inputs) in the background.
        ``kind``: a companion checkpoint's name (PPO's critic), None for the trainer's own."""
        if not self.enabled:
            return
        self._queue_inputs()
        saved_at = now_utc()

        def task() -> None:
            start = time.perf_counter()
            digest = _hash_or_error(folder)
            entry = {"step": step, "path": str(Path(folder).absolute()), **digest, "saved_at": saved_at,
                     "save_s": round(save_s, 4), "hash_s": round(time.perf_counter() - start, 4),
                     "attempt": self.attempt.get("index")}
            if kind is not None:
                entry["companion"] = kind
            self._write(lambda data: data.setdefault("checkpoints", []).append(entry))

        self._tasks.put(task)

    def export_written(self, step_folder: Path, out_dir: Path) -> None:
        """Hash a Hugging Face export of this run in the background."""
        if not self.enabled:
            return
        attempt = self.attempt.get("index")
        self._tasks.put(lambda: self._write(lambda data: data.setdefault("exports", []).append(
            export_entry(step_folder, out_dir, attempt))))

    def wait(self) -> None:
        """Until every hash queued so far is recorded (before a save: retention may delete older folders)."""
        if self.enabled and self._worker is not None:
            self._tasks.join()

    def finished(self, status: str) -> None:
        """Record the end of this attempt (``status``) after the pending hashes; the run's ended_at too."""
        if not self.enabled or self._worker is None:
            return
        self._queue_inputs()
        self.wait()
        self._tasks.put(None)
        self._worker.join()
        self._worker = None
        ended = now_utc()
        self.attempt.update(ended_at=ended, status=status)
        if self._errors:
            self.attempt["errors"] = list(self._errors)
        self._write(lambda data: data.update(ended_at=ended))

    # -------------------------------------------------------------------------------------- internals
    def _queue_inputs(self) -> None:
        if self._inputs_hashed:
            return
        self._inputs_hashed = True
        paths = input_paths(self.cfg)
        index = self.attempt.get("index")

        def task() -> None:
            hashed = [{"key": key, "path": str(path), **_hash_or_error(path), "attempt": index}
                      for key, path in paths]

            def change(data: dict) -> None:
                known = {(e.get("key"), e.get("path"), e.get("sha256")) for e in data.setdefault("inputs", [])}
                data["inputs"] += [e for e in hashed if (e["key"], e["path"], e["sha256"]) not in known]

            self._write(change)

        self._tasks.put(task)

    def _write(self, change: Callable[[dict], None]) -> None:
        """Apply ``change`` and this attempt's current state to the file."""
        def both(data: dict) -> None:
            change(data)
            attempts = data.setdefault("attempts", [])
            index = self.attempt.get("index")
            for i, known in enumerate(attempts):
                if known.get("index") == index:
                    attempts[i] = dict(self.attempt)
            _count_jobs(data)

        update_manifest(self.run_dir, both)

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                if task is None:
                    return
                task()
            except Exception as exc:  # the audit record must never stop the training
                self._errors.append(f"{type(exc).__name__}: {exc}")
                print(f"warning: could not update {self.path}: {type(exc).__name__}: {exc}", file=sys.stderr,
                      flush=True)
            finally:
                self._tasks.task_done()


def _count_jobs(data: dict) -> None:
    attempts = data.get("attempts", [])
    slurm = [a["slurm"] for a in attempts if a.get("slurm")]
    data["requeues"] = sum(1 for s in slurm if s.get("restart_count", 0) > 0)
    data["slurm_job_ids"] = sorted({s["job_id"] for s in slurm}, key=lambda j: (len(j), j))
