"""PPO with a critic (megatron_rl/rl/critic.py in the loop of megatron_rl/trainers/rl.py): config checks, the shipped tiny recipe learning, TP=2 against
TP=1, exact preempt/resume, the planner's critic, and the critic's HF export.

    .venv/bin/python -m pytest tests/test_ppo.py -q

The GAE maths itself is checked by hand in tests/test_gae.py.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from helpers import read_metrics, run_launch, torchrun_check, without_measurements
from megatron_rl.spec.config import load_config
from megatron_rl.spec.errors import ConfigError

# 16 completions (one per prompt), 2 mini-batches of 8 x 2 epochs; the KL in the reward brings the reference in;
# step 1 trains only the critic
SHORT = ["--config", "configs/ppo_tiny.yaml", "logging.tensorboard=false", "logging.plot=false",
         "algorithm.sft_warmup_steps=3", "algorithm.prompts_per_step=16", "algorithm.global_batch_size=8",
         "parallel.micro_batch_size=4", "algorithm.epochs=2", "algorithm.kl_in_reward=true",
         "algorithm.whiten_advantages=true", "algorithm.critic_warmup_steps=1", "run.steps=3"]


def _ppo(run_dir, *extra, env=None, expect=0):
    result = run_launch(*SHORT, f"run.dir={run_dir}", *extra, env=env)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _steps(run_dir) -> list[dict]:
    return [m for m in read_metrics(run_dir) if m.get("phase") is None]


@pytest.mark.parametrize("override, message", [
    ("algorithm.gamma=1.5", "algorithm.gamma=1.5 must be in [0, 1]"),
    ("algorithm.gae_lambda=-0.1", "algorithm.gae_lambda=-0.1 must be in [0, 1]"),
    ("algorithm.value_clip=0", "algorithm.value_clip=0.0 must be positive"),
    ("algorithm.value_coef=-1", "algorithm.value_coef=-1.0 must be positive"),
    ("algorithm.critic_lr=0", "algorithm.critic_lr=0.0 must be positive"),
    ("algorithm.critic_warmup_steps=-2", "algorithm.critic_warmup_steps=-2 must be >= 0"),
    ("algorithm.critic_init=random", "algorithm.critic_init='random' is not valid; use one of: policy, rm"),
    ("algorithm.critic_init=rm", "algorithm.critic_init=rm needs algorithm.critic_init_from"),
    ("algorithm.critic_init_from=runs/rm/checkpoints", "is read only with algorithm.critic_init=rm"),
    ("algorithm.global_batch_size=96", "algorithm.global_batch_size=96 must divide the rollout batch"),
])
def test_bad_ppo_settings_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/ppo_tiny.yaml", [override])
    assert message in str(err.value)


def test_a_bad_ppo_setting_exits_2_with_one_line():
    result = run_launch("--config", "configs/ppo_tiny.yaml", "algorithm.gamma=2", "--dry-run", timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "algorithm.gamma=2" in result.stderr and "Traceback" not in result.stderr


def test_the_planner_counts_the_critic_and_refuses_cp():
    result = run_launch("plan", "--config", "configs/ppo_tiny.yaml", "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    text = json.dumps(plan)
    assert '"critic"' in text
    ppo = run_launch("plan", "--config", "configs/ppo_tiny.yaml", "--layout", "cp=2", timeout=60)
    assert ppo.returncode == 2 and "does not support context parallelism" in ppo.stderr, ppo.stdout + ppo.stderr


# ----- the shipped recipe, one run shared by the learning, explained-variance, metrics and export tests -----

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ppo_tiny") / "run"
    result = run_launch("--config", "configs/ppo_tiny.yaml", f"run.dir={run_dir}", "logging.console=quiet",
                        "logging.tensorboard=false", "logging.plot=false", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def test_ppo_tiny_learns_the_task(tiny_run):
    """Over the last 10% of steps the mean reward is >= 0.8 and at least 0.3 above the first 10%'s."""
    steps = _steps(tiny_run)
    tenth = len(steps) // 10
    first = statistics.mean(m["reward_mean"] for m in steps[:tenth])
    last = statistics.mean(m["reward_mean"] for m in steps[-tenth:])
    assert last >= 0.8 and last - first >= 0.3, (first, last)


def test_the_critic_learns_to_explain_the_returns(tiny_run):
    """Explained variance starts near 0 (a fresh head) and rises above 0 while the rewards still vary (once
    every completion is right the returns are constant and the statistic is undefined, so those steps are left
    out). The bounds hold at six seeds (peak 0.37-1.0, later median 0.09-0.67, 2026-12-05): the faster the
    policy learns, the fewer steps the critic has while the rewards vary."""
    steps = _steps(tiny_run)
    varied = [m["explained_variance"] for m in steps if m["reward_std"] > 0.3]
    assert statistics.median(m["explained_variance"] for m in steps[:10]) < 0.1
    assert max(varied) > 0.3 and statistics.median(varied[len(varied) // 2:]) > 0, varied


def test_ppo_metrics_are_complete(tiny_run):
    for m in _steps(tiny_run):
        for key in ("value_loss", "explained_variance", "value_mean", "returns_mean", "value_clip_fraction",
                    "clip_fraction", "critic_grad_norm", "critic_lr", "reward_mean", "accuracy", "kl", "entropy",
                    "grad_norm", "first_ratio_min", "time_generate_s", "time_train_s"):
            assert key in m, key
        assert 0 <= m["value_clip_fraction"] <= 1 and 0 <= m["clip_fraction"] <= 1
        assert m["first_ratio_min"] == pytest.approx(1.0, abs=1e-5)


def test_the_critic_exports_as_a_value_model(tiny_run, tmp_path):
    """The critic's checkpoint (checkpoints/critic) exports as HF *ForTokenClassification (num_labels 1, the
    reward-model weights): its per-token output (plus the recorded bias) gives the values the Megatron critic
    computes from the same checkpoint at TP=2, and at the last token the reward-model reading."""
    import transformers

    from megatron_rl.conversion.export import export_checkpoint_to_hf

    critic = tiny_run / "checkpoints" / "critic"
    summary = export_checkpoint_to_hf(critic, tmp_path / "hf")
    assert summary.architecture == "LlamaForTokenClassification"
    ours = torchrun_check("critic_values.py", tmp_path / "values", "--ckpt", str(critic))[0]
    assert ours["head_loaded"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    model = transformers.AutoModelForTokenClassification.from_pretrained(str(tmp_path / "hf"),
                                                                          dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForTokenClassification"
    tokens = torch.tensor(ours["tokens"])
    with torch.no_grad():
        values = model(tokens).logits.squeeze(-1) + config.get("reward_bias", 0.0)
    megatron = torch.tensor(ours["values"])
    for row, length in enumerate(ours["lengths"]):
        assert float((values[row, :length] - megatron[row, :length]).abs().max()) < 1e-4
        assert ours["rewards"][row] == pytest.approx(ours["values"][row][length - 1], abs=1e-5)


# ----- layouts and resume (short runs) -----

def test_tp2_equals_tp1_and_a_preempted_run_resumes_exactly(tmp_path):
    """The first steps at TP=2 with packed micro-batches (parallel.micro_batch_tokens=128: two of the task's
    63-token rows each, for the policy's and the critic's forwards, GAE over rows found by their ids) equal TP=1's padded ones (same data-parallel size 1) on
    the policy and value losses within 1e-3. A run stopped after PPO step 1 and resumed logs exactly the uninterrupted run's metrics: both models,
    their optimizers and the data state come back."""
    whole = tmp_path / "whole"
    _ppo(whole, "cluster.tasks_per_node=1", "generation.offload_optimizer=true")
    _ppo(tmp_path / "tp2", "parallel.tp=2", "parallel.micro_batch_tokens=128")
    for a, b in zip(_steps(whole), _steps(tmp_path / "tp2"), strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a.keys() == b.keys()
        for key in ("loss", "pg_loss", "value_loss", "explained_variance", "kl_reward"):
            if key in a:  # step 1 trains only the critic
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), key
    split = tmp_path / "split"
    _ppo(split, "cluster.tasks_per_node=1", env={"MEGATRON_RL_STOP_AFTER_STEP": "1"}, expect=3)
    assert (split / "checkpoints" / "critic" / "step_00000001").is_dir()
    _ppo(split, "cluster.tasks_per_node=1")
    assert without_measurements(read_metrics(split)) == without_measurements(read_metrics(whole))
    assert [m["critic_warmup"] for m in _steps(whole)] == [1.0, 0.0, 0.0]
    m = _steps(whole)[-1]
    assert m["kl_reward"] > 0 and m["minibatches"] == 4  # 2 mini-batches x 2 epochs
    assert "value_clip_fraction_epoch2" in m and "clip_fraction_epoch2" in m
