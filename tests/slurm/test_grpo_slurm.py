"""GRPO across two Slurm nodes (TP=2 spanning them) gives the metrics of the same run on local processes."""

from __future__ import annotations

import json

import pytest

from helpers import run_launch

pytestmark = pytest.mark.slurm


def test_two_node_grpo_matches_local(launcher, grpo_two_node_baseline, tmp_path):
    local_args = [arg for arg in launcher.grpo_two_nodes if not arg.startswith("cluster.")]
    local = run_launch(*local_args, "cluster.executor=local", f"run.dir={tmp_path / 'local'}")
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    on_slurm, on_local = [[m for m in launcher.grpo_metrics(run_dir) if m.get("phase") is None]
                          for run_dir in (grpo_two_node_baseline.run_dir, tmp_path / "local")]
    assert len(on_slurm) == len(on_local) == 6
    for a, b in zip(on_local, on_slurm, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"]
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key


def test_async_grpo_with_its_rollout_worker_on_the_other_node_matches_local(launcher, tmp_path):
    """Split placement on Slurm: the trainer on n1, the rollout worker on n2, weights over the gloo bridge (its
    TCPStore on n1), prompts and samples through the shared run folder. At max_staleness=0 every sample comes from
    the current weights, so the run equals the same job on local processes, here even though the first job's
    trainer is SIGKILLed as it takes step 2's samples (the rerun resumes from step 1) and slurmctld is restarted
    while the rerun runs (the job goes on; --wait rides out the outage and reports how the job really ended)."""
    args = ("--config", "configs/grpo_async_tiny.yaml", "run.steps=3", "algorithm.max_staleness=0",
            "algorithm.sft_warmup_steps=2", "algorithm.weight_sync=gloo", "logging.tensorboard=false",
            "checkpoint.save_interval=1")
    on_two_nodes = ("cluster.executor=slurm", "cluster.nodes=2", "cluster.tasks_per_node=1")
    killed = launcher.run(*args, *on_two_nodes, run_dir=tmp_path / "slurm",
                          env={"MEGATRON_RL_FAULT": "kill-during-sample-handoff:2"})
    assert killed.returncode == 1, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "rank 0 on n1: the trainer killed by signal SIGKILL" in killed.stderr, killed.stderr[-3000:]
    started = launcher.start(*args, *on_two_nodes, run_dir=tmp_path / "slurm")
    job_id = started.job_id()
    launcher.cluster.wait_running(job_id, timeout=120)
    launcher.cluster.restart_controller()
    on_slurm = launcher.finish(started)
    assert on_slurm.returncode == 0, on_slurm.stdout[-3000:] + on_slurm.stderr[-3000:]
    assert "resumed from" in on_slurm.stdout and "rank 0 on n1, rank 1 on n2" in on_slurm.stdout
    assert launcher.cluster.wait_sacct_state(job_id) == "COMPLETED"
    ledger_lines = (tmp_path / "slurm" / "rollout" / "consumed.jsonl").read_text().splitlines()
    ledger = [json.loads(line) for line in ledger_lines]
    consumed = [i for entry in ledger for i in entry["prompt_ids"]]
    assert [entry["step"] for entry in ledger] == [1, 2, 3] and len(consumed) == len(set(consumed))
    local = run_launch(*args, f"run.dir={tmp_path / 'local'}")
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    slurm_steps, local_steps = [[m for m in launcher.grpo_metrics(run_dir) if m.get("phase") is None]
                                for run_dir in (tmp_path / "slurm", tmp_path / "local")]
    assert len(slurm_steps) == len(local_steps) == 3
    for a, b in zip(local_steps, slurm_steps, strict=True):
        assert b["staleness_max"] == 0 and b["weight_sync_bytes"] > 0
        for key in ("reward_mean", "loss", "grad_norm", "behav_weight_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
