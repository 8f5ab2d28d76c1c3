"""A GRPO run scored by a reward model trained with our RM trainer, colocated in the same processes."""

from __future__ import annotations

import json

import pytest

from helpers import read_metrics

pytestmark = pytest.mark.slow


def test_grpo_with_the_tiny_reward_model_raises_its_reward(launch, tmp_path):
    rm_dir = tmp_path / "rm"
    rm = launch("--config", "configs/rm_tiny.yaml", f"run.dir={rm_dir}", "run.steps=100", "data.eval_interval=100",
                "logging.tensorboard=false")
    assert rm.returncode == 0, rm.stdout[-2000:] + rm.stderr[-2000:]
    evals = [m for m in read_metrics(rm_dir) if m.get("phase") == "eval"]
    assert evals[-1]["accuracy"] >= 0.85, evals

    run_dir = tmp_path / "grpo"
    grpo = launch(f"run.dir={run_dir}", "run.steps=40", "logging.tensorboard=false",
                  "algorithm.rewards={rm: 1.0, exact: 1.0}", f"algorithm.reward_model={rm_dir / 'checkpoints'}")
    assert grpo.returncode == 0, grpo.stdout[-2000:] + grpo.stderr[-2000:]
    steps = [m for m in read_metrics(run_dir) if m.get("phase") is None]
    first, last = steps[:5], steps[-5:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "reward_rm") > mean(first, "reward_rm") + 0.4, json.dumps([first, last])
    # No length hacking: answers stay one digit + eos (a 60-step RM without hard negatives taught the policy to
    # write 4-character strings it had never seen; preferences.py now rejects "answer + junk" explicitly).
    assert mean(last, "response_length") < 2.5
