"""The trainer <-> rollout-worker channel of split placement: weights one way, prompt orders one way, samples
back. Orders and samples always travel through the run folder (they are small, and the run folder is shared by
every node of a job anyway, for checkpoints); weights through it too (``algorithm.weight_sync=files``, for ranks
that share only a folder) or over gloo or nccl (``WeightBridge``: a process group bridging the two worlds per weight
shard; the workers receive on a thread, ``BroadcastWeights``).

    run.dir/rollout/weights/v00000007/...        the policy after 7 GRPO steps (megatron_rl.rollout.weight_sync)
    run.dir/rollout/base/weights/v00000000/...   what never changes (a LoRA base, buffers): once per session
    run.dir/rollout/samples/*.pt                 generated samples, version-tagged, deleted once read
    run.dir/rollout/sessions/<session>/orders/00000012.json   prompts to generate, in order
    run.dir/rollout/sessions/<session>/stop                   the trainer is done: {"exit_code": 0 | 3}

Weights are sharded like the trainers' layout: every trainer rank of data-parallel (and context-parallel) rank 0
writes (files) or broadcasts (gloo) its tp x pp shard (``shard_index``), trainer rank 0 commits a files version,
and the rollout ranks of the same (tp, pp) coordinate take that shard. Rollout replicas at another tp x pp
(parallel.rollout_tp / rollout_pp) get each version as a distributed checkpoint instead (``ReshardedWeights``),
which Megatron reshards to their layout as it loads. All rollout ranks load the same version: the rollout world's
rank 0 picks it and tells the others. Orders and the stop file belong to one session (``placement.session_id``): a trainer
that starts removes the other sessions and the samples left behind, and publishes its weights before its
first order, so a worker never mixes an earlier attempt's weights or prompts into this one.

Only trainer rank 0 and rollout rank 0 touch orders, and trainer rank 0 samples; the roles' other ranks get what
they need from them over their own world (``broadcast``). Each rollout replica sends its own samples.

Test: ``.venv/bin/python -m pytest tests/test_async_grpo.py -q``
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_rl.rollout.buffer import Sample
from megatron_rl.rollout.placement import Placement, session_dir
from megatron_rl.rollout.weight_sync import (
    BUCKET_BYTES,
    BroadcastWeightPublisher,
    BroadcastWeightSubscriber,
    FileWeightPublisher,
    FileWeightSubscriber,
    _write_atomically,
    receiving_stream,
)
from megatron_rl.runtime import checkpoint as ckpt
from megatron_rl.runtime.distributed import collective_device, global_rank
from megatron_rl.spec.private import make_private_dir

POLL_S = 0.02
WORKER_WAIT_S = 24 * 3600
"""How long a rollout worker waits for an order or weights (and its gloo bridge for the next version): the
trainers may be in a long SFT warm-up, a checkpoint or an export; a dead trainer ends the job, workers included."""
BRIDGE_BACKENDS = ("gloo", "nccl")
"""The weight_syncs over a WeightBridge (its process group's backend; its broadcasts stage the tensors on the
group's ``collective_device``)."""
RESHARDED = "resharded"
"""Under the channel folder: the versions as distributed checkpoints, when the rollout layout differs."""
ORDER_NAME = "{:08d}.json"
STOP_FILE = "stop"


@dataclass
class Order:
    """Prompts for the rollout workers: stream ids, their records (plain data) and the sampling seed."""

    seq: int
    prompt_ids: list[int]
    prompts: list[dict]
    """``PromptRecord`` fields of each prompt (the worker reads no data files)."""
    seed: int


def broadcast(value: Any, *, src: int = 0) -> Any:
    """``value`` of rank ``src`` on every rank of this process's world (itself without a process group)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def shard_index() -> tuple[int, int, bool]:
    """(this rank's weight shard, the number of shards, whether it writes/reads one): tp x pp shards, written
    by data-parallel and context-parallel rank 0."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    index = ps.get_pipeline_model_parallel_rank() * tp + ps.get_tensor_model_parallel_rank()
    holder = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    return index, tp * pp, holder


def split_weights(chunks: list) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the tensors training changes, those it never does) of this rank's model chunks, named chunk<i>.<key>:
    the first are the trainable parameters (every weight, or LoRA's adapters and modules_to_save), the second
    the frozen ones and the buffers."""
    trainable, frozen = {}, {}
    for i, chunk in enumerate(chunks):
        module = ckpt.unwrap(chunk)
        grads = {name for name, param in module.named_parameters() if param.requires_grad}
        for name, tensor in module.state_dict(keep_vars=True).items():
            if not isinstance(tensor, torch.Tensor) or name.endswith("_extra_state"):
                continue
            (trainable if name in grads else frozen)[f"chunk{i}.{name}"] = tensor.detach()
    return trainable, frozen


def load_weights(chunks: list, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (named as ``split_weights`` names them) into this rank's chunks; every name must exist."""
    targets = {}
    for i, chunk in enumerate(chunks):
        for name, tensor in ckpt.unwrap(chunk).state_dict(keep_vars=True).items():
            targets[f"chunk{i}.{name}"] = tensor
    unknown = sorted(set(state) - set(targets))
    if unknown:
        raise RuntimeError(f"weights for {len(unknown)} tensors this rollout model lacks, e.g. {unknown[:3]}: "
                           "the trainers and the rollout workers must build the same model")
    with torch.no_grad():
        for name, tensor in state.items():
            targets[name].copy_(tensor)


class TrainerChannel:
    """Trainer side: publish weights (every rank), issue orders and collect samples (rank 0)."""

    def __init__(self, folder: Path, session: str, *, weight_sync: str = "files", bridge: Optional["WeightBridge"] = None,
                 keep_last: int = 3, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.folder, self.session = Path(folder), session
        self.rank = global_rank()
        self.shard, shards, self.holder = shard_index()
        self.weight_sync = weight_sync
        self.samples = FileWeightPublisher(self.folder, keep_last=keep_last, rank=self.shard, num_shards=shards)
        if weight_sync == "files":
            self.weights = self.samples
            self.base = FileWeightPublisher(self.folder / "base", keep_last=1, rank=self.shard, num_shards=shards)
        elif weight_sync in BRIDGE_BACKENDS:  # a holder broadcasts its shard to the rollout ranks of the same one
            self.bridge = BroadcastWeightPublisher(bridge.group, bucket_bytes=bucket_bytes) if self.holder else None
        elif weight_sync != "resharded":
            raise ValueError(f"weight_sync={weight_sync!r}: files, gloo, nccl or resharded")
        self.keep_last = keep_last
        self.orders = session_dir(self.folder, session) / "orders"
        self._next_seq = 0

    def start(self) -> None:
        """Rank 0: remove other sessions and left-over samples, and make this session's folder."""
        if self.rank != 0:
            return
        sessions = make_private_dir(session_dir(self.folder, self.session).parent)
        for entry in sessions.iterdir():
            if entry.name != self.session:
                shutil.rmtree(entry, ignore_errors=True)
        self.samples.clear_samples()
        shutil.rmtree(self.folder / RESHARDED, ignore_errors=True)  # a resumed trainer's versions start again
        make_private_dir(self.orders.parent)
        make_private_dir(self.orders)

    def publish(self, version: int, chunks: list, *, base: bool = False) -> dict[str, float]:
        """Send this rank's shard of ``version`` (and with ``base`` the frozen tensors, once per session). Files:
        rank 0 commits once every shard is in. A bridge: each holder's broadcast returns once its rollout ranks have
        the bytes (their receiving threads are always listening). {weight_sync_bytes (all ranks), weight_sync_s}."""
        start = time.perf_counter()
        if self.weight_sync == "resharded":  # every version whole, as a distributed checkpoint (any layout loads it)
            folder = ckpt.save_checkpoint(self.folder / RESHARDED, step=version, chunks=chunks, keep_last=self.keep_last)
            nbytes = float(sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())) if self.rank == 0 else 0.0
            return {"weight_sync_bytes": float(broadcast(nbytes)), "weight_sync_s": time.perf_counter() - start}
        trainable, frozen = split_weights(chunks)
        parts = ([("base", 0, frozen)] if base else []) + [("weights", version, trainable)]
        nbytes = 0.0
        for kind, number, tensors in parts:
            if self.weight_sync == "files":
                publisher = self.base if kind == "base" else self.weights
                if self.holder:
                    nbytes += publisher.write_shard(number, tensors)
                if self.rank == 0:
                    publisher.commit(number)
            elif self.bridge is not None:
                nbytes += self.bridge.publish(number, tensors, kind=kind)["weight_sync_bytes"]
        total = torch.full((1,), nbytes, dtype=torch.float64, device=collective_device())
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        return {"weight_sync_bytes": float(total), "weight_sync_s": time.perf_counter() - start}

    def issue(self, order_ids: list[int], prompts: list[dict], *, seed: int) -> None:
        """Rank 0: one order of prompts for the workers (written atomically, numbered in sequence)."""
        order = {"prompt_ids": order_ids, "prompts": prompts, "seed": seed}
        path = self.orders / ORDER_NAME.format(self._next_seq)
        _write_atomically(path, lambda tmp: tmp.write_text(json.dumps(order)))
        self._next_seq += 1

    def collect(self) -> tuple[list[Sample], dict[str, float]]:
        """Rank 0: every sample the workers sent since the last call, with their stats."""
        return self.samples.take_samples()

    def stop(self, exit_code: int) -> None:
        """Tell the workers to exit with ``exit_code`` (0 done, REQUEUE_EXIT_CODE preempted): rank 0 writes the
        stop file; over a bridge every holder also ends its rollout ranks' receiving threads."""
        if self.rank == 0 and self.orders.parent.is_dir():
            path = self.orders.parent / STOP_FILE
            _write_atomically(path, lambda tmp: tmp.write_text(json.dumps({"exit_code": exit_code})))
        if self.weight_sync in BRIDGE_BACKENDS and self.bridge is not None:
            self.bridge.publish(0, {}, kind="stop")


class WorkerChannel:
    """Rollout side: take orders or the stop (rank 0, told to all), load weights, send samples (one rank of each
    replica)."""

    def __init__(self, folder: Path, session: str, *, worker: str = "rollout0", weight_sync: str = "files",
                 bridge: Optional["WeightBridge"] = None) -> None:
        self.folder = Path(folder)
        self.rank = global_rank()
        shard, _, _ = shard_index()
        self.samples = FileWeightSubscriber(self.folder, worker=worker, shard=shard)
        self.weights = (FileWeights(self.folder, worker=worker, shard=shard) if weight_sync == "files"
                        else ReshardedWeights(self.folder / RESHARDED) if weight_sync == "resharded"
                        else BroadcastWeights(BroadcastWeightSubscriber(bridge.group)))
        self.session_dir = session_dir(self.folder, session)
        self._next_seq = 0
        self.idle_s = 0.0
        """Seconds spent waiting for an order since the last ``send``."""

    def take_orders(self, *, wait: bool, timeout_s: float) -> list[Order] | int:
        """Every order that has come, in sequence (with ``wait``, at least one: it waits up to ``timeout_s``), or
        the exit code once the trainers have stopped; every rank gets the same."""
        start = time.perf_counter()
        found: Any = None
        if self.rank == 0:
            orders: list[Order] = []
            deadline = time.monotonic() + timeout_s
            while found is None:
                path = self.session_dir / "orders" / ORDER_NAME.format(self._next_seq + len(orders))
                if path.is_file():
                    data = json.loads(path.read_text())
                    orders.append(Order(seq=self._next_seq + len(orders), prompt_ids=data["prompt_ids"],
                                        prompts=data["prompts"], seed=data["seed"]))
                    path.unlink()
                elif orders or not wait:
                    found = orders
                elif (self.session_dir / STOP_FILE).is_file():
                    found = int(json.loads((self.session_dir / STOP_FILE).read_text())["exit_code"])
                elif time.monotonic() > deadline:
                    found = TimeoutError(f"no order in {self.session_dir / 'orders'} for {timeout_s:.0f} s "
                                         "(parallel.timeout_s): did the trainers stop?")
                else:
                    time.sleep(POLL_S)
            if found == [] and (self.session_dir / STOP_FILE).is_file():
                found = int(json.loads((self.session_dir / STOP_FILE).read_text())["exit_code"])
        found = broadcast(found)
        if isinstance(found, Exception):
            raise found
        if isinstance(found, list):
            self._next_seq += len(found)
        if wait:
            self.idle_s += time.perf_counter() - start
        return found

    def load_newest(self, chunks: list, *, timeout_s: float) -> tuple[int, dict[str, float]]:
        """Load the newest weights into ``chunks`` (the base first, once); (version, sync metrics). Every rank
        loads the same version."""
        start = time.perf_counter()
        version, nbytes = self.weights.load_newest(chunks, timeout_s=timeout_s)
        return version, {"weight_sync_bytes": nbytes, "weight_sync_s": time.perf_counter() - start}

    def send(self, samples: list[Sample], stats: dict[str, float]) -> dict[str, float]:
        """One replica's finished samples, with its stats (and the worker's idle time, then reset): called by
        the rank of each replica that sends."""
        stats = {**stats, "generator_idle_s": self.idle_s}
        self.idle_s = 0.0
        return self.samples.publish_samples(samples, stats)


def _all_ranks_ok(ok: bool) -> bool:
    return _reduce_flag(ok, torch.distributed.ReduceOp.MIN)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of this world (a collective)."""
    return _reduce_flag(flag, torch.distributed.ReduceOp.MAX)


def _reduce_flag(flag: bool, op) -> bool:
    value = torch.full((1,), 1.0 if flag else 0.0, device=collective_device())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(value, op=op)
    return value.item() == 1.0


class FileWeights:
    """The rollout ranks' side of ``weight_sync=files``: the newest complete version in the folder."""

    def __init__(self, folder: Path, *, worker: str, shard: int) -> None:
        self.current = FileWeightSubscriber(folder, worker=worker, shard=shard)
        self.base = FileWeightSubscriber(Path(folder) / "base", worker=worker, shard=shard)

    def load_newest(self, chunks: list, *, timeout_s: float) -> tuple[int, float]:
        nbytes = self._load(self.base, chunks, timeout_s=timeout_s) if self.base.version is None else 0.0
        nbytes += self._load(self.current, chunks, timeout_s=timeout_s)
        return self.current.version, nbytes

    @staticmethod
    def _load(subscriber: FileWeightSubscriber, chunks: list, *, timeout_s: float) -> float:
        rank = global_rank()
        deadline = time.monotonic() + timeout_s
        while True:
            newest = subscriber.newest() if rank == 0 else None
            if rank == 0 and newest is None and time.monotonic() < deadline:
                time.sleep(POLL_S)
                continue
            newest = broadcast(newest)
            if newest is None:
                raise TimeoutError(f"no weights in {subscriber.weights} for {timeout_s:.0f} s")
            if newest[1] == subscriber.loaded_id:
                return 0.0
            try:
                received = subscriber.load(*newest)
            except FileNotFoundError:  # retired while read: every rank tries the newest again
                received = None
            if _all_ranks_ok(received is not None):
                load_weights(chunks, received.state_dict)
                return float(received.metrics["weight_sync_bytes"])


class ReshardedWeights:
    """The rollout ranks' side when they run another tp x pp than the trainers: each version is a distributed
    checkpoint (``checkpoint.save_checkpoint`` of the trainers' chunks), which Megatron reshards to this layout as
    it loads."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.loaded: Optional[str] = None
        self.version: Optional[int] = None

    def load_newest(self, chunks: list, *, timeout_s: float) -> tuple[int, float]:
        rank = global_rank()
        deadline = time.monotonic() + timeout_s
        while True:
            newest = ckpt.latest_checkpoint(self.folder) if rank == 0 else None
            if rank == 0 and newest is None and time.monotonic() < deadline:
                time.sleep(POLL_S)
                continue
            newest = broadcast(None if newest is None else str(newest))
            if newest is None:
                raise TimeoutError(f"no weights in {self.folder} for {timeout_s:.0f} s")
            if newest == self.loaded:
                return self.version, 0.0
            try:  # retention keeps the newest few: one deleted while read is retried, by every rank
                state = ckpt.load_checkpoint(newest, chunks=chunks, load_optimizer=False)
                ok = True
            except FileNotFoundError:
                ok = False
            if _all_ranks_ok(ok):
                self.loaded, self.version = newest, int(state["step"])
                nbytes = sum(p.stat().st_size for p in Path(newest).rglob("*") if p.is_file()) if rank == 0 else 0
                return self.version, float(nbytes)


class BroadcastWeights:
    """The rollout ranks' side of ``weight_sync=gloo`` or ``nccl``: a thread receives every broadcast version as it
    comes (so the trainer's send never waits for a generation to finish); between orders the newest is loaded."""

    def __init__(self, subscriber: BroadcastWeightSubscriber) -> None:
        self.subscriber = subscriber
        self.received: dict[str, Any] = {}
        """kind -> the newest Received of it."""
        self.history: dict[int, Any] = {}
        """version -> Received, the newest few (the ranks may be a version apart when rank 0 chooses)."""
        self.loaded: Optional[int] = None
        self.base_loaded = False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._receive, name="weight-sync-receiver", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        with receiving_stream(self.subscriber.device):  # on a GPU: never the stream generation runs on
            while True:
                received = self.subscriber.poll()
                with self._ready:
                    if received.kind == "stop":
                        self.received["stop"] = received
                        self._ready.notify_all()
                        return
                    self.received[received.kind] = received
                    if received.kind == "weights":
                        self.history[received.version] = received
                        for old in sorted(self.history)[:-4]:
                            del self.history[old]
                    self._ready.notify_all()

    def _wait_for(self, ready, *, timeout_s: float, what: str):
        """``ready()`` once it is truthy (or the trainers stopped: then whatever it is)."""
        with self._ready:
            if not self._ready.wait_for(lambda: ready() or "stop" in self.received, timeout=timeout_s):
                raise TimeoutError(f"no {what} over the weight bridge for {timeout_s:.0f} s")
            return ready()

    def load_newest(self, chunks: list, *, timeout_s: float) -> tuple[int, float]:
        rank = global_rank()
        newest = None
        if rank == 0 and self._wait_for(lambda: bool(self.history), timeout_s=timeout_s, what="weights"):
            with self._ready:
                newest = max(self.history)
        version = broadcast(newest)
        if version is None:  # the trainers stopped before sending any
            raise TimeoutError("the trainers stopped before sending weights")
        received = self._wait_for(lambda: self.history.get(version), timeout_s=timeout_s, what=f"version {version}")
        nbytes = 0.0
        if not self.base_loaded:
            base = self._wait_for(lambda: self.received.get("base"), timeout_s=timeout_s, what="base weights")
            self._load(chunks, base)
            self.base_loaded, nbytes = True, float(base.metrics["weight_sync_bytes"])
        if version != self.loaded:
            self._load(chunks, received)
            self.loaded, nbytes = version, nbytes + float(received.metrics["weight_sync_bytes"])
        return version, nbytes

    @staticmethod
    def _load(chunks: list, received) -> None:
        load_weights(chunks, received.state_dict)
        for tensor in received.state_dict.values():
            if tensor.is_cuda:  # made on the receiving stream, read on this one: its memory waits for these copies
                tensor.record_stream(torch.cuda.current_stream())


@dataclass
class WeightBridge:
    """The process group of one weight shard across the two worlds (gloo, or nccl on GPUs): its trainer holder
    (group rank 0) and the rollout ranks that hold the same shard (rank 1 + their rollout data-parallel rank). It
    meets through a FileStore in the session's folder, as the rollout world does: no port to reserve (a TCPStore at
    MASTER_PORT + 1 could find that port taken and fail the job with EADDRINUSE). The nccl
    bridge follows torch's ``ProcessGroupNCCL(store, rank, size, options)``; it is unverified here (no GPU), and
    needs one GPU per rank (NCCL refuses two ranks of a group on one device)."""

    group: Any
    store: Any

    @classmethod
    def open(cls, placement: Placement, *, backend: str, replicas: int,
             timeout_s: float) -> Optional["WeightBridge"]:
        """This process's bridge over ``backend`` (gloo or nccl); None for a trainer rank that holds no shard (it
        sends nothing)."""
        import datetime

        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        shard, _, holder = shard_index()
        if placement.role == "train":
            if not holder:
                return None
            rank = 0
        else:
            rank = 1 + ps.get_data_parallel_rank()
        timeout = datetime.timedelta(seconds=timeout_s)
        folder = make_private_dir(placement.session_dir)
        store = dist.FileStore(str(folder / f"weights-shard{shard}.store"), 1 + replicas)
        store.set_timeout(timeout)
        if backend == "gloo":
            group = dist.ProcessGroupGloo(store, rank, 1 + replicas, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, 1 + replicas, options)
        return cls(group=group, store=store)
