"""Split-placement (asynchronous) GRPO: 1 trainer + 1 rollout process, meeting only through run.dir/rollout
(megatron_rl/rl/rollout_workers.py, megatron_rl/rollout/{placement,channel,worker}.py).

    .venv/bin/python -m pytest tests/test_async_grpo.py -q

- configs/grpo_async_tiny.yaml learns the tiny task (mean reward >= 0.8 over the last 10% of steps) with every
  step's staleness_max <= max_staleness, every sample's version checked against the step that took it;
- max_staleness=0 is synchronous: every sample comes from the weights being trained, so the behaviour weight
  pi_prox / pi_behav is 1 up to generation-vs-training rounding;
- a run preempted after step 3, then SIGKILLed during a weight publish and during a sample hand-off, and resumed
  each time, trains on every issued prompt exactly once: no prompt lost, none repeated, counted from the ledger
  and the checkpoint's buffer state independently of the trainer's own metrics;
- the same k = 0 run at other layouts and transports gives the same metrics: rollout replicas at their own TP
  (weights resharded through a distributed checkpoint), and gloo between 2 TP2 trainers and a 2-process TP2
  rollout world.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import read_metrics

SHORT = ("algorithm.sft_warmup_steps=2", "checkpoint.save_interval=1")


def _ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollout" / "consumed.jsonl").read_text().splitlines()]


def _buffer_state(checkpoint: Path) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(checkpoint))["extra"]["rollout_buffer"]


# ------------------------------------------------------------------ placement (no processes)
def test_placement_gives_the_last_ranks_the_rollout_world_and_each_role_its_own_ranks(tmp_path):
    from megatron_rl.rollout.placement import split_placement
    from megatron_rl.runtime.distributed import DistEnv, read_dist_env

    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2", "MASTER_PORT": "29600"}
    roles = []
    for rank in range(4):
        job = DistEnv(rank=rank, world_size=4, local_rank=rank, master_addr="node1", master_port=29600)
        placement = split_placement(job, rollout_tasks=1, run_dir=tmp_path, env=env)
        roles.append((placement.role, placement.world.rank, placement.world.world_size))
        process_env = {}
        placement.enter(process_env)
        seen = read_dist_env(process_env)
        assert (seen.rank, seen.world_size) == (placement.world.rank, placement.world.world_size)
        if placement.role == "rollout":  # meets through the run folder, not the trainers' host
            assert seen.init_method == f"file://{tmp_path}/rollout/sessions/77_2_29600/rendezvous"
            assert (tmp_path / "rollout" / "sessions" / "77_2_29600").stat().st_mode & 0o777 == 0o700
        else:
            assert seen.init_method is None and seen.master_addr == "node1"
    assert roles == [("train", 0, 3), ("train", 1, 3), ("train", 2, 3), ("rollout", 0, 1)]
    requeued = split_placement(job, rollout_tasks=1, run_dir=tmp_path, env={**env, "SLURM_RESTART_COUNT": "3"})
    assert requeued.session != placement.session


# ------------------------------------------------------------------ the tiny task, asynchronous
@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    from helpers import run_launch

    run_dir = tmp_path_factory.mktemp("grpo_async") / "run"
    result = run_launch("--config", "configs/grpo_async_tiny.yaml", f"run.dir={run_dir}", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir, result


def test_async_grpo_learns_the_tiny_task_within_the_staleness_bound(async_run):
    run_dir, result = async_run
    metrics = [m for m in read_metrics(run_dir) if m.get("phase", "train") == "train"]
    assert len(metrics) == 300
    last = metrics[-30:]
    assert sum(m["reward_mean"] for m in last) / len(last) >= 0.8
    assert all(m["staleness_max"] <= 1 for m in metrics)
    assert any(m["staleness_max"] == 1 for m in metrics)  # the worker did run ahead of the trainer
    for key in ("staleness_mean", "dropped_samples", "queue_depth", "trainer_idle_s", "generator_idle_s",
                "weight_sync_bytes", "weight_sync_s", "behav_weight_mean", "behav_capped_fraction"):
        assert all(key in m for m in metrics), key
    assert all(m["weight_sync_bytes"] > 0 for m in metrics)
    # rows decoding per engine step of the worker's session: at most two orders' (128 each: 16 prompts x 8); the
    # 4-token responses end before the engine's next question, so orders do not overlap on this task
    # (bench/rollout_session.py measures the overlap on long-tail lengths)
    rows = [m["rollout_rows_per_step"] for m in metrics]
    assert all(0 <= r <= 256 for r in rows) and max(rows) > 64, (min(rows), max(rows))
    assert "1 process(es) serving" in (run_dir / "logs" / "rank1.log").read_text()
    assert "the trainers stopped (exit code 0)" in (run_dir / "logs" / "rank1.log").read_text()


def test_every_sample_is_at_most_max_staleness_versions_older_than_the_weights_it_trains(async_run):
    run_dir, _ = async_run
    ledger = _ledger(run_dir)
    assert [entry["step"] for entry in ledger] == list(range(1, 301))
    for entry in ledger:  # step s trains the weights after s - 1 steps: version s - 1
        assert all(0 <= (entry["step"] - 1) - version <= 1 for version in entry["versions"]), entry
    ids = [i for entry in ledger for i in entry["prompt_ids"]]
    assert len(ids) == len(set(ids)) == 300 * 16


# ------------------------------------------------------------------ synchronous split placement
FULL_WEIGHT_BYTES = 363_432
"""Size of one full-weight version of the tiny-cpu model over files: its fp32 tensors plus the safetensors header
(whose version field varies by a few bytes)."""


SYNC = ("--config", "configs/grpo_async_tiny.yaml", "run.steps=3", "algorithm.max_staleness=0", *SHORT)
"""Synchronous split placement (k = 0), 3 steps: every sample from the weights being trained, so runs at other
layouts or transports must give the same metrics."""


def _sync_run(run_dir: Path, *overrides: str) -> list[dict]:
    from helpers import run_launch

    result = run_launch(*SYNC, f"run.dir={run_dir}", *overrides, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [m for m in read_metrics(run_dir) if m.get("phase", "train") == "train"]


@pytest.fixture(scope="module")
def sync_tp1(tmp_path_factory):
    """The k = 0 run at 1 trainer + 1 worker, TP=1, weights through files: (run folder, train metrics)."""
    run_dir = tmp_path_factory.mktemp("grpo_async_sync") / "tp1"
    return run_dir, _sync_run(run_dir)


@pytest.mark.parametrize("lora", [None, "{rank: 4}"])
def test_max_staleness_0_trains_only_on_samples_of_the_current_weights(sync_tp1, tmp_path, lora):
    """k = 0: every sample is of the weights being trained, so pi_prox / pi_behav = 1 up to kernel rounding; with
    LoRA each version sends only the adapters."""
    run_dir, metrics = sync_tp1 if lora is None else (tmp_path / "lora", None)
    if lora is not None:
        metrics = _sync_run(run_dir, f"model.lora={lora}")
    assert [m["staleness_max"] for m in metrics] == [0, 0, 0]
    for m in metrics:  # the same weights generated and recomputed the log-probs: only kernel rounding is left
        assert abs(m["behav_weight_mean"] - 1) < 1e-3 and m["behav_weight_max"] < 1.01, m
    for entry in _ledger(run_dir):
        assert entry["versions"] == [entry["step"] - 1] * 16
    sent = {m["weight_sync_bytes"] for m in metrics}
    if lora is None:
        assert all(abs(size - FULL_WEIGHT_BYTES) < 64 for size in sent), sent
    else:  # the rank-4 adapters alone (the frozen base went once, at the start)
        assert len(sent) == 1 and 0 < sent.pop() < FULL_WEIGHT_BYTES / 10


# ------------------------------------------------------------------ preemption
def test_a_preempted_or_killed_async_run_resumes_without_losing_or_repeating_a_prompt(launch, tmp_path):
    """One run, four launches: preempted after step 3; SIGKILLed while publishing step 5's weights (step 5 trained,
    not saved); SIGKILLed once it took step 6's samples out of the channel (held nowhere else); then run to the
    end. Each resume trains every issued prompt exactly once, on samples of the versions the bound allows."""
    run_dir = tmp_path / "preempted"
    args = ("--config", "configs/grpo_async_tiny.yaml", f"run.dir={run_dir}", "run.steps=7", *SHORT)
    first = launch(*args, env={"MEGATRON_RL_STOP_AFTER_STEP": "3"}, timeout=600)
    assert first.returncode == 3, first.stdout[-3000:] + first.stderr[-3000:]
    assert "the trainers stopped (exit code 3)" in (run_dir / "logs" / "rank1.log").read_text()
    at_stop = _buffer_state(run_dir / "checkpoints" / "step_00000003")
    assert at_stop["outstanding"]  # prompts were in flight when it stopped: these must come back
    for fault, saved in (("kill-during-weight-publish:5", 4), ("kill-during-sample-handoff:6", 5)):
        killed = launch(*args, env={"MEGATRON_RL_FAULT": fault}, timeout=600)
        assert killed.returncode == 137, fault + killed.stdout[-3000:] + killed.stderr[-3000:]
        assert "rank 0 was killed by signal 9" in killed.stderr, killed.stderr[-3000:]
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{saved:08d}"
    last = launch(*args, timeout=600)
    assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
    assert "resumed from" in last.stdout

    ledger = _ledger(run_dir)
    assert [entry["step"] for entry in ledger] == [1, 2, 3, 4, 5, 6, 7]  # the killed launches' unsaved steps dropped
    assert len({entry["session"] for entry in ledger}) == 4
    consumed = [i for entry in ledger for i in entry["prompt_ids"]]
    assert len(consumed) == len(set(consumed))  # none repeated
    final = _buffer_state(run_dir / "checkpoints" / "step_00000007")
    assert set(consumed) | set(final["outstanding"]) == set(range(final["next_id"]))  # none lost
    after_stop = {i for entry in ledger[3:] for i in entry["prompt_ids"]}
    assert set(at_stop["outstanding"]) <= after_stop | set(final["outstanding"])
    for entry in ledger:  # trainers and workers agreed on the weights' version across every resume
        assert all(entry["step"] - 2 <= version <= entry["step"] - 1 for version in entry["versions"]), entry
    metrics = [m for m in read_metrics(run_dir) if m.get("phase", "train") == "train"]
    assert sorted({m["step"] for m in metrics}) == [1, 2, 3, 4, 5, 6, 7]
    assert all(m["prompts_lost"] == 0 and m["prompts_repeated"] == 0 for m in metrics)


def test_rollout_workers_at_their_own_tp_get_resharded_weights(sync_tp1, tmp_path):
    """parallel.rollout_tp=1 beside 2 trainers at TP=2: each version goes out as a distributed checkpoint and the
    worker loads it at TP=1. The weights arrive exactly: the worker's log-probs are the trainers' recomputation
    (behaviour weight 1), and the run equals the all-TP1 one (1 trainer + 1 worker)."""
    resharded_dir = tmp_path / "resharded"
    runs = {"tp1": sync_tp1[1],
            "resharded": _sync_run(resharded_dir, "parallel.tp=2", "parallel.rollout_tp=1", "cluster.tasks_per_node=3")}
    assert "1 process(es) serving" in (resharded_dir / "logs" / "rank2.log").read_text()
    assert sorted(p.name for p in (resharded_dir / "rollout" / "resharded").glob("step_*")) == \
        ["step_00000001", "step_00000002", "step_00000003"]  # keep_last 3 of versions 0..3
    for tp1, resharded in zip(runs["tp1"], runs["resharded"], strict=True):
        assert resharded["staleness_max"] == 0 and resharded["weight_sync_bytes"] > 0
        assert abs(resharded["behav_weight_mean"] - 1) < 1e-5 and resharded["behav_weight_max"] < 1 + 1e-4
        assert resharded["reward_mean"] == tp1["reward_mean"]
        for key in ("loss", "grad_norm"):
            assert resharded[key] == pytest.approx(tp1[key], rel=1e-4, abs=1e-6), key


def test_gloo_weight_sync_at_tp2_equals_files_at_tp1(sync_tp1, tmp_path):
    """weight_sync=gloo with 2 trainers at TP=2 and 2 rollout processes (their own TP=2 world): each trainer
    holder broadcasts its shard over a gloo group bridging the worlds to the rollout rank of the same shard, which
    receives it on a thread. At max_staleness=0 its first steps equal the 1 + 1 process files run at TP=1 (same
    samples, same weights, up to TP rounding)."""
    files_dir, gloo_dir = sync_tp1[0], tmp_path / "gloo"
    runs = {"files": sync_tp1[1],
            "gloo": _sync_run(gloo_dir, "algorithm.weight_sync=gloo", "parallel.tp=2", "cluster.tasks_per_node=4",
                              "cluster.rollout_tasks=2")}
    assert "2 process(es) serving" in (gloo_dir / "logs" / "rank2.log").read_text()
    from megatron_rl.rollout.weight_sync import complete_versions

    assert complete_versions(files_dir / "rollout" / "weights") == [1, 2, 3]  # keep_last 3 of 0..3
    for folder in ("weights", "base/weights"):  # over gloo no version went through the folder
        assert complete_versions(gloo_dir / "rollout" / folder) == []
    for files, gloo in zip(runs["files"], runs["gloo"], strict=True):
        assert gloo["staleness_max"] == 0 and gloo["weight_sync_bytes"] > 0
        assert gloo["reward_mean"] == files["reward_mean"]
        for key in ("loss", "grad_norm", "behav_weight_mean"):
            assert gloo[key] == pytest.approx(files[key], rel=1e-4, abs=1e-6), key
