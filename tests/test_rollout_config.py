"""Config keys of split-placement (asynchronous) GRPO: cluster.rollout_tasks, algorithm.max_staleness,
weight_sync, off_policy_correction and is_cap; their rules, and the job-limit mechanism (megatron_rl/spec/limits.py
JOB_LIMITS) that refuses a key's value a trainer does not run yet.

Run: `.venv/bin/python -m pytest tests/test_rollout_config.py -q`
"""

import pytest

from launcher import cli
from megatron_rl.spec.config.loader import load_config
from megatron_rl.spec.config.validate import check_layout
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import load_model_shape


def test_the_defaults_are_synchronous_colocated_grpo():
    cfg = load_config(None, [])
    assert (cfg.cluster.rollout_tasks, cfg.algorithm.max_staleness) == (0, 0)
    assert (cfg.algorithm.weight_sync, cfg.algorithm.off_policy_correction, cfg.algorithm.is_cap) == \
        ("files", "none", 2.0)
    check_layout(cfg, load_model_shape(cfg.model.name))


@pytest.mark.parametrize("overrides, message", [
    (["cluster.rollout_tasks=-1"], "cluster.rollout_tasks=-1 must be >= 0"),
    (["cluster.rollout_tasks=2"], "cluster.rollout_tasks=2 leaves no training process of the 2 .* give at most 1"),
    (["cluster.tasks_per_node=4", "cluster.rollout_tasks=5"], "cluster.rollout_tasks=5 .* give at most 3"),
    (["algorithm.max_staleness=2"], "algorithm.max_staleness=2 needs cluster.rollout_tasks > 0.* set "
                                    "algorithm.max_staleness=0"),
    (["algorithm.max_staleness=-1"], "algorithm.max_staleness=-1 must be >= 0"),
    (["cluster.rollout_tasks=1", "algorithm.name=dpo"], "algorithm.name=grpo only, not dpo; set "
                                                         "cluster.rollout_tasks=0"),
    (["algorithm.weight_sync=nccl"], "algorithm.weight_sync=nccl needs GPUs.* set algorithm.weight_sync=gloo or files"),
    (["cluster.gpus_per_node=2", "parallel.backend=gloo", "algorithm.weight_sync=nccl"],
     "weight_sync=nccl needs GPUs and the nccl backend"),
    (["parallel.rollout_tp=2"], "parallel.rollout_tp / rollout_pp size the rollout replicas, which need "
                                "cluster.rollout_tasks > 0"),
    (["cluster.tasks_per_node=3", "cluster.rollout_tasks=1", "parallel.tp=2", "parallel.rollout_tp=1",
      "algorithm.weight_sync=gloo"], "parallel.rollout_tp/rollout_pp = 1/1 differ from the training tp/pp = 2/1: .* "
                                     "set algorithm.weight_sync=files"),
    (["parallel.rollout_pp=0"], "parallel.rollout_pp=0 must be"),
    (["algorithm.weight_sync=tcp"], "algorithm.weight_sync='tcp' is not valid; use one of: gloo, nccl, files"),
    (["algorithm.off_policy_correction=tis"], "use one of: none, truncated_is, decoupled"),
    (["algorithm.is_cap=0.5"], r"algorithm.is_cap=0.5 must be >= 1"),
    (["algorithm.off_policy_correction=decoupled"], "algorithm.off_policy_correction=decoupled corrects for samples "
                                                    "of older weights.* set algorithm.off_policy_correction=none"),
    (["cluster.rollout_tasks=1", "algorithm.router_replay=true"],
     "algorithm.router_replay=true with cluster.rollout_tasks=1: .* set algorithm.router_replay=false"),
    (["cluster.rollout_tasks=1", "algorithm.drop_zero_signal_groups=true"],
     "algorithm.drop_zero_signal_groups=true draws more prompts inside a step.* set it false"),
    (["cluster.tasks_per_node=4", "cluster.rollout_tasks=2", "parallel.ep=2"],
     "parallel.ep=2 with cluster.rollout_tasks=2: .* set cluster.rollout_tasks=0 or parallel.ep=1"),
])
def test_bad_values_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_nccl_weight_sync_loads_on_gpus():
    cfg = load_config(None, ["cluster.gpus_per_node=2", "algorithm.weight_sync=nccl"])
    assert cfg.algorithm.weight_sync == "nccl"
    split = load_config(None, ["cluster.gpus_per_node=4", "cluster.tasks_per_node=4", "cluster.rollout_tasks=2",
                               "algorithm.weight_sync=nccl"])
    assert check_layout(split, load_model_shape(split.model.name)) == 2


@pytest.mark.parametrize("weight_sync", ["files", "gloo"])
def test_split_placement_with_either_weight_sync_passes_the_layout_check(weight_sync):
    cfg = load_config(None, ["cluster.rollout_tasks=1", "algorithm.max_staleness=2", f"algorithm.weight_sync={weight_sync}",
                             "algorithm.off_policy_correction=decoupled"])
    assert check_layout(cfg, load_model_shape(cfg.model.name)) == 1  # dp over the 1 training process


def test_a_job_limit_refuses_its_key_in_one_line(monkeypatch, capsys, tmp_path):
    from megatron_rl.spec import limits

    monkeypatch.setattr(limits, "JOB_LIMITS", {"algorithm.is_cap": (2.0, "the trainer reads only the default")})
    cfg = load_config(None, ["algorithm.is_cap=3"])
    with pytest.raises(ConfigError) as refused:
        check_layout(cfg, load_model_shape(cfg.model.name))
    assert str(refused.value) == ("algorithm.is_cap=3.0: the trainer reads only the default; "
                                  "set algorithm.is_cap=2.0")
    assert cli.main(["--dry-run", f"run.dir={tmp_path}", "algorithm.is_cap=3"]) == 2
    assert capsys.readouterr().err == f"error: {refused.value}\n"
