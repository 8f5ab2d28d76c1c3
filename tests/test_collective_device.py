"""One rule for the device of the tensors the job makes for a collective (``runtime.distributed.collective_device``:
the current GPU for NCCL, the CPU for gloo). A CPU tensor on an NCCL group fails ("No backend type associated with
device type cpu"), which a CPU job never sees; here the gloo world's collective device is patched to ``meta`` and
torch.distributed's collectives record the device of every tensor they are given (without communicating), so a
site that makes its tensor anywhere but on its group's device shows up as a CPU tensor.

A meta tensor has no values: a path stops where it first reads a collective's result on the host
(``reaches_collectives``), so each case also counts the collectives it reached.

Run: ``.venv/bin/python -m pytest tests/test_collective_device.py -q``
"""

from __future__ import annotations

import datetime

import pytest
import torch

from megatron_rl.runtime import distributed

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "send", "recv", "isend", "irecv")


@pytest.fixture(scope="module")
def one_process_world():
    """A one-process gloo world with Megatron's parallel state, torn down afterwards."""
    from megatron.core import parallel_state

    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.HashStore(),
                                         timeout=datetime.timedelta(seconds=60))
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture
def recorded(one_process_world, monkeypatch):
    """The devices of the tensors each collective got, with gloo's collective device patched to meta."""
    monkeypatch.setitem(distributed.COLLECTIVE_DEVICE_TYPES, "gloo", "meta")
    calls: list[tuple[str, str]] = []

    def recorder(name):
        def collective(*args, **kwargs):
            for value in (*args, *kwargs.values()):
                for tensor in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(tensor, torch.Tensor):
                        calls.append((name, tensor.device.type))
        return collective

    for name in COLLECTIVES:
        monkeypatch.setattr(torch.distributed, name, recorder(name))
    return calls


def reaches_collectives(fn, *args, **kwargs) -> None:
    """Run ``fn`` up to its first host read of a collective's result (a meta tensor has no values)."""
    try:
        fn(*args, **kwargs)
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" not in str(exc):
            raise


def test_collective_device_follows_the_group_backend(one_process_world, monkeypatch):
    """gloo (the default group, a new group, a standalone bridge) -> cpu; nccl -> the current GPU; several
    backends -> the accelerator's."""
    bridge = torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1, datetime.timedelta(seconds=5))
    assert {distributed.collective_device(g) for g in (None, torch.distributed.group.WORLD, bridge)} \
        == {torch.device("cpu")}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None, name=backend: name)
        assert distributed.collective_device() == torch.device("cuda", 3)


def test_trainer_channel_publish_reduces_on_the_collective_device(recorded, tmp_path):
    from megatron_rl.rollout.channel import TrainerChannel

    channel = TrainerChannel(tmp_path, "s0", weight_sync="files")
    channel.start()
    reaches_collectives(channel.publish, 1, [torch.nn.Linear(2, 2)])
    assert recorded == [("all_reduce", "meta")]


@pytest.mark.parametrize("flag_reduction", ["any_rank", "_all_ranks_ok"])
def test_the_rollout_flags_reduce_on_the_collective_device(recorded, flag_reduction):
    from megatron_rl.rollout import channel

    reaches_collectives(getattr(channel, flag_reduction), True)
    assert recorded == [("all_reduce", "meta")]


def test_the_behaviour_weight_fallback_and_the_metric_reduction(recorded):
    """A micro-batch without loss tokens (a CP slice of a short response): behav_weight_max falls back to 1 on the
    ratio's device without a host sync (on meta inputs, a sync would fail), then reduce_reports reduces it and the
    means over both its groups on the collective device."""
    from megatron_rl.algorithms.policy_loss import behaviour_weights
    from megatron_rl.runtime.training import reduce_reports

    old, behav = torch.zeros(2, 3, device="meta"), torch.zeros(2, 3, device="meta")
    _, stats = behaviour_weights(old, behav, torch.zeros(2, 3, device="meta"), correction="truncated_is", cap=2.0)
    assert {value.device.type for value in stats.values()} == {"meta"}
    _, cpu_stats = behaviour_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3),
                                     correction="truncated_is", cap=2.0)
    assert cpu_stats["behav_weight_max"].item() == 1.0  # the fallback's value: an on-policy token's weight
    report = {name: (value, 1.0) for name, value in cpu_stats.items()}  # reported on the model's device
    reaches_collectives(reduce_reports, [report], ("behav_weight_mean", "behav_capped_fraction"))
    reaches_collectives(reduce_reports, [report], ("behav_weight_max",))
    assert recorded == [("all_reduce", "meta")] * 6  # the sums (empty in the second call), then the maximum


def test_the_trainer_agreement_and_trainable_fraction(recorded):
    from megatron_rl.models.lora import trainable_fraction
    from megatron_rl.trainers.common import TrainerContext

    reaches_collectives(TrainerContext._agree, True, 2.5)
    reaches_collectives(trainable_fraction, [torch.nn.Linear(2, 2)])
    assert recorded == [("all_reduce", "meta")] * 3


def test_gathers_over_data_parallel_ranks_and_the_generation_lockstep(recorded, monkeypatch):
    """PPO's row gather and the expert-parallel lockstep act only over several ranks: the group size is patched."""
    from megatron_rl.generation import layout
    from megatron_rl.rl.critic import _all_gather_rows

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    reaches_collectives(_all_gather_rows, torch.ones(3, 2), torch.distributed.group.WORLD)
    monkeypatch.setattr(layout, "experts_span_workers", lambda chunks: True)
    reaches_collectives(layout.Lockstep([]).step_shape, 5, True)
    assert recorded == [("all_gather", "meta")] * 3 + [("all_reduce", "meta")]


def test_the_weight_bridge_stages_on_its_group_device(recorded):
    """A standalone bridge group (a gloo backend object, not a group of this world) goes through the same rule."""
    from megatron_rl.rollout.weight_sync import BroadcastWeightPublisher, BroadcastWeightSubscriber

    bridge = torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1, datetime.timedelta(seconds=5))
    assert BroadcastWeightPublisher(bridge).device.type == BroadcastWeightSubscriber(bridge).device.type == "meta"
