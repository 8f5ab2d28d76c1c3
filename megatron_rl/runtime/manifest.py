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
    checkpoints   [{"step", "path", "sha256", "files", "bytes", "saved_at", "save_s", "hash_s", "hash", "attempt"}]:
                  ``hash`` is "hashed", "pending", "off" (checkpoint.hash false), or why it is not (a rank did
                  not finish within checkpoint.hash_wait_s, or retention deleted the folder first); sha256 null
                  unless hashed
    exports       [{"path", "checkpoint", "sha256", "files", "bytes", "exported_at", "attempt"}]
    started_at, ended_at, updated_at   ISO 8601 UTC

Hashes. A file's ``sha256`` is that of its bytes (``sha256sum FILE``). A folder's (a checkpoint step folder, an
export, a tokenizer) is the SHA-256 of the ``sha256sum`` lines of its files, sorted by relative path::

    sha256( "".join(f"{sha256(file)}  {relative/posix/path}\\n" for file in sorted files) )

so ``cd FOLDER && find . -type f -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum`` gives it
too. Files are read in 1 MiB chunks on a few threads (hashlib releases the GIL).

Cost. A checkpoint is hashed where it was written: every rank hashes its own shards (``__<rank>_*.distcp``;
global rank 0 also the metadata and common files) in a background thread of its own (``ShardHasher``), never
inside a collective, and writes the file hashes to ``run.dir/.hashes``; global rank 0 composes the folder's hash
from every rank's (the same sha256 as hashing the folder at once) when all are in. Nothing waits for a hash
while training: a folder that retention deletes before its hash is done is recorded as such. The end of the
process waits at most ``checkpoint.hash_wait_s`` for the pending ones and records what was not hashed. Inputs
and exports are hashed by global rank 0, in its background thread. The file is rewritten under a lock
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
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from megatron_rl.spec.private import write_private_text
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
HASHES_DIR = ".hashes"
"""Under run.dir: each rank's file hashes of a checkpoint, until global rank 0 composes them."""
RANK_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
"""The shard files of Megatron's torch_dist format, named by the global rank that wrote them."""
POLL_S = 0.2
RETIRED = "deleted by retention before its hash was done"


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


def rank_files(folder: Path, rank: int) -> list[str]:
    """Relative paths of the files of checkpoint ``folder`` that global rank ``rank`` wrote: its torch_dist shards,
    and for rank 0 every file that is no rank's shard."""
    out = []
    for parent, _, names in os.walk(folder):
        for name in names:
            match = RANK_SHARD.match(name)
            if (int(match.group(1)) == rank) if match else rank == 0:
                out.append(os.path.relpath(os.path.join(parent, name), folder).replace(os.sep, "/"))
    return out


def composed_hash(parts: list[dict]) -> dict[str, Any]:
    """The folder's {"sha256", "files", "bytes", "hash_s"} from the ranks' parts ({"files": {rel: sha256},
    "bytes", "hash_s"}): the module docstring's folder hash over every rank's files."""
    files: dict[str, str] = {}
    for part in parts:
        files.update(part["files"])
    lines = "".join(f"{files[rel]}  {rel}\n" for rel in sorted(files, key=lambda rel: rel.encode()))
    return {"sha256": hashlib.sha256(lines.encode()).hexdigest(), "files": len(files),
            "bytes": sum(part["bytes"] for part in parts), "hash_s": max(part["hash_s"] for part in parts)}


class ShardHasher:
    """One rank's hashing of the checkpoint files it wrote, in a background thread, in save order; each result is
    written to ``run.dir/.hashes/<key>/rank<R>.json`` (``key`` names one save of one checkpoint)."""

    def __init__(self, run_dir: Path, *, rank: int, enabled: bool) -> None:
        self.root, self.rank, self.enabled = Path(run_dir) / HASHES_DIR, rank, enabled
        self._tasks: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def queue(self, folder: Path, key: str) -> None:
        if not self.enabled:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="checkpoint-hash", daemon=True)
            self._thread.start()
        self._tasks.put((Path(folder), key))

    def finish(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for the queued hashes; an unfinished one is left (its thread is a daemon)."""
        if self._thread is None:
            return
        self._tasks.put(None)
        self._thread.join(timeout_s)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            folder, key = task
            start = time.perf_counter()
            part: dict[str, Any] = {"files": {}, "bytes": 0}
            try:
                for rel in rank_files(folder, self.rank):
                    part["files"][rel] = file_sha256(folder / rel)
                    part["bytes"] += (folder / rel).stat().st_size
                part["error"] = None if folder.is_dir() else RETIRED
            except OSError:
                part["error"] = RETIRED
            part["hash_s"] = round(time.perf_counter() - start, 4)
            try:
                (self.root / key).mkdir(parents=True, exist_ok=True, mode=0o700)
                write_private_text(self.root / key / f"rank{self.rank}.json", json.dumps(part))
            except OSError as exc:  # the audit record must never stop the training
                print(f"warning: could not record the hash of {folder}: {exc}", file=sys.stderr, flush=True)


class RunManifest:
    """One process's writer of the run's manifest. Every method is a no-op where ``enabled`` is false (every
    rank but global rank 0); the hashing runs in one background thread, in order."""

    def __init__(self, cfg: Any, *, enabled: bool, config_path: Optional[str | Path] = None, rank: int = 0) -> None:
        self.cfg, self.enabled = cfg, enabled
        self.run_dir = Path(cfg.run.dir).absolute()
        default_config = self.run_dir / CONFIG_FILE
        self.config_path = config_path or (default_config if default_config.is_file() else None)
        self.attempt: dict[str, Any] = {}
        self._inputs_hashed = False
        self._tasks: queue.Queue = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._errors: list[str] = []
        self.shards = ShardHasher(self.run_dir, rank=rank, enabled=cfg.checkpoint.hash)
        self._saves = 0
        self._world = 1
        self._pending: dict[str, dict] = {}
        """Global rank 0: hash key -> its checkpoint entry, until every rank's part is in."""

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

        data = update_manifest(self.run_dir, change)
        self._world = len(rank_hosts)
        shutil.rmtree(self.run_dir / HASHES_DIR, ignore_errors=True)  # an earlier attempt's leftovers
        self._worker = threading.Thread(target=self._work, name="manifest-hash", daemon=True)
        self._worker.start()
        for entry in data.get("checkpoints", []):  # an earlier attempt ended (killed) before these were hashed
            if entry.get("hash") == "pending" and Path(entry["path"]).is_dir() and self.cfg.checkpoint.hash:
                self._tasks.put(lambda entry=entry: self._rehash(entry))

    def resumed(self, step: int) -> None:
        """The attempt continues the run from checkpoint ``step`` (recorded with the next write)."""
        self.attempt["resumed_from_step"] = step

    def checkpoint_saved(self, folder: Path, step: int, *, save_s: float, kind: Optional[str] = None) -> None:
        """Every rank: hash the files it wrote of the published checkpoint ``folder``, in the background. Global
        rank 0: record the checkpoint (its hash pending) and, the first time, hash the inputs. ``kind``: a
        companion checkpoint's name (PPO's critic), None for the trainer's own."""
        self._saves += 1
        key = f"{self._saves:05d}-{kind or 'main'}-{Path(folder).name}"  # the same on every rank
        self.shards.queue(Path(folder), key)
        if not self.enabled:
            return
        self._queue_inputs()
        entry = {"step": step, "path": str(Path(folder).absolute()), "sha256": None, "files": None, "bytes": None,
                 "saved_at": now_utc(), "save_s": round(save_s, 4), "hash_s": None,
                 "hash": "pending" if self.cfg.checkpoint.hash else "off", "attempt": self.attempt.get("index")}
        if kind is not None:
            entry["companion"] = kind
        if self.cfg.checkpoint.hash:
            self._pending[key] = entry
        self._tasks.put(lambda: self._write(lambda data: data.setdefault("checkpoints", []).append(dict(entry))))
        self._tasks.put(lambda: self._compose(final=False))

    def export_written(self, step_folder: Path, out_dir: Path) -> None:
        """Hash a Hugging Face export of this run in the background."""
        if not self.enabled:
            return
        attempt = self.attempt.get("index")
        self._tasks.put(lambda: self._write(lambda data: data.setdefault("exports", []).append(
            export_entry(step_folder, out_dir, attempt))))

    def wait(self) -> None:
        """Until everything queued to this rank's manifest thread so far is recorded."""
        if self.enabled and self._worker is not None:
            self._tasks.join()

    def finished(self, status: str) -> None:
        """Record the end of this attempt (``status``) after the pending hashes, waiting at most
        checkpoint.hash_wait_s for them (what was not hashed by then is recorded as such); ended_at too."""
        deadline = time.monotonic() + self.cfg.checkpoint.hash_wait_s
        self.shards.finish(self.cfg.checkpoint.hash_wait_s)
        if not self.enabled or self._worker is None:
            return
        self._queue_inputs()
        self.wait()
        while self._pending and time.monotonic() < deadline:
            self._tasks.put(lambda: self._compose(final=False))
            self.wait()
            if self._pending:
                time.sleep(POLL_S)
        self._tasks.put(lambda: self._compose(final=True))
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

    def _compose(self, *, final: bool) -> None:
        """The checkpoints whose every rank's part is in get their hash (the folder's, composed); with ``final``
        the rest are recorded as not hashed in time."""
        done = {}
        for key, entry in list(self._pending.items()):
            parts, missing = [], []
            for rank in range(self._world):
                path = self.run_dir / HASHES_DIR / key / f"rank{rank}.json"
                try:
                    parts.append(json.loads(path.read_text()))
                except (OSError, ValueError):
                    missing.append(rank)
            errors = [part["error"] for part in parts if part["error"]]
            if errors:  # the folder is gone: nothing to wait for
                update = {"hash": errors[0]}
            elif missing and not final:
                continue
            elif missing:
                update = {"hash": f"not hashed within checkpoint.hash_wait_s={self.cfg.checkpoint.hash_wait_s}: "
                                  f"ranks {rank_ranges(missing)}"}
            else:
                update = {**composed_hash(parts), "hash": "hashed"}
            done[key] = (entry, update)
        if not done:
            return

        self._update_checkpoints(list(done.values()))
        for key in done:
            del self._pending[key]
            shutil.rmtree(self.run_dir / HASHES_DIR / key, ignore_errors=True)

    def _rehash(self, entry: dict) -> None:
        """Hash a checkpoint an earlier attempt left pending, whole, on this rank (its ranks are gone)."""
        start = time.perf_counter()
        digest = _hash_or_error(Path(entry["path"]))
        update = {**digest, "hash_s": round(time.perf_counter() - start, 4),
                  "hash": "hashed" if digest["sha256"] else digest.get("error", RETIRED)}
        self._update_checkpoints([(entry, update)])

    def _update_checkpoints(self, updates: list[tuple[dict, dict]]) -> None:
        """Apply each (entry, update) to the manifest's checkpoint entry saved at the same path and time."""
        def change(data: dict) -> None:
            for entry, update in updates:
                for known in data.setdefault("checkpoints", []):
                    if (known.get("path"), known.get("saved_at")) == (entry["path"], entry["saved_at"]):
                        known.update(update)

        self._write(change)

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
