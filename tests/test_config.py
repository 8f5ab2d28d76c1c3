"""Config schema, loader and the launch-time checks: bad input fails before anything starts (exit 2, one line)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_rl.spec.config import JobConfig, load_config, to_yaml
from megatron_rl.spec.config.validate import check_layout
from megatron_rl.spec.errors import ConfigError, did_you_mean
from megatron_rl.spec.model_shape import load_model_shape

from helpers import REPO_ROOT

SHIPPED = sorted(p for p in (REPO_ROOT / "configs").glob("*.yaml") if not p.name.startswith("pipeline_"))
"""The shipped job configs (pipeline files list stages of them: tests/test_pipeline.py)."""


def test_defaults_are_the_tiny_local_job():
    cfg = load_config()
    assert isinstance(cfg, JobConfig)
    assert cfg.model.name == "tiny-cpu"
    assert cfg.cluster.executor == "local" and cfg.cluster.world_size == 2


def test_yaml_then_overrides_merge_in_order(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("run:\n  steps: 7\n  seed: 3\nparallel:\n  tp: 2\n")
    cfg = load_config(path, ["run.steps=9", "cluster.setup=[module load cuda, source env.sh]"])
    assert (cfg.run.steps, cfg.run.seed, cfg.parallel.tp) == (9, 3, 2)
    assert cfg.cluster.setup == ["module load cuda", "source env.sh"]


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["run.steps=4", "algorithm.rewards={math: 0.5, format: 0.5}"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def _required_keys(path: Path) -> list[str]:
    """Keys a shipped config leaves for the user to set ('???')."""
    from omegaconf import OmegaConf

    return sorted(OmegaConf.missing_keys(OmegaConf.load(path)))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_loads_and_its_layout_is_legal(path):
    required = _required_keys(path)
    if required:
        with pytest.raises(ConfigError, match=f"{required[0]}.* must be set"):
            load_config(path)
    cfg = load_config(path, [f"{key}=/user/path" for key in required])
    shape = load_model_shape(cfg.model.name)
    if cfg.parallel.auto:
        from launcher.job import apply_plan
        cfg, _ = apply_plan(cfg, shape)
    assert check_layout(cfg, shape) >= 1


@pytest.mark.parametrize("overrides, message", [
    (["modle.name=x"], "did you mean 'model'"),
    (["run.stpes=3"], "did you mean 'run.steps'"),
    (["run.steps=abc"], "run.steps"),
    (["parallel.tp=0"], "parallel.tp=0 must be positive"),
    (["run.steps=-3"], "run.steps=-3 must be positive"),
    (["cluster.executor=kubernetes"], "cluster.executor='kubernetes' is not valid"),
    (["cluster.nodes=2", "cluster.executor=local"], "local runs use one node"),
    (["algorithm.kl_estimator=k4"], "use one of: k1, k2, k3"),
    (["generation.max_concurrent=0"], "generation.max_concurrent=0 must be positive"),
    (["algorithm.weight_sync_bucket_mib=0"], "algorithm.weight_sync_bucket_mib=0 must be positive"),
    (["runtime.moe_grouped_gemm=fast"], "runtime.moe_grouped_gemm='fast' is not valid; use true, false or auto"),
    (["algorithm.name=sft", "algorithm.router_replay=true"], "algorithm.router_replay=true replays the experts of GRPO"),
    (["parallel.sequence_parallel=true"], "needs parallel.tp > 1"),
    (["notakeyvalue"], "must look like section.key=value"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_unknown_cluster_key_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["cluster.partitoin=gpu"])
    text = str(err.value)
    assert "did you mean 'cluster.partition'" in text
    for key in ("partition", "account", "qos", "job_name", "time", "container_image"):
        assert key in text


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml.*not valid YAML"):
        load_config(bad)
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump({"model": {"nmae": "tiny-cpu"}}))
    with pytest.raises(ConfigError, match=r"nested.yaml \(did you mean 'model.name'"):
        load_config(nested)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("spec", ["grpo_tiny", "grpo_tiny.yaml"])
def test_a_shipped_config_loads_by_name_from_any_folder(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(spec) == load_config(REPO_ROOT / "configs" / "grpo_tiny.yaml")


def test_a_real_file_wins_over_the_shipped_config_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "grpo_tiny.yaml").write_text("run:\n  steps: 3\n")
    assert load_config("grpo_tiny.yaml").run.steps == 3
    assert load_config("grpo_tiny").run.steps == load_config(REPO_ROOT / "configs" / "grpo_tiny.yaml").run.steps != 3


def test_an_unknown_config_name_lists_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config("grpo_tinny")
    text = str(err.value)
    assert "config file grpo_tinny not found" in text and "(did you mean 'grpo_tiny'?)" in text
    every = sorted((REPO_ROOT / "configs").glob("*.yaml"))  # pipeline files are found by name too
    assert text.endswith("shipped configs: " + ", ".join(p.stem for p in every)) and "\n" not in text
    with pytest.raises(ConfigError, match="check the path"):
        load_config("elsewhere/grpo_tiny.yaml")


def test_did_you_mean_suggests_only_close_options():
    assert did_you_mean("stpes", ["seed", "steps"]) == " (did you mean 'steps'?)"
    assert did_you_mean("stpes", ["steps"], prefix="run.") == " (did you mean 'run.steps'?)"
    assert did_you_mean("b200", ["b200-180gb"]) == ""
    assert did_you_mean("b200", ["b200-180gb"], cutoff=0.5) == " (did you mean 'b200-180gb'?)"


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=3", "cluster.tasks_per_node=3"], "parallel.tp=3 does not divide the 4 attention heads"),
    (["parallel.tp=3"], "parallel.tp*pp*cp = 3*1*1 = 3 does not divide the world size 2"),
    (["parallel.tp=4", "cluster.tasks_per_node=4"], "does not divide the 2 query groups"),
    (["parallel.pp=3", "cluster.tasks_per_node=3"], "2 layers over parallel.pp=3 is not legal: num_layers 2 not "
                                                     "divisible by pp=3"),
    (["parallel.tp=2", "parallel.pp=2"], "tp*pp*cp = 2*2*1 = 4 does not divide the world size 2"),
    (["parallel.cp=2", "parallel.tp=2"], "does not divide the world size 2"),
    (["parallel.ep=2"], "has no experts"),
    (["algorithm.router_replay=true"], "algorithm.router_replay=true needs an MoE model and tiny-cpu is dense"),
    (["algorithm.name=pretrain", "algorithm.global_batch_size=3", "parallel.micro_batch_size=1"],
     "not divisible by parallel.micro_batch_size*dp"),
    (["algorithm.prompts_per_step=3", "algorithm.group_size=1", "algorithm.global_batch_size=1",
      "parallel.micro_batch_size=1"], "not divisible by parallel.micro_batch_size*dp"),
    (["generation.max_new_tokens=128"], "generation.max_new_tokens=128 leaves no room for a prompt in tiny-cpu's 128 "
                                        "positions (max_position_embeddings); give at most 127"),
    (["algorithm.name=sft", "data.max_length=129"], "data.max_length=129 exceeds tiny-cpu's 128 positions"),
    (["environment.name=calculator", "environment.max_episode_tokens=129"],
     "environment.max_episode_tokens=129 exceeds tiny-cpu's 128 positions (max_position_embeddings); give at most 128"),
])
def test_layouts_that_cannot_run_are_rejected(overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as err:
        check_layout(cfg, load_model_shape(cfg.model.name))
    assert message in str(err.value)


@pytest.mark.parametrize("args, fragment", [
    (["run.stpes=3"], "did you mean 'run.steps'"),
    (["run.steps=abc"], "could not be converted to Integer"),
    (["--config", "no/such/file.yaml"], "config file no/such/file.yaml not found"),
    (["--config", "grpo_tinny"], "(did you mean 'grpo_tiny'?); shipped configs: dpo_tiny, grpo_arabic_tiny, grpo_async_tiny, grpo_calculator_tiny, grpo_cispo_tiny"),
    (["parallel.tp=3", "cluster.tasks_per_node=3"], "does not divide the 4 attention heads"),
    (["parallel.pp=4", "cluster.tasks_per_node=4"], "2 layers over parallel.pp=4 is not legal"),
    (["parallel.tp=2", "parallel.pp=2", "cluster.executor=local"], "does not divide the world size 2"),
    (["cluster.tasks_per_node=0"], "cluster.tasks_per_node=0 must be positive"),
    (["algorithm.router_replay=true"], "needs an MoE model and tiny-cpu is dense; set it to false"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["generation.max_new_tokens=10000000", "--dry-run"], "generation.max_new_tokens=10000000 leaves no room for a "
                                                          "prompt in tiny-cpu's 128 positions"),
])
def test_cli_rejects_bad_input_with_one_line_and_exit_2(launch, tmp_path, args, fragment):
    result = launch(*args, f"run.dir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "run").exists(), "nothing may start or be written for bad input"


def test_plan_refuses_a_length_beyond_the_models_positions_as_launch_does(capsys):
    """The launch check's length rule (spec/config/validate.check_lengths) in ``launch.py plan``: one line, exit 2,
    instead of a search whose KV memory never fits."""
    from launcher import cli

    assert cli.main(["plan", "generation.max_new_tokens=10000000"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: generation.max_new_tokens=10000000 leaves no room for a prompt in tiny-cpu's 128 positions "
                   "(max_position_embeddings); give at most 127 (the longest prompt plus max_new_tokens must fit)\n")


def test_a_missing_input_path_is_refused_at_launch_with_the_command_that_builds_it(monkeypatch, tmp_path, capsys):
    """grpo_lora_tiny on a fresh clone: its SFT base is not built yet. A local launch refuses it in one line (exit
    2, nothing started) and quotes the config's own recipe for it; any other missing input names its key. (A dry
    run shows what would run before the inputs are there.)"""
    from launcher import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["--config", "grpo_lora_tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.init_from=runs/sft_first_digit_tiny/checkpoints does not exist" in err
    assert "build it first: python launch.py --config configs/sft_tiny.yaml data.task=first_digit" in err
    assert cli.main([f"data.eval_path={tmp_path / 'none.jsonl'}"]) == 2
    assert "data.eval_path=" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_dry_run_prints_config_and_processes_and_starts_nothing(launch, tmp_path):
    run_dir = tmp_path / "dry run"
    result = launch("cluster.executor=local", "--dry-run", f"run.dir={run_dir}", "run.steps=3", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "# resolved config" in result.stdout and "steps: 3" in result.stdout
    assert result.stdout.count("-m megatron_rl.main") == 2
    assert "RANK=0" in result.stdout and "RANK=1" in result.stdout
    assert not run_dir.exists()


def test_help_lists_subcommands(launch):
    result = launch("--help", timeout=60)
    assert result.returncode == 0
    for word in ("plan", "convert", "--dry-run", "--config", "key=value"):
        assert word in result.stdout


def test_launcher_path_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, launcher.cli, launcher.job, launcher.executors.local, launcher.planner, megatron_rl.spec.config;"
            "bad=[m for m in ('torch','megatron','transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
