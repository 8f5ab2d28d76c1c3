"""GRPO across two Slurm nodes (TP=2 spanning them) gives the metrics of the same run on local processes."""

from __future__ import annotations

import pytest

from helpers import read_metrics, run_launch

pytestmark = pytest.mark.slurm

GRPO = ("logging.tensorboard=false", "algorithm.sft_warmup_steps=5", "algorithm.prompts_per_step=4",
        "algorithm.group_size=4", "algorithm.global_batch_size=8", "parallel.micro_batch_size=4", "run.steps=4",
        "parallel.tp=2")
TIMING = ("step_time_s", "time_generate_s", "time_score_s", "time_train_s", "generate_tokens_per_s",
          "train_tokens_per_s")


def _train_steps(run_dir):
    return [{k: v for k, v in m.items() if k not in TIMING} for m in read_metrics(run_dir) if m.get("phase") is None]


def test_two_node_grpo_matches_local(launcher, tmp_path):
    slurm = launcher.run(*GRPO, "cluster.executor=slurm", "cluster.nodes=2", "cluster.tasks_per_node=1",
                         run_dir=tmp_path / "slurm", timeout=400)
    assert slurm.returncode == 0, slurm.stdout[-3000:] + slurm.stderr[-3000:]
    local = run_launch(*GRPO, "cluster.executor=local", f"run.dir={tmp_path / 'local'}")
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    on_slurm, on_local = _train_steps(tmp_path / "slurm"), _train_steps(tmp_path / "local")
    assert len(on_slurm) == len(on_local) == 4
    for a, b in zip(on_local, on_slurm, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"]
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
