"""GRPO runs of real Megatron Core through launch.py (local processes, gloo, CPU)."""

from __future__ import annotations

import pytest

from helpers import read_metrics

SHORT = ["cluster.executor=local", "logging.tensorboard=false", "algorithm.sft_warmup_steps=5",
         "algorithm.prompts_per_step=4", "algorithm.group_size=4", "algorithm.global_batch_size=8",
         "parallel.micro_batch_size=4", "run.steps=4"]
VOLATILE = ("step_time_s", "time_generate_s", "time_score_s", "time_train_s", "generate_tokens_per_s",
            "train_tokens_per_s")


def _grpo(launch, run_dir, *extra, env=None, expect=0):
    result = launch(*SHORT, f"run.dir={run_dir}", *extra, env=env)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]
    return [m for m in read_metrics(run_dir) if m.get("phase") is None]


def _stable(metrics):
    return [{k: v for k, v in m.items() if k not in VOLATILE} for m in metrics]


def test_first_minibatch_ratio_is_one_and_metrics_are_complete(launch, tmp_path):
    """Colocated generation log-probs equal the training forward's: the first importance ratio is exactly ~1."""
    metrics = _grpo(launch, tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert m["first_ratio_min"] == pytest.approx(1.0, abs=1e-5)
        assert m["first_ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert m["minibatches"] == 2  # 16 completions, global batch 8
        for key in ("reward_mean", "reward_std", "accuracy", "response_length", "kl", "clip_fraction",
                    "ratio_min", "ratio_max", "entropy", "grad_norm", "lr", "generate_tokens_per_s",
                    "train_tokens_per_s", "time_generate_s", "time_score_s", "time_train_s"):
            assert key in m, key
        assert 0 <= m["accuracy"] <= 1 and m["entropy"] > 0 and 1 <= m["response_length"] <= 4


def test_tp2_matches_tp1(launch, tmp_path):
    """Same data-parallel size (1), same seed: TP=2 samples the same completions and trains the same way."""
    tp1 = _grpo(launch, tmp_path / "tp1", "cluster.tasks_per_node=1")
    tp2 = _grpo(launch, tmp_path / "tp2", "parallel.tp=2")
    for a, b in zip(tp1, tp2, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"]
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key


def test_preempted_grpo_resumes_exactly(launch, tmp_path):
    """Save-and-exit after step 2 (the preemption path), resume: every metric equals an uninterrupted run's.

    The uninterrupted run also parks optimizer state and grads in host memory while it generates
    (generation.offload_optimizer, as the 70B config does), so this also shows that the offload is exact."""
    whole = _grpo(launch, tmp_path / "whole", "algorithm.kl_coef=0.05", "generation.offload_optimizer=true")
    run_dir = tmp_path / "split"
    _grpo(launch, run_dir, "algorithm.kl_coef=0.05", env={"MEGATRON_RL_STOP_AFTER_STEP": "2"}, expect=3)
    resumed = _grpo(launch, run_dir, "algorithm.kl_coef=0.05")
    assert _stable(resumed) == _stable(whole)
    assert all(m["kl"] >= 0 for m in whole)  # k3 is non-negative; the reference model is in play


def test_dynamic_sampling_and_aggregations_run(launch, tmp_path):
    metrics = _grpo(launch, tmp_path / "run", "algorithm.drop_zero_signal_groups=true",
                    "algorithm.loss_aggregation=seq-mean-token-sum-norm", "algorithm.advantage=mean")
    assert len(metrics) == 4


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
