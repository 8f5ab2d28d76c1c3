"""The version-tagged rollout buffer (megatron_rl/rollout/buffer.py): staleness bound, drops, waits, metrics,
and a resume that loses and repeats no prompt.

Run: `.venv/bin/python -m pytest tests/test_rollout_buffer.py -q`
"""

import json
import threading
import time

import pytest

from megatron_rl.rollout.buffer import ASYNC_METRICS, RolloutBuffer, Sample


def put_all(buffer, ids, version):
    return [buffer.put(Sample(prompt_id=i, version=version, payload={"prompt": i})) for i in ids]


def test_take_keeps_the_staleness_bound_drops_older_samples_and_issues_their_prompts_again():
    buffer = RolloutBuffer(max_staleness=1, batch_size=2)
    assert buffer.issue(4) == [0, 1, 2, 3]
    put_all(buffer, [0, 1], version=0)
    put_all(buffer, [3, 2], version=1)
    taken = buffer.take(2, current_version=2, timeout_s=1)
    assert [(s.prompt_id, s.version) for s in taken] == [(2, 1), (3, 1)]  # oldest first; version 0 is 2 behind
    metrics = buffer.step_metrics()
    assert tuple(metrics) == ASYNC_METRICS
    assert metrics["staleness_mean"] == 1.0 and metrics["staleness_max"] == 1
    assert metrics["dropped_samples"] == 2 and metrics["queue_depth"] == 0
    assert buffer.issue(3) == [0, 1, 4]  # the dropped prompts first
    assert buffer.step_metrics()["dropped_samples"] == 0  # per step


def test_max_staleness_zero_takes_only_the_current_version():
    buffer = RolloutBuffer(max_staleness=0, batch_size=1)
    buffer.issue(2)
    put_all(buffer, [0], version=4)
    put_all(buffer, [1], version=5)
    assert [s.prompt_id for s in buffer.take(1, current_version=5, timeout_s=1)] == [1]
    assert buffer.step_metrics()["dropped_samples"] == 1
    with pytest.raises(ValueError, match="newer than the trainer"):
        put_all(buffer, buffer.issue(1), version=9)
        buffer.take(1, current_version=5, timeout_s=0)


def test_samples_of_prompts_not_outstanding_are_refused():
    buffer = RolloutBuffer(max_staleness=2, batch_size=1)
    buffer.issue(2)
    assert put_all(buffer, [0, 0, 7], version=0) == [True, False, False]  # a duplicate, an id never issued
    buffer.take(1, current_version=0, timeout_s=1)
    assert put_all(buffer, [0], version=0) == [False]  # consumed already
    assert buffer.refused_total == 3


def test_the_trainer_waits_for_samples_and_the_wait_is_measured():
    buffer = RolloutBuffer(max_staleness=0, batch_size=1)
    ids = buffer.issue(1)
    threading.Timer(0.2, put_all, (buffer, ids, 3)).start()
    assert [s.prompt_id for s in buffer.take(1, current_version=3, timeout_s=5)] == ids
    assert 0.15 < buffer.step_metrics()["trainer_idle_s"] < 5
    with pytest.raises(TimeoutError, match="0 of 1 samples"):
        buffer.take(1, current_version=3, timeout_s=0.05)


def test_wait_policy_holds_the_generators_at_max_staleness_plus_one_batches():
    buffer = RolloutBuffer(max_staleness=1, batch_size=2, stale_policy="wait")
    assert buffer.issue(10) == [0, 1, 2, 3]  # (1 + 1) x 2 outstanding at most
    start = time.perf_counter()
    assert buffer.issue(1, timeout_s=0.1) == []
    assert buffer.step_metrics()["generator_idle_s"] >= 0.1 > time.perf_counter() - start - 1
    put_all(buffer, [0, 1], version=0)
    threading.Timer(0.1, buffer.take, (2, 0)).start()  # a step frees room for two more
    assert buffer.issue(5, timeout_s=5) == [4, 5]
    with pytest.raises(ValueError, match="can never be met"):
        buffer.take(5, current_version=0)


K, BATCH = 2, 4


def train(buffer, versions, consumed, attempts):
    """Simulated split-placement steps: generators fill every issued prompt at a lag behind the trainer (3, too
    stale, on a prompt's first attempt when id % 5 == 0), the trainer takes a batch per version."""
    for version in versions:
        for prompt in buffer.issue(2 * BATCH):
            attempts[prompt] = attempts.get(prompt, 0) + 1
            lag = 3 if prompt % 5 == 0 and attempts[prompt] == 1 else prompt % 3
            assert buffer.put(Sample(prompt_id=prompt, version=max(0, version - lag), payload=None))
        consumed += [s.prompt_id for s in buffer.take(BATCH, current_version=version, timeout_s=5)]
        assert buffer.step_metrics()["staleness_max"] <= K


def test_a_resumed_buffer_loses_no_prompt_and_repeats_none():
    buffer, before, attempts = RolloutBuffer(max_staleness=K, batch_size=BATCH), [], {}
    train(buffer, range(0, 6), before, attempts)
    state = json.loads(json.dumps(buffer.state_dict()))  # plain data, as the checkpoint stores it
    assert buffer.queue_depth > 0 and buffer.dropped_total > 0  # the save falls with samples queued and redone
    issued = state["next_id"]

    fresh, after = RolloutBuffer(max_staleness=K, batch_size=BATCH), []
    fresh.load_state_dict(state)
    late = state["outstanding"][0]  # a worker that generated across the preemption delivers late
    assert not fresh.put(Sample(prompt_id=late, version=5, payload=None))
    train(fresh, range(6, 30), after, attempts)

    repeated = len(before) + len(after) - len(set(before) | set(after))
    lost = [prompt for prompt in range(issued) if prompt not in set(before) | set(after)]
    assert (repeated, lost) == (0, [])
    assert fresh.consumed == len(before) + len(after) == 30 * BATCH
    assert sum(fresh.staleness_histogram.values()) == 30 * BATCH
    assert max(fresh.staleness_histogram) <= K
