"""Distributed checkpoints with ``megatron.core.dist_checkpointing``, published atomically.

Layout of ``checkpoint.dir``::

    step_00000010/      a complete checkpoint (model, optimizer, scheduler, step, data position, RNG states,
                        and ``saved.json``: its place in the save order and the size of every file it holds)
    step_00000020/
    latest              text file naming the newest complete step folder, written last
    .tmp-step_...       a save in progress (or one a crash interrupted; removed on the next start)
    .old-step_...       the previous save of a step being saved again, kept until the new one is published
    .del-...            a folder being deleted (retention, cleanup)

A save writes into a ``.tmp-`` folder; each node flushes (fsync) the files its ranks wrote; then rank 0 moves
an older save of the same step aside, renames the ``.tmp-`` folder to ``step_N``, and rewrites ``latest``
durably (temp file, fsync, rename, fsync of the folder): a checkpoint that looks complete is complete, and
at every moment ``latest`` names a complete checkpoint or its ``.old-`` copy (``remove_partial_saves``
renames it back). Retention keeps the last ``keep_last`` in save order (not step order: a ``resume=false``
run into an old folder saves low steps after high ones), never the target of ``latest``; old folders are
renamed to ``.del-`` and deleted by a background thread of rank 0 after the publishing barrier, so no rank
waits on the deletes inside a collective. A resume takes the newest checkpoint whose files are all there at their
saved sizes (``resumable_checkpoint``): a truncated shard or a deleted file in the newest one (a storage fault, a
file removed by hand) costs one warning line and the steps since the previous one, never a traceback, and a run
whose checkpoints are all damaged is refused in one line rather than started again from step 0 over them.
Model and optimizer tensors are stored by their global (layout-free) keys, so a checkpoint loads at any TP/PP/DP.
RNG states are per rank and are restored only when the layout is unchanged. Every published step folder is listed, with its content hash, in the run's
``manifest.json`` (``megatron_rl/runtime/manifest.py`` defines the hash: SHA-256 of the ``sha256sum`` lines of
the folder's files, sorted by relative path).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from megatron_rl.models import unwrap

STEP_DIR = re.compile(r"^step_(\d{8})$")
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


COMPANION_KEY = "companion"
"""Extra-state key of a companion engine's checkpoint (PPO's critic, ``TrainerContext.companions``): its name, so
an export knows which head it holds."""

def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


TMP_PREFIX, ASIDE_PREFIX, DELETE_PREFIX = ".tmp-", ".old-", ".del-"
SAVE_ORDER_FILE = "saved.json"


def complete_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``ckpt_dir``, oldest save first (folders without a save order, written by
    older versions, come first by step)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: (_save_seq(p), int(STEP_DIR.match(p.name).group(1))))


def _save_seq(folder: Path) -> int:
    try:
        return int(json.loads((folder / SAVE_ORDER_FILE).read_text())["seq"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _file_sizes(folder: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``folder`` but the save-order file (which lists them)."""
    sizes = {}
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            path = Path(dirpath) / name
            relative = path.relative_to(folder).as_posix()
            if relative != SAVE_ORDER_FILE:
                sizes[relative] = path.stat().st_size
    return sizes


def damage(folder: Path) -> Optional[str]:
    """Why the published step folder ``folder`` cannot be loaded whole, or None: a file listed when it was saved
    is missing or has another size, or (a save of an older version, which lists none) its ``.metadata`` is
    missing. Stats only: no file is read, whatever the checkpoint's size."""
    try:
        listed = json.loads((folder / SAVE_ORDER_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    if not isinstance(listed, dict):
        return None if (folder / ".metadata").is_file() else "no .metadata"
    for relative, size in sorted(listed.items()):
        path = folder / relative
        if not path.is_file():
            return f"{relative} is missing"
        if (found := path.stat().st_size) != size:
            return f"{relative} holds {found} of its {size} bytes"
    return None


def _damage_with_companions(root: Path, folder: Path, companions: tuple[str, ...]) -> Optional[str]:
    """``damage`` of ``folder`` or of a companion's save of the same step (which must exist)."""
    if (why := damage(folder)) is not None:
        return why
    for name in companions:
        twin = root / name / folder.name
        why = damage(twin) if twin.is_dir() else "not saved"
        if why is not None:
            return f"{name}: {why}"
    return None


def resumable_checkpoint(ckpt_dir: str | Path, *, companions: tuple[str, ...] = (),
                         warn=print) -> Optional[Path]:
    """The newest checkpoint to resume from: ``latest``, or when it (or a companion's save of the same step,
    ``<ckpt_dir>/<companion>/step_N``) is damaged, the newest undamaged one before it in save order, after one
    ``warn`` line per damaged one. None when there is none at all; a ``ConfigError`` when every one is damaged."""
    root = Path(ckpt_dir)
    newest = latest_checkpoint(root)
    if newest is None:
        return None
    older = [p for p in reversed(complete_checkpoints(root)) if p != newest]
    reasons = []
    for folder in [newest, *older]:
        why = _damage_with_companions(root, folder, companions)
        if why is None:
            return folder
        reasons.append(f"{folder.name} ({why})")
        warn(f"warning: checkpoint {folder} is damaged ({why}); resuming from the one before it")
    from megatron_rl.spec.errors import ConfigError

    raise ConfigError(f"{root}: every checkpoint is damaged ({'; '.join(reasons)}); nothing to resume from. "
                      "Restore one, or start a new run in another run.dir")


def latest_checkpoint(ckpt_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint: the ``latest`` pointer if it names one (or the ``.old-`` copy a
    killed re-save left of it), else the newest saved step folder."""
    root = Path(ckpt_dir)
    name = _pointer_name(root)
    if name is not None and STEP_DIR.match(name.removeprefix(ASIDE_PREFIX)):
        base = name.removeprefix(ASIDE_PREFIX)
        for candidate in (root / base, root / f"{ASIDE_PREFIX}{base}"):
            if candidate.is_dir():
                return candidate
    found = complete_checkpoints(root)
    return found[-1] if found else None


def _pointer_name(root: Path) -> Optional[str]:
    pointer = root / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder from either a step folder or a checkpoint root holding ``latest``."""
    path = Path(path)
    if STEP_DIR.match(path.name) and path.is_dir():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path} holds no complete checkpoint (no step_* folder)")
    return found


_run = {"id": None}


def set_run_id(run_id: Optional[str]) -> None:
    """The id of the run this process belongs to (a fresh start makes one; a resume reads it from the
    checkpoint). Every save records it in ``extra["run_id"]``; ``checkpoint_owner`` reads it back."""
    _run["id"] = run_id


def run_id() -> Optional[str]:
    return _run["id"]


def checkpoint_owner(folder: str | Path) -> Optional[str]:
    """The run id a checkpoint was saved by (None: saved outside a run, or by an older version)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(resolve_checkpoint(folder))).get("extra", {}).get("run_id")


def _local_rank() -> int:
    from megatron_rl.runtime.distributed import read_dist_env

    return read_dist_env().local_rank


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def fault_point(name: str, step: Optional[int]) -> None:
    """Fault injection for the crash tests: ``MEGATRON_RL_FAULT=NAME:STEP`` SIGKILLs this process here."""
    if step is not None and os.environ.get("MEGATRON_RL_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------- durability
def fsync_path(path: str | Path) -> None:
    """Flush one file or folder (its entries) to stable storage."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """fsync every file and folder under ``folder`` (the folder included)."""
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def write_durably(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically and durably: temp file, fsync, rename, fsync of the folder."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


# ---------------------------------------------------------------------------------------------- publishing
def publish_checkpoint(root: Path, tmp: Path, step: int, *, keep_last: int) -> list[Path]:
    """Publish the complete, flushed save in ``tmp`` as ``step_N`` (rank 0 only; no collectives).

    Returns the folders retention retired (renamed to ``.del-``), for ``delete_later`` after the barrier.
    """
    final = root / step_dir_name(step)
    seq = 1 + max((_save_seq(p) for p in complete_checkpoints(root)), default=0)
    write_durably(tmp / SAVE_ORDER_FILE, json.dumps({"step": step, "seq": seq, "saved_at": time.time(),
                                                     "files": _file_sizes(tmp)}) + "\n")
    doomed = []
    if final.exists():  # a re-save: the old copy stays whole, aside, until the new one is published
        aside = root / f"{ASIDE_PREFIX}{final.name}"
        if aside.exists():
            doomed.append(_retire(aside))
        os.replace(final, aside)
        fsync_path(root)
        fault_point("kill-during-resave", step)
        doomed.append(aside)
    os.replace(tmp, final)
    fsync_path(root)
    write_durably(root / "latest", final.name + "\n")
    ordered = complete_checkpoints(root)
    keep = set(ordered[-keep_last:]) | {final, latest_checkpoint(root)}
    doomed += [p for p in ordered if p not in keep]
    return [_retire(p) for p in doomed]


def _retire(folder: Path) -> Path:
    """Rename ``folder`` to a unique ``.del-`` name (fast), so a half-done delete never looks like a checkpoint."""
    if folder.name.startswith(DELETE_PREFIX):
        return folder
    target = folder.with_name(f"{DELETE_PREFIX}{folder.name.lstrip('.')}-{time.time_ns()}")
    os.replace(folder, target)
    return target


_deleters: list[threading.Thread] = []


def delete_later(folders: list[Path], *, step: Optional[int] = None) -> None:
    """Delete retired folders in a background thread (rank 0's long I/O stays out of every collective)."""
    if folders:
        fsync_path(folders[0].parent)
        thread = threading.Thread(target=_delete_all, args=(folders, step), name="checkpoint-delete")
        thread.start()
        _deleters[:] = [t for t in _deleters if t.is_alive()] + [thread]


def _delete_all(folders: list[Path], step: Optional[int]) -> None:
    for folder in folders:
        if os.environ.get("MEGATRON_RL_FAULT") == f"kill-during-retention:{step}":
            first = next((os.path.join(d, f[0]) for d, _, f in os.walk(folder) if f), None)
            if first is not None:
                os.remove(first)  # half-deleted, then killed
            fault_point("kill-during-retention", step)
        shutil.rmtree(folder, ignore_errors=True)


def wait_for_deletes() -> None:
    """Join the background deletes (tests; the interpreter also waits for them at exit)."""
    while _deleters:
        _deleters.pop().join()


def recover_latest(root: Path) -> None:
    """After a crash inside a re-save, make ``latest`` name a ``step_N`` folder again (rank 0 only)."""
    name = _pointer_name(root)
    if name is None:
        return
    base = name.removeprefix(ASIDE_PREFIX)
    aside = root / f"{ASIDE_PREFIX}{base}"
    if not (root / base).is_dir() and aside.is_dir():
        os.replace(aside, root / base)
        fsync_path(root)
    if name != base and (root / base).is_dir():
        write_durably(root / "latest", base + "\n")


def remove_partial_saves(ckpt_dir: str | Path) -> None:
    """Recover ``latest`` after a crash, then delete the ``.tmp-``, ``.old-`` and ``.del-`` folders a killed
    save or delete left (rank 0; the deletes run in the background after the barrier)."""
    root = Path(ckpt_dir)
    doomed = []
    if _rank() == 0 and root.is_dir():
        recover_latest(root)
        (root / ".latest.tmp").unlink(missing_ok=True)
        doomed = [_retire(p) for p in root.iterdir()
                  if p.is_dir() and p.name.startswith((TMP_PREFIX, ASIDE_PREFIX, DELETE_PREFIX))]
    _barrier()
    delete_later(doomed)


def layout_signature() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1}


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Leave the CPU/CUDA generators and Megatron's RNG tracker as they were (building weights draws from them)."""
    import torch
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    cpu_state, tracker_states = torch.get_rng_state(), tracker.get_states()
    cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        tracker.set_states(tracker_states)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def checkpoint_tensor_keys(folder: str | Path) -> set[str]:
    """Global tensor and object keys stored in one of our checkpoints (step folder or root with ``latest``)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(resolve_checkpoint(folder))).read_metadata()
    return {key.split("/shard_")[0] for key in metadata.state_dict_metadata}  # objects are stored per shard


def _model_sharded_state_dict(chunks: list) -> dict:
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def _adapters_not_stored(folder: Path, model_sd: dict) -> set[str]:
    """State-dict names of the LoRA adapter matrices in ``model_sd`` that ``folder`` does not store."""
    from megatron_rl.models.lora import is_adapter_key

    names = {name: item.key for sd in model_sd.values() for name, item in sd.items() if is_adapter_key(name)}
    if not names:
        return set()
    stored = checkpoint_tensor_keys(folder)
    return {name for name, key in names.items() if key not in stored}


def _rng_sharded_object(state: Any):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return ShardedObject("rng_state", state, (world,), (_rank(),), replica_id=0)


def _in_process_write_results() -> None:
    """Megatron's torch_dist writer hands its write results over a queue of a multiprocessing Manager, started
    with 'spawn' at a process's first save: a new interpreter that imports the job (~2 s per rank on CPU). Our saves
    are synchronous, written by this process's own threads, so an in-process queue carries the results as well."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


_WRITE_ERRORS: list[BaseException] = []
"""This process's failed writes in the save under way: the OS's error naming the file (``_keep_write_errors``)."""


def _keep_write_errors() -> None:
    """Hand the OS's error of a failed write, with the file's path, to Megatron's gather of write results. Its writer
    keeps only the exception's type ("An error is caught while starting worker 0, error: <class 'RuntimeError'>"),
    and torch's stream writer turns the ``OSError`` into a RuntimeError besides; so the error is caught where the
    file is written and stands in for that text in the rank's result: the coordinating rank's failures then name
    each failed rank's own cause (ENOSPC, EDQUOT, EFBIG, EACCES ...) and file."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from torch.distributed.checkpoint.api import _is_wrapped_exception, _wrap_exception

    if getattr(FileSystemWriterAsync, "_keeps_write_errors", False):
        return
    write, retrieve = FileSystemWriterAsync.write_preloaded_data, FileSystemWriterAsync.retrieve_write_results

    def write_preloaded_data(*args, **kwargs):
        output = write(*args, **kwargs)
        if output is not None and isinstance(output[1], BaseException):  # (worker index, what it raised)
            bucket = kwargs.get("write_bucket") or args[2]
            _WRITE_ERRORS.append(_with_path(_os_error(output[1]), bucket[0]))
        return output

    def retrieve_write_results(self):
        results = retrieve(self)
        if _is_wrapped_exception(results) and _WRITE_ERRORS:
            return _wrap_exception(_WRITE_ERRORS[0])
        return results

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)
    FileSystemWriterAsync.retrieve_write_results = retrieve_write_results
    FileSystemWriterAsync._keeps_write_errors = True
    # its own notices of the failure say only the type; the save's error line says the cause
    logging.getLogger(FileSystemWriterAsync.__module__).addFilter(
        lambda record: not record.getMessage().startswith(("Local worker ", "An error is caught while starting")))


def _os_error(exc: BaseException) -> BaseException:
    """The ``OSError`` behind ``exc`` (itself, its cause or context, at any depth), else ``exc``."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return exc


def _with_path(exc: BaseException, path: str) -> BaseException:
    """``exc`` naming the file ``path`` when it is an OSError that names none (a write or fsync's error)."""
    if not isinstance(exc, OSError) or exc.filename is not None or exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror, path).with_traceback(exc.__traceback__)


def save_checkpoint(ckpt_dir: str | Path, *, step: int, chunks: list, optimizer=None, scheduler=None,
                    extra: Optional[dict] = None, keep_last: int = 2, save_optimizer: bool = True,
                    sharded_strategy=None) -> Path:
    """Save a checkpoint of ``step`` and publish it atomically; returns the published folder.
    ``sharded_strategy``: Megatron's save strategy for the tensors (default its torch_dist one; the streaming
    import passes one that reads each shard from the Hugging Face files as it is written)."""
    from megatron.core import dist_checkpointing

    root = Path(ckpt_dir)
    final = root / step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    model_sd = _model_sharded_state_dict(chunks)
    extra = {"run_id": run_id(), **(extra or {})} if run_id() is not None else (extra or {})
    from megatron_rl.models.lora import adapter_settings

    lora = adapter_settings(chunks)
    if lora is not None:  # the exports need alpha (and the PEFT config the rest)
        extra = {**extra, "lora": lora}
    state: dict[str, Any] = {**model_sd, "step": step, "layout": layout_signature(), "extra": extra,
                             "rng_state": _rng_sharded_object(_rng_state())}
    if optimizer is not None and save_optimizer:
        _allocate_optimizer_state(optimizer)  # a never-stepped one (PPO's policy while the critic warms up)
        _align_reshardable_state_with_parameters()
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    from torch.distributed.checkpoint.api import CheckpointException

    _in_process_write_results()
    _keep_write_errors()
    try:
        dist_checkpointing.save(state, str(tmp), sharded_strategy=sharded_strategy)
        if _local_rank() == 0:
            fsync_tree(tmp)  # one rank per node flushes what that node's ranks wrote (shared page cache)
    except CheckpointException as exc:  # Megatron raises a write failure on every rank (its broadcast)
        raise _save_failed(root, tmp, step, *_agreed_cause(exc)) from None
    except OSError as exc:  # this rank's own (its node's fsync)
        raise _save_failed(root, tmp, step, f"rank {_rank()}: {_describe(exc)}", exc.errno) from None
    finally:
        _WRITE_ERRORS.clear()
    _barrier()
    fault_point("kill-during-save", step)
    doomed = publish_checkpoint(root, tmp, step, keep_last=keep_last) if _rank() == 0 else []
    _barrier()
    delete_later(doomed, step=step)
    return final


_SAVE_FIXES = {errno.ENOSPC: "Free space there", errno.EDQUOT: "Free space there or raise your disk quota",
               errno.EFBIG: "Raise the file-size limit (ulimit -f)", errno.EACCES: "Make it writable",
               errno.EPERM: "Make it writable", errno.EROFS: "Mount it writable"}
"""What frees a save that failed with each errno; others get ``Fix the cause``."""


def _agreed_cause(exc: BaseException) -> tuple[str, Optional[int]]:
    """What failed a save that Megatron refused on every rank, the same on each: the failed ranks and the first one's
    error (the coordinating rank, the only one holding every rank's failure, tells the others), and its errno."""
    import torch

    from megatron_rl.runtime.distributed import collective_device

    failures = getattr(exc, "failures", None) or {}  # Megatron's CheckpointException: {rank: (exception, traceback)}
    if failures:
        rank, (inner, _) = min(failures.items())
        inner = _os_error(inner)
        others = sorted(failures)[1:]
        also = f"; {'ranks' if len(others) > 1 else 'rank'} {', '.join(map(str, others))} failed too" if others else ""
        cause = (f"rank {rank}: {_describe(inner)}{also}", getattr(inner, "errno", None))
    else:
        cause = ("a write failed on another rank", None)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        agreed = [cause]
        # the save's group is the world, coordinated by rank 0
        torch.distributed.broadcast_object_list(agreed, src=0, device=collective_device())
        cause = agreed[0]
    return cause


def _describe(exc: BaseException) -> str:
    """An OS error as its text, errno name and file ("No space left on device (ENOSPC) writing PATH"); another
    exception's first line."""
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
        return f"{exc.strerror or os.strerror(exc.errno)} ({name})" + (f" writing {exc.filename}" if exc.filename
                                                                         else "")
    return _first_line(exc)


def _save_failed(root: Path, tmp: Path, step: int, cause: str, code: Optional[int]):
    """The one-line error of a save that could not be written (a full disk, a quota or file-size limit, a folder
    not writable), after rank 0 removed the partial save (freeing its space): the published checkpoints and
    ``latest`` are untouched. ``cause``: the failed rank and its error; ``code``: that error's errno (None: not
    the OS's)."""
    from megatron_rl.spec.errors import ConfigError

    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    fix = _SAVE_FIXES.get(code, "Fix the cause")
    return ConfigError(f"checkpoint.dir {root}: saving step {step} failed ({cause}); the checkpoints saved before "
                       f"are untouched. {fix} (or set checkpoint.dir elsewhere) and rerun to resume")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_checkpoint(path: str | Path, *, chunks: list, optimizer=None, scheduler=None,
                    load_optimizer: bool = True, load_rng: bool = True) -> dict[str, Any]:
    """Load model (and optimizer, scheduler, RNG when present and compatible) from a step folder. ``load_rng``
    false: leave this process's random state alone (a frozen model of another run).

    Returns ``{"step": int, "extra": dict, "layout_changed": bool}``.
    """
    from megatron.core import dist_checkpointing

    folder = resolve_checkpoint(path)
    common = dist_checkpointing.load_common_state_dict(str(folder))
    same_layout = common.get("layout") == layout_signature()
    model_sd = _model_sharded_state_dict(chunks)
    stored_lora = (common.get("extra") or {}).get("lora")
    from megatron_rl.models.lora import is_adapter_key

    if stored_lora and not any(is_adapter_key(name) for sd in model_sd.values() for name in sd):
        from megatron_rl.spec.errors import ConfigError

        raise ConfigError(f"checkpoint {folder} holds LoRA adapters (model.lora={stored_lora}); set the same "
                          "model.lora to load it, or export it merged (launch.py convert megatron-to-hf)")
    request: dict[str, Any] = dict(model_sd)
    new_adapters = _adapters_not_stored(folder, model_sd)
    if new_adapters:  # LoRA started from a base checkpoint: the adapters keep their initialisation
        request.update({part: {k: v for k, v in sd.items() if k not in new_adapters} for part, sd in model_sd.items()})
    if optimizer is not None and load_optimizer and "optimizer" in common:
        _allocate_optimizer_state(optimizer)
        _skip_step_in_reshardable_load()
        _align_reshardable_state_with_parameters()
        request["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIMIZER_METADATA)
    if same_layout and load_rng:
        request["rng_state"] = _rng_sharded_object(None)
    loaded = dist_checkpointing.load(request, str(folder))
    for i, chunk in enumerate(chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=not new_adapters)
        if set(missing) - new_adapters or unexpected:
            raise RuntimeError(f"loading {folder}: missing {sorted(set(missing) - new_adapters)}, "
                               f"unexpected {unexpected}")
    if "optimizer" in request:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    if scheduler is not None and "scheduler" in common:
        scheduler.load_state_dict(common["scheduler"])
    if "rng_state" in request and loaded.get("rng_state") is not None:
        _set_rng_state(loaded["rng_state"])
    return {"step": int(common["step"]), "extra": common.get("extra", {}), "layout_changed": not same_layout,
            "folder": folder}



def _allocate_optimizer_state(optimizer) -> None:
    """Give a fresh torch Adam its (zero) state, as a first step would (a no-op once it has stepped).

    Without Apex/TE, Megatron's distributed optimizer reads the step count from the torch optimizer's
    per-parameter state when building the loading state dict, and a never-stepped optimizer has none.
    """
    import torch

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param.data)
                    state["exp_avg_sq"] = torch.zeros_like(param.data)


def _align_reshardable_state_with_parameters() -> None:
    """Make Megatron's fully_reshardable save cut each parameter's optimizer state where it lies.

    megatron-core 0.19.2 gathers a buffer's state with the padding after each bucket dropped, then cuts every
    parameter out of it at its offset in the padded buffer (``param_index_map``). Every parameter after a bucket
    that ended in padding was saved shifted by that padding (64 elements where a tied embedding or the 40M-element
    buckets of ``overlap_grad_reduce`` split the buffer), the last one zero-filled with the warning "param range
    exceeds unpadded buffer ... data corruption" (Megatron-LM issue #504), and a resume loaded the shifted copies
    as weights and moments. Here the gathered state gets its padding back, so both offsets agree; loading was
    already right (it cuts each parameter's own tensor by its own range).
    """
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_param_state_fully_reshardable
    if getattr(original, "_aligned", False):
        return

    def padded_like_the_buffers(self, gather):
        def gathered(*args, **kwargs):
            state = gather(*args, **kwargs)
            for gbuf_idx, by_dtype in (state or {}).items():
                if not isinstance(gbuf_idx, int):  # "buckets_coalesced"
                    continue
                buffer = self.buffers[gbuf_idx]
                for world in by_dtype.values():
                    for key in [k for k in world if k != "numel_unpadded"]:
                        padded = torch.zeros(buffer.numel, dtype=world[key].dtype, device=world[key].device)
                        start = 0
                        for bucket in buffer.buckets:
                            padded[bucket.offset:bucket.offset + bucket.numel_unpadded] = \
                                world[key][start:start + bucket.numel_unpadded]
                            start += bucket.numel_unpadded
                        world[key] = padded
            return state
        return gathered

    def sharded_state(self, *args, **kwargs):
        self.get_parameter_state_dp_zero = padded_like_the_buffers(self, self.get_parameter_state_dp_zero)
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.get_parameter_state_dp_zero  # the class's method again

    sharded_state._aligned = True
    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded_state


def _skip_step_in_reshardable_load() -> None:
    """Let Megatron's fully_reshardable load work with torch's Adam (no Apex/TE), whose state holds "step".

    megatron-core 0.16.1 copies every key of the per-parameter state from the checkpoint tensors, which
    hold only param/exp_avg/exp_avg_sq; the step is restored from the param groups instead.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_skips_step", False):
        return

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    set_states._skips_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam step tensor after a load.

    Without Apex/TE, megatron-core 0.16.1 puts ONE step tensor into every parameter's state; torch's Adam
    then increments it once per parameter per step and the bias correction goes wrong after a resume.
    """
    import torch

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in sub.optimizer.state.values():
            if "step" in state and torch.is_tensor(state["step"]):
                state["step"] = state["step"].clone()
