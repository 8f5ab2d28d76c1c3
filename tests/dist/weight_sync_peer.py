"""Started by tests/test_weight_sync.py: one side of a weight sync, in its own OS process.

    weight_sync_peer.py publisher FOLDER VERSIONS OUT   publish versions 1..VERSIONS, collect the samples
    weight_sync_peer.py subscriber FOLDER VERSIONS OUT  poll until VERSIONS, check each loaded version, send a
                                                        sample back per version seen
    weight_sync_peer.py --out DIR                       (2 gloo ranks, torchrun's environment) rank 0
                                                        publishes 3 versions (1 and 2 in buckets of
                                                        BUCKET_BYTES, 3 in the default), rank 1 polls them

Each writes a JSON report to OUT (DIR/rank{R}.json): the SHA-256 of every version's tensors as it wrote or read them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

from megatron_rl.rollout.buffer import Sample

ELEMENTS = 1 << 18  # 1 MiB of float32 per version: big enough for the reader to overlap the writes
BUCKET_BYTES = 48
"""Less than the weight (alone), the bias with the ids (apart), more than the ids with the scale (together)."""


def tensors_of(version: int) -> dict[str, torch.Tensor]:
    return {"layer.weight": torch.arange(ELEMENTS, dtype=torch.float32) * version,
            "layer.bias": torch.full((7,), float(version), dtype=torch.bfloat16),
            "ids": torch.arange(5, dtype=torch.int64) + version, "scale": torch.tensor(version / 3)}


def digest(state_dict: dict[str, torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].contiguous()
        sha.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def publisher(folder: str, versions: int) -> dict:
    from megatron_rl.rollout.weight_sync import FileWeightPublisher

    pub = FileWeightPublisher(folder, keep_last=2)
    written, metrics, samples = {}, [], []

    def collect_until(prompt_id: int) -> None:
        deadline = time.monotonic() + 60
        while prompt_id not in {s.prompt_id for s in samples} and time.monotonic() < deadline:
            samples.extend(pub.take_samples()[0])
            time.sleep(0.005)

    collect_until(0)  # the subscriber is up (its hello), so it can follow the versions as they come
    hello = [s for s in samples if s.prompt_id == 0]
    samples.clear()
    for version in range(1, versions + 1):
        state = tensors_of(version)
        written[version] = digest(state)
        metrics.append(pub.publish(version, state))
        samples += pub.take_samples()[0]
        time.sleep(0.05)
    collect_until(versions)
    return {"written": written, "metrics": metrics, "hello": len(hello),
            "samples": [{"prompt_id": s.prompt_id, "version": s.version, "sha": s.payload["sha"],
                         "echo": s.payload["echo"].tolist()} for s in samples]}


def subscriber(folder: str, versions: int) -> dict:
    from megatron_rl.rollout.weight_sync import FileWeightSubscriber

    sub = FileWeightSubscriber(folder, worker="rollout0")
    seen, wrong, polls = {}, [], 0
    sub.publish_samples([Sample(prompt_id=0, version=0, payload={"hello": True})])
    deadline = time.monotonic() + 60
    while sub.version != versions and time.monotonic() < deadline:
        received = sub.poll()
        polls += 1
        if received is None:
            time.sleep(0.002)
            continue
        expected = tensors_of(received.version)
        if received.state_dict.keys() != expected.keys() or not all(
                torch.equal(received.state_dict[k], expected[k]) for k in expected):
            wrong.append(received.version)
        seen[received.version] = {"sha": digest(received.state_dict), **received.metrics}
        sub.publish_samples([Sample(prompt_id=received.version, version=received.version,
                                    payload={"sha": seen[received.version]["sha"],
                                             "echo": received.state_dict["ids"]})])
    return {"seen": seen, "wrong": wrong, "polls": polls}


def gloo() -> dict:
    import torch.distributed as dist

    from megatron_rl.rollout import weight_sync
    from megatron_rl.rollout.weight_sync import BroadcastWeightPublisher, BroadcastWeightSubscriber

    sizes: list[int] = []  # the bytes of each broadcast of a version (its header's two first)
    broadcast = weight_sync._group_broadcast

    def recorded(group, tensor: torch.Tensor, root: int) -> None:
        sizes.append(tensor.numel() * tensor.element_size())
        broadcast(group, tensor, root)

    weight_sync._group_broadcast = recorded
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1], backend="gloo")
    rank, out = dist.get_rank(), {}
    for version in (1, 2, 3):
        sizes.clear()
        if rank == 0:
            state = tensors_of(version)
            publisher = BroadcastWeightPublisher(group, src=0, bucket_bytes=BUCKET_BYTES if version < 3
                                                 else weight_sync.BUCKET_BYTES)
            out[version] = {"sha": digest(state), **publisher.publish(version, state)}
        else:
            received = BroadcastWeightSubscriber(group, src=0).poll()
            out[received.version] = {"sha": digest(received.state_dict), **received.metrics,
                                     "equal": all(torch.equal(received.state_dict[k], v)
                                                  and received.state_dict[k].dtype == v.dtype
                                                  for k, v in tensors_of(version).items())}
        out[version]["tensor_broadcasts"] = sizes[2:]
    dist.destroy_process_group()
    return {"rank": rank, "versions": out}


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "--out":
        report, out = gloo(), os.path.join(sys.argv[2], f"rank{os.environ['RANK']}.json")
    else:
        report, out = (publisher if role == "publisher" else subscriber)(sys.argv[2], int(sys.argv[3])), sys.argv[4]
    with open(out, "w") as handle:
        json.dump(report, handle)
