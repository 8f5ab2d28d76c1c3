"""Weight sync (megatron_rl/rollout/weight_sync.py): files between two OS processes that share only a folder
(versions one way, samples the other), a writer killed mid-publish, sharded versions, and gloo on 2 ranks.

Run: `.venv/bin/python -m pytest tests/test_weight_sync.py -q`
"""

import contextlib
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from megatron_rl.rollout.weight_sync import FileWeightPublisher, FileWeightSubscriber, complete_versions
from megatron_rl.spec.ports import free_port
from tests.helpers import REPO_ROOT

PEER = str(REPO_ROOT / "tests" / "dist" / "weight_sync_peer.py")
VERSIONS = 12
KILLED_WRITER = """
import sys, torch
from megatron_rl.rollout.weight_sync import FileWeightPublisher
publisher = FileWeightPublisher(sys.argv[1])
publisher.publish(1, {"w": torch.ones(3)})
publisher.publish(2, {"w": torch.full((3,), 2.0)})  # SIGKILLed after the shard, before COMPLETE
"""


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    """Every process at once: the file publisher and subscriber, the killed writer, and two gloo ranks (started
    as torchrun would, without its agent process)."""
    root = tmp_path_factory.mktemp("weight_sync")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    shared, gloo_out = root / "shared", root / "gloo"
    gloo_out.mkdir()

    def start(*args, **extra_env):
        return subprocess.Popen([sys.executable, *args], env={**env, **extra_env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    port = str(free_port())
    started = {role: start(PEER, role, str(shared), str(VERSIONS), str(root / role))
               for role in ("subscriber", "publisher")}
    started |= {f"gloo{rank}": start(PEER, "--out", str(gloo_out), RANK=str(rank), WORLD_SIZE="2",
                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for rank in (0, 1)}
    killed = start("-c", KILLED_WRITER, str(root / "killed"), MEGATRON_RL_FAULT="kill-during-weight-publish:2")
    for role, proc in started.items():
        output = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, f"{role}: {output[-3000:]}"
    killed.communicate(timeout=60)
    return {"root": root, "shared": shared, "killed_rc": killed.returncode,
            "gloo": [json.loads((gloo_out / f"rank{rank}.json").read_text()) for rank in (0, 1)],
            **{role: json.loads((root / role).read_text()) for role in ("subscriber", "publisher")}}


def test_the_reader_sees_only_complete_versions_with_the_tensors_written(peers):
    written, seen = peers["publisher"]["written"], peers["subscriber"]["seen"]
    assert peers["subscriber"]["wrong"] == []
    assert str(VERSIONS) in seen and len(seen) >= 2  # it followed the writer, not only its last version
    assert all(seen[v]["sha"] == written[v] for v in seen)
    assert [int(v) for v in seen] == sorted(int(v) for v in seen)  # only ever newer versions


def test_samples_come_back_through_the_same_folder(peers):
    samples, seen = peers["publisher"]["samples"], peers["subscriber"]["seen"]
    assert peers["publisher"]["hello"] == 1  # the handshake before the first version
    assert sorted(s["prompt_id"] for s in samples) == sorted(int(v) for v in seen)  # none lost, none twice
    for sample in samples:
        assert sample["sha"] == peers["publisher"]["written"][str(sample["version"])]
        assert sample["echo"] == list(range(sample["version"], sample["version"] + 5))


def test_bytes_and_seconds_are_reported_per_sync(peers):
    payload = (1 << 18) * 4 + 7 * 2 + 5 * 8 + 4
    for metrics in [*peers["publisher"]["metrics"], *peers["subscriber"]["seen"].values()]:
        assert payload < metrics["weight_sync_bytes"] < payload + 4096  # the tensors and a safetensors header
        assert 0 < metrics["weight_sync_s"] < 30


def test_old_versions_are_retired_and_everything_is_private(peers):
    weights = peers["shared"] / "weights"
    assert complete_versions(weights) == [VERSIONS - 1, VERSIONS]
    assert sorted(p.name for p in weights.iterdir()) == ["latest", f"v{VERSIONS - 1:08d}", f"v{VERSIONS:08d}"]
    assert (weights / "latest").read_text() == f"v{VERSIONS:08d}\n"
    assert list((peers["shared"] / "samples").iterdir()) == []  # each batch deleted once read
    for path in [peers["shared"], *peers["shared"].rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {mode:o}"


def test_a_writer_killed_mid_publish_leaves_nothing_a_reader_takes_and_the_next_publish_cleans_it(peers):
    folder = peers["root"] / "killed"
    assert peers["killed_rc"] == -9
    partial = folder / "weights" / ".tmp-v00000002"
    assert (partial / "rank00000.safetensors").is_file() and not (partial / "COMPLETE").exists()
    reader = FileWeightSubscriber(folder)
    received = reader.poll()
    assert received.version == 1 and torch.equal(received.state_dict["w"], torch.ones(3))
    assert reader.poll() is None
    FileWeightPublisher(folder).publish(3, {"w": torch.full((3,), 3.0)})
    assert not partial.exists()
    assert reader.poll().state_dict["w"].tolist() == [3.0, 3.0, 3.0]


def test_a_sharded_version_is_published_when_every_shard_is_in(tmp_path):
    ranks = [FileWeightPublisher(tmp_path, rank=r, num_shards=2) for r in range(2)]
    ranks[0].write_shard(5, {"a": torch.zeros(2)})
    with pytest.raises(TimeoutError, match="2 shards"):
        ranks[0].commit(5, timeout_s=0.05)
    assert FileWeightSubscriber(tmp_path).poll() is None
    ranks[1].write_shard(5, {"b": torch.ones(3, dtype=torch.int32)})
    ranks[0].commit(5)
    received = FileWeightSubscriber(tmp_path).poll()
    assert received.version == 5 and sorted(received.state_dict) == ["a", "b"]
    with pytest.raises(ValueError, match="write_shard and rank 0 commit"):
        ranks[0].publish(6, {})


def test_a_resumed_trainer_publishing_an_older_version_again_is_followed(tmp_path):
    publisher, reader = FileWeightPublisher(tmp_path, keep_last=3), FileWeightSubscriber(tmp_path)
    for version in (1, 2, 3):
        publisher.publish(version, {"w": torch.full((2,), float(version))})
    assert reader.poll().version == 3
    publisher.publish(2, {"w": torch.full((2,), -2.0)})  # resumed from the checkpoint of step 2
    assert complete_versions(tmp_path / "weights") == [1, 2]
    received = reader.poll()
    assert received.version == 2 and received.state_dict["w"].tolist() == [-2.0, -2.0]
    assert reader.poll() is None


def test_gloo_broadcasts_every_version_whole(peers):
    sent, got = (peers["gloo"][r]["versions"] for r in (0, 1))
    assert sorted(got) == ["1", "2", "3"]
    for version, received in got.items():
        assert received["equal"] and received["sha"] == sent[version]["sha"]
        assert received["weight_sync_bytes"] == sent[version]["weight_sync_bytes"] == (1 << 18) * 4 + 14 + 40 + 4
    # versions 1 and 2 in buckets of 48 bytes (the receiver reads the size from the header): the weight alone
    # (larger than a bucket, from its own storage), the bias alone (with the ids it would not fit), the ids with the
    # scale; version 3 in one bucket of the default size. The sender never stages more than a bucket.
    for rank in (0, 1):
        versions = peers["gloo"][rank]["versions"]
        assert versions["1"]["tensor_broadcasts"] == versions["2"]["tensor_broadcasts"] == [(1 << 18) * 4, 14, 44]
        assert versions["3"]["tensor_broadcasts"] == [(1 << 18) * 4 + 14 + 40 + 4]


def test_the_receiving_thread_broadcasts_on_its_own_stream_and_syncs_it_before_handing_over(monkeypatch):
    """Finding 4: on the GPU's default stream, NCCL's wait for the broadcast posted for the next version holds every
    generation kernel behind it, while the trainer sends that version only once it has those kernels' samples. The
    nccl receiving thread (``BroadcastWeights``) selects its GPU, makes a stream of its own, broadcasts on it and
    synchronises it before it hands a version over. CUDA's stream calls are recording stand-ins, tensors asked for
    on the GPU are made on the CPU, and the group replays what a real publisher broadcast (in buckets)."""
    import threading
    from types import SimpleNamespace

    from torch.overrides import TorchFunctionMode

    from megatron_rl.rollout import channel
    from megatron_rl.rollout.weight_sync import BroadcastWeightPublisher, BroadcastWeightSubscriber

    events: list[tuple] = []

    class Stream:
        def __init__(self, name: str = "side") -> None:
            self.name = name
            events.append(("new stream", name))

        def synchronize(self) -> None:
            events.append(("synchronize", self.name))

    current = [Stream("default")]
    events.clear()

    @contextlib.contextmanager
    def stream(side):
        current.append(side)
        try:
            yield
        finally:
            current.pop()

    for name, stand_in in {"Stream": Stream, "stream": stream, "current_stream": lambda device=None: current[-1],
                           "set_device": lambda device: events.append(("set_device", device))}.items():
        monkeypatch.setattr(torch.cuda, name, stand_in)

    class Done:
        def wait(self) -> None:
            pass

    class Recording:  # the publisher's side: what it broadcasts, in order
        sent: list[torch.Tensor] = []

        def broadcast(self, tensors, options):
            self.sent.append(tensors[0].clone())
            return Done()

    class Replaying:  # the receiver's side: the same broadcasts, on the stream current at the call
        def broadcast(self, tensors, options):
            events.append(("broadcast", current[-1].name))
            tensors[0].copy_(Recording.sent.pop(0))
            return Done()

    class OnTheCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = {key: "cpu" if key == "device" and torch.device(value).type == "cuda" else value
                      for key, value in (kwargs or {}).items()}
            if func is torch.Tensor.to:
                args = tuple("cpu" if isinstance(a, torch.device) and a.type == "cuda" else a for a in args)
            return func(*args, **kwargs)

    state = {"w": torch.arange(16, dtype=torch.float32), "b": torch.full((3,), 0.5, dtype=torch.bfloat16),
             "ids": torch.arange(4)}
    publisher = BroadcastWeightPublisher(Recording(), device="cpu", bucket_bytes=48)
    publisher.publish(1, state)
    publisher.publish(0, {}, kind="stop")
    subscriber = BroadcastWeightSubscriber(Replaying(), device="cuda:1")
    poll = subscriber.poll
    subscriber.poll = lambda: (lambda got: events.append(("handed over", got.kind)) or got)(poll())

    class Inline:  # the receiving thread's body, run here (the redirecting mode is per thread)
        def __init__(self, target, **_) -> None:
            self.start = target

    monkeypatch.setattr(channel, "threading", SimpleNamespace(Thread=Inline, Condition=threading.Condition))
    with OnTheCpu():
        weights = channel.BroadcastWeights(subscriber)
    on_side = [("broadcast", "side")]
    assert events == [("set_device", 1), ("new stream", "side"),
                      *on_side * 4, ("synchronize", "side"), ("handed over", "weights"),  # header, w, b + ids
                      *on_side * 2, ("synchronize", "side"), ("handed over", "stop")]
    got = weights.history[1].state_dict
    assert got.keys() == state.keys() and all(got[k].dtype == v.dtype and torch.equal(got[k], v)
                                              for k, v in state.items())
