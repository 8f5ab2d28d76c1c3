"""Weight sync for split-placement GRPO (``algorithm.weight_sync``): the trainer publishes each new policy
version, the rollout workers pick up the newest, and (over files) their samples come back the same way.

``WeightPublisher.publish(version, state_dict)`` (trainer side) and ``WeightSubscriber.poll()`` (rollout side)
are the interface; each returns the bytes and seconds of the sync (``weight_sync_bytes``, ``weight_sync_s``),
the metrics the trainer logs per step.

files (``FileWeightPublisher`` / ``FileWeightSubscriber``), for ranks that share only a folder::

    <folder>/weights/v00000007/rank00000.safetensors   one file per trainer rank that holds weights
    <folder>/weights/v00000007/COMPLETE                json: version, shard files, bytes; written before the rename
    <folder>/weights/latest                            names the newest version folder, rewritten after it
    <folder>/weights/.tmp-v00000008/                   a version being written (or left by a killed writer)
    <folder>/samples/<time_ns>-<worker>.pt             one batch of samples from a rollout worker
    <folder>/samples/.<name>.tmp                       a batch being written

A version is written into ``.tmp-v<version>/`` (each shard to a temporary name, fsync, rename), then rank 0
writes ``COMPLETE``, fsyncs the folder and renames it to ``v<version>`` (fsync of the parent): a ``v`` folder
is complete whenever it is visible, so a reader never sees a partial version. The next publish removes
``.tmp-`` folders that a killed writer left; the newest ``keep_last`` versions are kept, and versions newer than
the one published (left by a trainer that has resumed from an older checkpoint) are removed. A subscriber loads
the newest version whenever it is not the copy it loaded last (the id in ``COMPLETE``), so it follows such a
rollback too. Samples are written the same way (temporary dot-name, fsync, rename) and deleted by the trainer
once read; they are loaded with ``torch.load(weights_only=True)``, so a sample file can hold tensors, lists,
dicts, strings and numbers (``rollout_rows``) but no code. Folders are 0700 and files 0600 (``megatron_rl.spec.private``).

gloo and nccl (``BroadcastWeightPublisher`` / ``BroadcastWeightSubscriber``): broadcasts over a process group of
the trainer's source rank and the rollout ranks: a JSON header (kind, version, names, dtypes, shapes, bucket
size), then the tensors' bytes in buckets of at most ``bucket_bytes`` (a larger tensor alone), staged on the CPU for
gloo, on the GPU for nccl (the group's ``collective_device``). Both sides call in step (``poll`` blocks until the
next ``publish``).

Used by split-placement GRPO through ``megatron_rl.rollout.channel``: the broadcast classes there run over a
standalone ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` that bridges the trainers' and the rollout workers' worlds,
which is why the broadcasts use the process group's own API (``_group_broadcast``) rather than torch.distributed's
functions.

Test: ``.venv/bin/python -m pytest tests/test_weight_sync.py -q``
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_rl.rollout.buffer import Sample
from megatron_rl.runtime.checkpoint import fault_point, fsync_path
from megatron_rl.runtime.distributed import collective_device, read_dist_env
from megatron_rl.spec.private import DIR_MODE, FILE_MODE, make_private_dir, write_private_text

VERSION_DIR = re.compile(r"^v(\d{8})$")
TMP_PREFIX = ".tmp-"
DELETE_PREFIX = ".del-"
COMPLETE = "COMPLETE"
BUCKET_BYTES = 512 * 2**20
"""The most bytes one gloo or nccl broadcast of a version carries (``algorithm.weight_sync_bucket_mib``)."""


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


def shard_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


@dataclass
class Received:
    """A policy version a subscriber loaded: its tensors and the sync's metrics."""

    version: int
    state_dict: dict[str, torch.Tensor]
    metrics: dict[str, float]
    kind: str = "weights"
    """weights, or over gloo also base (the tensors training never changes, sent once) or stop (the end)."""


class WeightPublisher(ABC):
    """Trainer side of a weight sync."""

    @abstractmethod
    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> dict[str, float]:
        """Send ``state_dict`` as policy ``version``; returns {weight_sync_bytes, weight_sync_s}."""


class WeightSubscriber(ABC):
    """Rollout side of a weight sync."""

    @abstractmethod
    def poll(self) -> Optional[Received]:
        """The newest version not loaded yet, or None when there is none."""


def _sync_metrics(nbytes: int, start: float) -> dict[str, float]:
    return {"weight_sync_bytes": nbytes, "weight_sync_s": time.perf_counter() - start}


def _cpu_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The CPU staging copy (no copy for tensors on the CPU already)."""
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in state_dict.items()}


def _write_atomically(path: Path, write: Callable[[Path], None]) -> int:
    """``write(tmp)`` a file beside ``path``, make it 0600, fsync it and rename it to ``path``; returns its size."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, FILE_MODE)
        fsync_path(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _remove(folder: Path) -> None:
    """Rename ``folder`` to a ``.del-`` name (so it never looks like a version), then delete it."""
    doomed = folder.with_name(f"{DELETE_PREFIX}{folder.name.lstrip('.')}-{os.getpid()}-{time.time_ns()}")
    try:
        os.replace(folder, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


class FileWeightPublisher(WeightPublisher):
    """Writes versions to ``<folder>/weights`` and reads the rollout workers' samples from ``<folder>/samples``.

    Sharded: every trainer rank that holds weights calls ``write_shard(version, its tensors)``, and rank 0 then
    ``commit(version)``, which waits for all ``num_shards`` shards; ``publish`` does both for one shard."""

    def __init__(self, folder: str | Path, *, keep_last: int = 2, rank: int = 0, num_shards: int = 1) -> None:
        if keep_last < 1 or not 0 <= rank < num_shards:
            raise ValueError(f"keep_last={keep_last} must be >= 1 and rank={rank} in [0, num_shards={num_shards})")
        self.folder = Path(folder)
        self.weights = make_private_dir(self.folder / "weights")
        self.samples = self.folder / "samples"
        self.keep_last, self.rank, self.num_shards = keep_last, rank, num_shards

    def _tmp_dir(self, version: int) -> Path:
        return self.weights / f"{TMP_PREFIX}{version_dir_name(version)}"

    def write_shard(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Write this rank's tensors of ``version``; returns the bytes written."""
        from safetensors.torch import save_file

        if self.rank == 0:
            self._remove_partial(keep=version if self.num_shards > 1 else None)
        tmp = self._tmp_dir(version)
        try:
            os.mkdir(tmp, DIR_MODE)
        except FileExistsError:
            pass
        tensors = _cpu_tensors(state_dict)
        return _write_atomically(tmp / shard_file_name(self.rank),
                                 lambda path: save_file(tensors, str(path), metadata={"version": str(version)}))

    def commit(self, version: int, *, timeout_s: float = 600.0) -> None:
        """Rank 0: once every shard of ``version`` is written, mark it COMPLETE and publish it under its name."""
        if self.rank != 0:
            raise ValueError("commit is rank 0's (the other ranks only write_shard)")
        tmp = self._tmp_dir(version)
        shards = [shard_file_name(r) for r in range(self.num_shards)]
        deadline = time.monotonic() + timeout_s
        while not all((tmp / name).exists() for name in shards):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tmp}: not every one of the {self.num_shards} shards came in {timeout_s} s")
            time.sleep(0.01)
        fault_point("kill-during-weight-publish", version)
        nbytes = sum((tmp / name).stat().st_size for name in shards)
        write_private_text(tmp / COMPLETE, json.dumps({"version": version, "shards": shards, "bytes": nbytes,
                                                       "id": f"{time.time_ns()}-{os.getpid()}"}) + "\n")
        fsync_path(tmp)
        final = self.weights / version_dir_name(version)
        if final.exists():  # published again (a resumed trainer): the old copy goes first
            _remove(final)
        os.replace(tmp, final)
        fsync_path(self.weights)
        write_private_text(self.weights / "latest", final.name + "\n")
        versions = complete_versions(self.weights)
        rolled_back = [v for v in versions if v > version]  # published before the trainer resumed from older
        for old in [*rolled_back, *[v for v in versions if v <= version][:-self.keep_last]]:
            _remove(self.weights / version_dir_name(old))

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> dict[str, float]:
        if self.num_shards != 1:
            raise ValueError(f"publish writes one shard; with num_shards={self.num_shards} every rank calls "
                             "write_shard and rank 0 commit")
        start = time.perf_counter()
        nbytes = self.write_shard(version, state_dict)
        self.commit(version)
        return _sync_metrics(nbytes, start)

    def _remove_partial(self, *, keep: Optional[int]) -> None:
        """Remove ``.tmp-`` versions a killed writer left (all but ``keep``, which other ranks may be writing)."""
        kept = None if keep is None else self._tmp_dir(keep).name
        for entry in self.weights.iterdir():
            if entry.name.startswith(DELETE_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(TMP_PREFIX) and entry.name != kept:
                _remove(entry)

    def take_samples(self) -> tuple[list[Sample], dict[str, float]]:
        """Every sample batch the rollout workers published (oldest first), deleted once read; with
        {sample_sync_bytes, sample_sync_s} and the sums of the batches' ``stats``."""
        start, nbytes, samples = time.perf_counter(), 0, []
        stats: dict[str, float] = {}
        for path in sorted(p for p in self.samples.iterdir() if not p.name.startswith(".")) \
                if self.samples.is_dir() else ():
            nbytes += path.stat().st_size
            batch = torch.load(path, weights_only=True)
            samples += [Sample(**row) for row in batch["samples"]]
            for key, value in batch["stats"].items():
                stats[key] = stats.get(key, 0.0) + value
            path.unlink()
        return samples, {**stats, "sample_sync_bytes": nbytes, "sample_sync_s": time.perf_counter() - start}

    def clear_samples(self) -> None:
        """Delete every sample file (a new session starts: what an earlier attempt left is not this one's)."""
        for path in self.samples.iterdir() if self.samples.is_dir() else ():
            if path.is_file():
                path.unlink(missing_ok=True)


def complete_versions(weights: Path) -> list[int]:
    """The versions in ``weights`` (a ``<folder>/weights``) marked COMPLETE, oldest first."""
    found = []
    for entry in weights.iterdir() if weights.is_dir() else ():
        match = VERSION_DIR.match(entry.name)
        if match and (entry / COMPLETE).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


class FileWeightSubscriber(WeightSubscriber):
    """Loads the newest complete version from ``<folder>/weights`` and publishes samples to
    ``<folder>/samples`` under the name ``worker``."""

    def __init__(self, folder: str | Path, *, worker: str = "rollout0", shard: Optional[int] = None) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_]+", worker):
            raise ValueError(f"worker={worker!r}: use letters, digits and _ only")
        self.folder, self.worker, self.shard = Path(folder), worker, shard
        """``shard``: load only that trainer shard of each version (a rollout rank of the trainers' tp x pp layout
        takes its own); None: every shard, merged."""
        self.weights, self.samples = self.folder / "weights", self.folder / "samples"
        self.version: Optional[int] = None
        """The version loaded last."""
        self.loaded_id: Optional[str] = None

    def poll(self) -> Optional[Received]:
        for _ in range(3):  # the publisher's retention may remove a version while it is read
            newest = self.newest()
            if newest is None or newest[1] == self.loaded_id:
                return None
            try:
                return self.load(*newest)
            except FileNotFoundError:
                continue
        return None

    def newest(self) -> Optional[tuple[int, str]]:
        """(version, copy id) of the newest complete version, or None (several readers that must load the same
        version agree on this first, then each ``load`` it)."""
        for _ in range(3):
            versions = complete_versions(self.weights)
            if not versions:
                return None
            try:
                complete = json.loads((self.weights / version_dir_name(versions[-1]) / COMPLETE).read_text())
            except FileNotFoundError:
                continue
            return versions[-1], complete["id"]
        return None

    def load(self, version: int, copy_id: str) -> Received:
        """Read version ``version`` (its copy ``copy_id``); FileNotFoundError when it is gone or replaced."""
        from safetensors.torch import load

        start = time.perf_counter()
        folder = self.weights / version_dir_name(version)
        complete = json.loads((folder / COMPLETE).read_text())
        if complete["id"] != copy_id:
            raise FileNotFoundError(f"{folder}: copy {copy_id} was replaced")
        names = complete["shards"] if self.shard is None else [shard_file_name(self.shard)]
        state_dict, nbytes = {}, 0
        for name in names:
            with open(folder / name, "rb") as handle:  # once open, a retention delete cannot cut it
                data = handle.read()
            nbytes += len(data)
            state_dict.update(load(data))
        self.version, self.loaded_id = version, copy_id
        return Received(version=version, state_dict=state_dict, metrics=_sync_metrics(nbytes, start))

    def publish_samples(self, samples: list[Sample], stats: Optional[dict[str, float]] = None) -> dict[str, float]:
        """Write ``samples`` as one batch file for the trainer, with the worker's ``stats`` (numbers the trainer
        sums, e.g. generate and idle seconds); returns {sample_sync_bytes, sample_sync_s}."""
        start = time.perf_counter()
        make_private_dir(self.samples)
        rows = [{"prompt_id": s.prompt_id, "version": s.version, "payload": s.payload} for s in samples]
        path = self.samples / f"{time.time_ns():020d}-{self.worker}.pt"
        batch = {"samples": rows, "stats": {k: float(v) for k, v in (stats or {}).items()}}
        nbytes = _write_atomically(path, lambda tmp: torch.save(batch, tmp))
        return {"sample_sync_bytes": nbytes, "sample_sync_s": time.perf_counter() - start}


# ------------------------------------------------------------------------------------------------ gloo and nccl
def _group_broadcast(group: Any, tensor: torch.Tensor, root: int) -> None:
    """Broadcast ``tensor`` in place from group rank ``root``, with the process group's own API: it works on a
    group of this process's world (``new_group``) and on a standalone ``ProcessGroupGloo`` bridging two worlds."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root, 0
    group.broadcast([tensor], options).wait()


def _buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """The tensors (their byte ``sizes``, in order) grouped into consecutive runs of at most ``bucket_bytes``, one
    broadcast each; a tensor larger than that travels alone. The sender and the receivers find the same from the
    header's layout and bucket size."""
    buckets: list[list[int]] = []
    filled = 0
    for i, size in enumerate(sizes):
        if not buckets or filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += size
    return buckets


def _broadcast_state(state_dict: Optional[dict[str, torch.Tensor]], version: Optional[int], *, src: int,
                     group: Any, kind: str = "weights", device: torch.device | str = "cpu",
                     bucket_bytes: int = BUCKET_BYTES) -> tuple[str, int, dict[str, torch.Tensor], int]:
    """Broadcast (kind, version, tensors) from group rank ``src`` over ``group``: a JSON header (names, dtypes,
    shapes and the sender's ``bucket_bytes``), then the tensors' bytes in buckets of at most ``bucket_bytes`` (a
    larger tensor alone, straight from its own storage), on ``device`` (cpu: staged for gloo; cuda: in place for
    nccl). The sender's extra memory is one bucket, not a copy of the whole shard. Returns (kind, version,
    tensors, bytes of the tensors) on every rank: the sender's own tensors, the receivers' on ``device``."""
    sending = state_dict is not None
    if sending:
        header = json.dumps({"kind": kind, "version": version, "bucket_bytes": bucket_bytes,
                             "layout": [(name, str(t.dtype).removeprefix("torch."), list(t.shape))
                                        for name, t in state_dict.items()]}).encode()
    length = torch.tensor([len(header) if sending else 0], dtype=torch.int64, device=device)
    _group_broadcast(group, length, src)
    raw = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device) if sending \
        else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    _group_broadcast(group, raw, src)
    meta = json.loads(raw.cpu().numpy().tobytes())
    layout = meta["layout"]
    sizes = [torch.Size(shape).numel() * getattr(torch, dtype).itemsize for _, dtype, shape in layout]
    if sending:
        tensors = state_dict
        sent = list(state_dict.values())

        def as_bytes(i: int) -> torch.Tensor:  # on ``device``, copied only when it is elsewhere or not contiguous
            return sent[i].detach().to(device).contiguous().reshape(-1).view(torch.uint8)
    else:
        tensors = {name: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                   for name, dtype, shape in layout}
        as_bytes = [t.view(-1).view(torch.uint8) for t in tensors.values()].__getitem__  # views: received in place
    buckets = _buckets(sizes, meta["bucket_bytes"])
    staging = torch.empty(max((sum(sizes[i] for i in b) for b in buckets if len(b) > 1), default=0),
                          dtype=torch.uint8, device=device)
    for bucket in buckets:
        total = sum(sizes[i] for i in bucket)
        if total == 0:
            continue
        if len(bucket) == 1:  # alone: from and into the tensor's own bytes
            _group_broadcast(group, as_bytes(bucket[0]), src)
            continue
        buffer = staging[:total]
        if sending:
            torch.cat([as_bytes(i) for i in bucket], out=buffer)
        _group_broadcast(group, buffer, src)
        if not sending:
            for i, part in zip(bucket, torch.split(buffer, [sizes[i] for i in bucket])):
                as_bytes(i).copy_(part)
    return meta["kind"], meta["version"], tensors, sum(sizes)


class BroadcastWeightPublisher(WeightPublisher):
    """Broadcasts each version from this rank (group rank ``src``) over ``group``, in buckets of at most
    ``bucket_bytes``: gloo with the tensors staged on the CPU, or nccl straight from the GPU (``device``: the
    group's ``collective_device`` unless given)."""

    def __init__(self, group: Any, *, src: int = 0, device: Optional[torch.device | str] = None,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
        self.group, self.src, self.bucket_bytes = group, src, bucket_bytes
        self.device = collective_device(group) if device is None else torch.device(device)

    def publish(self, version: int, state_dict: dict[str, torch.Tensor], *, kind: str = "weights") -> dict[str, float]:
        """Send ``state_dict`` as ``version`` of ``kind`` (weights; base: the tensors that never change; stop: no
        tensors, the subscribers end); returns {weight_sync_bytes, weight_sync_s}."""
        start = time.perf_counter()
        *_, nbytes = _broadcast_state(state_dict, version, src=self.src, group=self.group, kind=kind,
                                      device=self.device, bucket_bytes=self.bucket_bytes)
        return _sync_metrics(nbytes, start)


class BroadcastWeightSubscriber(WeightSubscriber):
    """Receives each version broadcast from group rank ``src`` over ``group`` onto ``device`` (the group's
    ``collective_device`` unless given); ``poll`` blocks until the publisher's next ``publish`` (run it in a
    thread to receive while generating: on a GPU under ``receiving_stream``)."""

    def __init__(self, group: Any, *, src: int = 0, device: Optional[torch.device | str] = None) -> None:
        self.group, self.src = group, src
        self.device = collective_device(group) if device is None else torch.device(device)
        self.version: Optional[int] = None

    def poll(self) -> Optional[Received]:
        start = time.perf_counter()
        kind, version, state_dict, nbytes = _broadcast_state(None, None, src=self.src, group=self.group,
                                                             device=self.device)
        if self.device.type != "cpu":  # the receiving stream's copies are done before another thread reads them
            torch.cuda.current_stream().synchronize()
        if kind == "weights":
            self.version = version
        return Received(version=version, state_dict=state_dict, metrics=_sync_metrics(nbytes, start), kind=kind)


@contextlib.contextmanager
def receiving_stream(device: torch.device | str) -> Iterator[None]:
    """Run a receiving thread's broadcasts (``BroadcastWeightSubscriber.poll``) on a CUDA stream of its own when
    ``device`` is a GPU, made here, in the thread, once the thread is on that GPU (a new thread starts on device
    0). On the default stream, NCCL's ``work.wait()`` of the broadcast posted for the next version would queue
    every generation kernel behind it, and the trainer sends that version only once it has the samples those
    kernels make: a deadlock. ``poll`` synchronises this stream before it hands its tensors over."""
    device = torch.device(device)
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_device(read_dist_env().local_rank if device.index is None else device.index)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        yield
