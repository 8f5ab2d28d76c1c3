"""Config keys of split-placement (asynchronous) GRPO: cluster.rollout_tasks, algorithm.max_staleness,
weight_sync, off_policy_correction and is_cap; their rules, and the job's refusal while the trainer does not
run them yet (launcher/limits.py JOB_LIMITS).

Run: `.venv/bin/python -m pytest tests/test_rollout_config.py -q`
"""

import pytest

from launcher import cli
from launcher.config.loader import load_config
from launcher.config.validate import check_layout
from launcher.errors import ConfigError
from launcher.limits import JOB_LIMITS
from launcher.model_shape import load_model_shape


def test_the_defaults_are_synchronous_colocated_grpo():
    cfg = load_config(None, [])
    assert (cfg.cluster.rollout_tasks, cfg.algorithm.max_staleness) == (0, 0)
    assert (cfg.algorithm.weight_sync, cfg.algorithm.off_policy_correction, cfg.algorithm.is_cap) == \
        ("gloo", "none", 2.0)
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
    (["algorithm.weight_sync=tcp"], "algorithm.weight_sync='tcp' is not valid; use one of: gloo, nccl, files"),
    (["algorithm.off_policy_correction=tis"], "use one of: none, truncated_is, decoupled"),
    (["algorithm.is_cap=0.5"], r"algorithm.is_cap=0.5 must be >= 1"),
])
def test_bad_values_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_nccl_weight_sync_loads_on_gpus():
    cfg = load_config(None, ["cluster.gpus_per_node=2", "algorithm.weight_sync=nccl"])
    assert cfg.algorithm.weight_sync == "nccl"


@pytest.mark.parametrize("overrides", [["cluster.rollout_tasks=1", "algorithm.max_staleness=2",
                                        "algorithm.weight_sync=files"],
                                       ["algorithm.off_policy_correction=decoupled"]])
def test_the_job_refuses_what_the_trainer_does_not_run_yet_in_one_line(overrides, capsys, tmp_path):
    cfg = load_config(None, overrides)  # a legal config ...
    with pytest.raises(ConfigError) as refused:  # ... that the job cannot run yet
        check_layout(cfg, load_model_shape(cfg.model.name))
    key = overrides[0].split("=")[0]
    assert str(refused.value).startswith(f"{overrides[0]}: ") and JOB_LIMITS[key][1] in str(refused.value)
    assert str(refused.value).endswith(f"set {key}={JOB_LIMITS[key][0]}")
    assert cli.main(["--dry-run", f"run.dir={tmp_path}", *overrides]) == 2
    assert capsys.readouterr().err == f"error: {refused.value}\n"
