"""GRPO runs of real Megatron Core through launch.py (local processes, gloo, CPU)."""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import pytest

from helpers import check_run_manifest, read_metrics, without_measurements

SHORT = ["cluster.executor=local", "logging.tensorboard=false", "algorithm.sft_warmup_steps=5",
         "algorithm.prompts_per_step=4", "algorithm.group_size=4", "algorithm.global_batch_size=8",
         "parallel.micro_batch_size=4", "run.steps=4"]


def _grpo(launch, run_dir, *extra, env=None, expect=0):
    result = launch(*SHORT, f"run.dir={run_dir}", *extra, env=env)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]
    return [m for m in read_metrics(run_dir) if m.get("phase") is None]


_stable = without_measurements


WHOLE = ["algorithm.kl_coef=0.05", "generation.max_concurrent=4", "logging.sample_every=1", "logging.samples=3"]
"""The settings of the uninterrupted run and of its preempted copy: the KL brings the reference model in,
generation.max_concurrent=4 decodes 4 of a worker's 8 rows at a time (a stop can come mid-rollout), and 3
completions of every step go to samples.jsonl."""


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """One uninterrupted run shared by the metrics test and the preemption test (its reference): it also parks
    optimizer state and grads in host memory while it generates (generation.offload_optimizer, as the 70B config
    does) and evaluates every 2 steps. Returns (launch.py's result, run folder)."""
    from helpers import run_launch

    run_dir = tmp_path_factory.mktemp("grpo") / "whole"
    result = run_launch(*SHORT, f"run.dir={run_dir}", *WHOLE, "generation.offload_optimizer=true",
                        "data.eval_interval=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, run_dir


def test_first_minibatch_ratio_is_one_and_metrics_are_complete(launch, whole):
    """Colocated generation log-probs equal the training forward's: the first importance ratio is exactly ~1
    (here with the optimizer offloaded while generating, 4 rows at a time). Every step logs its phases' times and peak
    memory, and the run ends with the planner's prediction (written at launch) beside what it measured, which
    `plan --calibrate` reports again."""
    result, run_dir = whole
    assert "planner vs this run (4 steps): step time " in result.stdout
    assert "measured on cpu, planned for h100-80gb: not comparable" in result.stdout
    calibrated = launch("plan", "--calibrate", str(run_dir), "--json")
    assert calibrated.returncode == 0, calibrated.stderr
    report = json.loads(calibrated.stdout)
    metrics = [m for m in read_metrics(run_dir) if m.get("phase") is None]
    assert report["steps"] == 4 and report["step_time_s"]["measured"] == statistics.median(
        m["step_time_s"] for m in metrics)
    assert report["peak_memory_gib"]["measured"] == max(max(m["peak_memory_generate_gib"], m["peak_memory_train_gib"])
                                                        for m in metrics)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    for sample in samples:  # spread over the prompts: rows 0, 5 and 10 of 16 (groups of 4)
        assert sample["prompt"].startswith("last of ") and sample["rewards"]["exact"] == sample["reward"]
        assert sample["reward"] == float(sample["completion"].strip() == str(sample["answer"]))
        assert 1 <= sample["response_tokens"] <= 4 and isinstance(sample["advantage"], float)
    assert len({s["prompt"] for s in samples if s["step"] == 4}) == 3
    shown = launch("logs", str(run_dir), "--samples")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("step 4: 3 of its completions") and shown.stdout.count("    completion: ") == 3
    for m in metrics:
        assert m["first_ratio_min"] == pytest.approx(1.0, abs=1e-5)
        assert m["first_ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert m["minibatches"] == 2  # 16 completions, global batch 8
        for key in ("reward_mean", "reward_std", "accuracy", "response_length", "kl", "clip_fraction",
                    "ratio_min", "ratio_max", "entropy", "grad_norm", "lr", "generate_tokens_per_s",
                    "train_tokens_per_s", "time_generate_s", "time_score_s", "time_train_s"):
            assert key in m, key
        assert 0 <= m["accuracy"] <= 1 and m["entropy"] > 0 and 1 <= m["response_length"] <= 4
        assert 0 < m["peak_memory_generate_gib"] < 24 and 0 < m["peak_memory_train_gib"] < 24  # RSS per phase
        assert m["offload_s"] > 0 and m["offload_restore_s"] > 0  # grads freed and zeroed at every step
    # the optimizer state parked at every generation phase moves the same bytes: none at step 1 (the optimizer is
    # fresh after the warm-up, Adam's moments come with its first update), one phase's at step 3, and with the
    # evaluation's phases at steps 2 and 4
    per_phase = metrics[2]["offload_bytes"]
    assert metrics[0]["offload_bytes"] == 0 and per_phase > 0
    assert all(m["offload_bytes"] % per_phase == 0 for m in metrics) and metrics[1]["offload_bytes"] > per_phase


def test_tp2_matches_tp1(launch, tmp_path):
    """Same data-parallel size (1), same seed: TP=2 samples the same completions and trains the same way."""
    tp1 = _grpo(launch, tmp_path / "tp1", "cluster.tasks_per_node=1")
    tp2 = _grpo(launch, tmp_path / "tp2", "parallel.tp=2")
    for a, b in zip(tp1, tp2, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"]
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key


def test_preempted_grpo_resumes_exactly(launch, tmp_path, whole):
    """Save-and-exit inside the SFT warm-up (after its step 3 of 5), resume, save-and-exit after GRPO step 2,
    resume, a stop inside the generation of step 4 (generation.max_concurrent=4: 4 rows at a time; the
    step is abandoned and step 3 saved), resume, every rank SIGKILLed inside step 4's generation (nothing saved),
    resume: every metric, warm-up lines included and each logged once, equals the uninterrupted run's (the shared
    ``whole`` run).

    The uninterrupted run also parks optimizer state and grads in host memory while it generates
    (generation.offload_optimizer, as the 70B config does), so this also shows that the offload is exact."""
    _, whole_dir = whole
    whole = [m for m in read_metrics(whole_dir) if m.get("phase") is None]
    evals = [m for m in read_metrics(whole_dir) if m.get("phase") == "eval"]
    assert [m["step"] for m in evals] == [2, 4] and all(0 <= m["pass_at_1"] <= 1 for m in evals)
    assert evals[0]["prompts"] > 0  # the synthetic task's held-out problems
    run_dir = tmp_path / "split"
    first = launch(*SHORT, f"run.dir={run_dir}", *WHOLE,
                   env={"MEGATRON_RL_STOP_AFTER_STEP": "sft:3"})
    assert first.returncode == 3, first.stdout[-3000:] + first.stderr[-3000:]
    assert "preemption requested: saved SFT warm-up step 3 of 5" in first.stdout
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    _grpo(launch, run_dir, *WHOLE, env={"MEGATRON_RL_STOP_AFTER_STEP": "2"}, expect=3)
    stopped = launch(*SHORT, f"run.dir={run_dir}", *WHOLE,
                     env={"MEGATRON_RL_STOP_AFTER_STEP": "generate:4"})
    assert stopped.returncode == 3, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "preemption requested during step 4: stopped its generation, saved step 3" in stopped.stdout
    assert [m["step"] for m in read_metrics(run_dir) if m.get("phase") is None] == [1, 2, 3]
    killed = launch(*SHORT, f"run.dir={run_dir}", *WHOLE, env={"MEGATRON_RL_FAULT": "kill-during-generation:4"})
    assert killed.returncode == 137 and "was killed by signal 9" in killed.stderr, killed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir) if m.get("phase") is None] == [1, 2, 3]
    resumed = _grpo(launch, run_dir, *WHOLE)
    assert _stable(resumed) == _stable(whole)  # the evaluations of `whole` changed none of its training steps
    not_eval = lambda run: [m for m in read_metrics(run) if m.get("phase") != "eval"]  # noqa: E731
    assert _stable(not_eval(run_dir)) == _stable(not_eval(whole_dir))  # warm-up lines too
    assert (run_dir / "samples.jsonl").read_text() == (whole_dir / "samples.jsonl").read_text()  # each step once
    assert all(m["kl"] >= 0 for m in whole)  # k3 is non-negative; the reference model is in play
    audit = check_run_manifest(run_dir, statuses=["preempted"] * 3 + ["lost: ended without recording its end",
                                                                      "completed"])  # 3 stops and a kill, one record
    synthetic = {Path(e["path"]).name: e for e in audit["inputs"] if e["key"] == "data.synthetic"}
    assert sorted(synthetic) == ["sft.jsonl", "test.jsonl", "train.jsonl"], "rewritten identically: listed once"
    for name, entry in synthetic.items():
        assert entry["sha256"] == hashlib.sha256((run_dir / "data" / name).read_bytes()).hexdigest(), name


def test_dapo_parts_epochs_and_recomputed_old_logprobs_run(launch, tmp_path):
    """Dynamic sampling refills (and logs its draws), 2 epochs log per-epoch stats, and the recomputed old
    log-probs make the first update's ratio 1 to fp32 precision."""
    metrics = _grpo(launch, tmp_path / "run", "algorithm.drop_zero_signal_groups=true",
                    "algorithm.max_sampling_draws=3", "algorithm.loss_aggregation=seq-mean-token-sum-norm",
                    "algorithm.advantage=mean", "algorithm.epochs=2", "algorithm.recompute_old_logprobs=true",
                    "algorithm.mask_truncated=true", "algorithm.overlong.buffer=2")
    assert len(metrics) == 4
    for m in metrics:
        assert m["groups_kept"] == 4 or m["sampling_draws"] == 3  # full, or out of draws
        assert 1 <= m["sampling_draws"] <= 3 and "reward_overlong" in m and 0 <= m["truncated_fraction"] <= 1
        if "skipped_minibatches" not in m:
            assert m["first_ratio_min"] == pytest.approx(1.0, abs=1e-6)
            assert m["first_ratio_max"] == pytest.approx(1.0, abs=1e-6)
            assert {"clip_fraction_epoch1", "clip_fraction_epoch2", "kl_epoch1", "kl_epoch2"} <= set(m)
            assert m["minibatches"] == 2 * (int(m["groups_kept"]) * 4 // 8)  # 2 epochs over the kept completions


@pytest.mark.slow
def test_default_job_reward_climbs(launch, tmp_path):
    """The README's main job (fewer steps): the exact-match reward climbs from chance to > 0.8."""
    run_dir = tmp_path / "default"
    result = launch(f"run.dir={run_dir}", "run.steps=220", "logging.console=quiet", "logging.tensorboard=false",
                    timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rewards = [m["reward_mean"] for m in read_metrics(run_dir) if m.get("phase") is None]
    start, end = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert start < 0.2 and end > 0.8, (start, end)
