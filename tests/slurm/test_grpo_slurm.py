"""GRPO across two Slurm nodes (TP=2 spanning them) gives the metrics of the same run on local processes."""

from __future__ import annotations

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
