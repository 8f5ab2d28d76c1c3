"""Plan = launch: ``launch.py plan`` plans the job that ``launch.py`` launches (one sizing call,
launcher.job.plan_job), keeps the parallel.* keys the user gives, and holds and reports the trainer limits that
check_layout refuses with the same reasons. Everything runs in-process through launcher.cli.main (no torch).

Run: .venv/bin/python -m pytest tests/test_plan_launch.py -q
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from launcher import cli
from megatron_rl.spec.config import load_config
from megatron_rl.spec.config.loader import find_config, given_keys
from megatron_rl.spec.parallel import ParallelDims
from megatron_rl.spec.config.validate import check_layout
from megatron_rl.spec.errors import ConfigError
from launcher.job import apply_plan, prepare
from megatron_rl.spec.limits import TRAINER_LIMITS, trainer_limits
from megatron_rl.spec.model_shape import load_model_shape
from launcher.planner import PLANNED_KEYS, parse_layout

PATHS = ["model.init_from=/ckpt", "model.tokenizer=/tok", "data.train_path=/data.jsonl"]
"""The '???' keys of the shipped cluster configs: launch needs them, plan does not."""
KIMI_K2 = Path(__file__).parent / "data" / "kimi-k2-config.json"
"""A Kimi-K2-shaped HF config.json (DeepSeek-V3 architecture, 1.03T parameters, 32.9B active)."""
H200 = ["model.name=llama-3.1-405b", "cluster.gpu_type=h200-141gb", "cluster.gpus_per_node=8",
        "cluster.tasks_per_node=8"]
JOBS = {
    "grpo-llama70b-8-nodes": ("grpo_llama70b", []),
    "grpo-llama405b-32-nodes-h200": ("grpo_llama70b", [*H200, "cluster.nodes=32"]),
    "grpo-llama405b-64-nodes-h200": ("grpo_llama70b", [*H200, "cluster.nodes=64"]),
    "grpo-qwen3-235b-16-nodes-h200": ("grpo_llama70b", [*H200, "model.name=qwen3-235b-a22b", "cluster.nodes=16"]),
    "rm-qwen3-235b-16-nodes-h200": ("grpo_llama70b", [*H200, "model.name=qwen3-235b-a22b", "cluster.nodes=16",
                                                      "algorithm.name=rm"]),
    "grpo-deepseek-v3-32-nodes-h200": ("grpo_llama70b", [*H200, "model.name=deepseek-v3", "cluster.nodes=32"]),
    "grpo-kimi-k2-shaped-64-nodes-h200": ("grpo_llama70b", [*H200, f"model.name={KIMI_K2}", "cluster.nodes=64"]),
    "grpo-shipped-llama405b": ("grpo_llama405b", []),
    "grpo-shipped-qwen3-235b": ("grpo_qwen3_235b", []),
    "rm-shipped-qwen3-235b": ("rm_qwen3_235b", []),
    "grpo-shipped-deepseek-v3": ("grpo_deepseek_v3", []),
    "grpo-shipped-llama8b": ("grpo_llama8b", []),
    # NVIDIA's published pipeline layouts (#34): DeepSeek-V3 at PP8 x VPP4 and PP16, the 405B at PP16 x VPP8
    "grpo-shipped-deepseek-v3-pp8-vpp4-layout": ("grpo_deepseek_v3", ["parallel.pp=8",
                                                                      "parallel.pipeline_layout=Et*3|(tt|)*29,m|L"]),
    "grpo-shipped-deepseek-v3-pp16-layout": ("grpo_deepseek_v3", ["parallel.pp=16",
                                                                  "parallel.pipeline_layout=Et*4|(t*4|)*14,tmL"]),
    "grpo-shipped-llama405b-pp16-vpp8-layout": ("grpo_llama405b", ["parallel.pp=16",
                                                                   "parallel.pipeline_layout=E|(t|)*126,L"]),
    "pretrain-llama70b-4-nodes": ("grpo_llama70b", ["algorithm.name=pretrain", "cluster.nodes=4"]),
    "sft-llama70b-4-nodes-given-pp8": ("grpo_llama70b", ["algorithm.name=sft", "cluster.nodes=4", "parallel.pp=8"]),
    "rm-tiny": ("rm_tiny", ["parallel.auto=true"]),
    "grpo-tiny-default-job": (None, ["parallel.auto=true"]),
}


def _config_args(config: str | None) -> list[str]:
    return ["--config", config] if config else []


def _plan(capsys, *args: str) -> dict:
    assert cli.main(["plan", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _dry_run_parallel(capsys, tmp_path, config: str | None, overrides: list[str]) -> dict:
    """The resolved parallel: section that `launch.py ... --dry-run` prints."""
    args = [*_config_args(config), *overrides, *PATHS, f"run.dir={tmp_path / 'run'}", "--dry-run"]
    assert cli.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "# layout chosen by the planner" in out
    return yaml.safe_load(out.split("# resolved config\n", 1)[1].split("\n# layout chosen", 1)[0])["parallel"]


def _as_layout(parallel: dict) -> dict:
    """The planner's layout keys of a parallel: section (vpp null is plain 1F1B: the planner's vpp=1)."""
    return {key: (parallel[key] or 1) if key == "vpp" else parallel[key] for key in PLANNED_KEYS}


@pytest.mark.parametrize("job", JOBS, ids=list(JOBS))
def test_plan_picks_the_layout_that_launch_resolves(capsys, tmp_path, job):
    config, overrides = JOBS[job]
    planned = _plan(capsys, *_config_args(config), *overrides)
    assert planned.pop("assumed") == {}  # a config (or the built-in job) leaves nothing to assume
    launched = _dry_run_parallel(capsys, tmp_path, config, overrides)
    assert launched["auto"] is True
    assert _as_layout(launched) == {key: planned["layout"][key] for key in PLANNED_KEYS}
    # one sizing call with the same inputs: prepare's PlanResult is the one plan prints (search timing aside)
    cfg_args = (config, [*overrides, *PATHS])
    job_plan = prepare(load_config(*cfg_args), given=given_keys(*cfg_args)).plan.to_dict()
    assert {**job_plan, "search": None} == {**planned, "search": None}


def test_the_grpo_sizing_comes_from_the_config(capsys):
    planned = _plan(capsys, "--config", "grpo_llama70b")
    assert planned["workload"]["grpo"] == {"rollout_batch_size": 128 * 16, "max_prompt_length": 4096 // 4,
                                           "max_response_length": 2048, "mean_response_length": 1024.0,
                                           "samples_per_prompt": 16, "generation_concurrency": None,
                                           "kv_memory_gib": None, "kv_block_tokens": 256, "cuda_graphs": False,
                                           "reference_model": True, "recompute_old_logprobs": True,
                                           "reward_model": False, "train_seq_length": 1024 + 2048,
                                           "teacher_params": 0.0, "teacher_offloaded": True,
                                           "optimizer_steps": 128 * 16 // 512,
                                           "kv_cache_released_for_training": True,
                                           "optimizer_offloaded_for_generation": True}
    kept = _plan(capsys, "--config", "grpo_llama70b", "generation.offload_optimizer=false", "algorithm.kl_coef=0",
                 "generation.cuda_graphs=true")
    assert kept["workload"]["grpo"]["optimizer_offloaded_for_generation"] is False
    assert kept["workload"]["grpo"]["cuda_graphs"] is True
    assert kept["workload"]["grpo"]["reference_model"] is False
    assert kept["memory_gib"]["reference_model"] == 0


@pytest.mark.parametrize("key, check", [("parallel.vpp=2", lambda p: p["vpp"] == 2 and p["pp"] > 1),
                                        ("parallel.sequence_parallel=true",
                                         lambda p: p["sequence_parallel"] and p["tp"] > 1)])
def test_keys_that_need_other_sizes_are_completed_by_the_planner(capsys, tmp_path, key, check):
    """Under parallel.auto, vpp without pp (and sp without tp) is kept and the planner picks a pp (tp) for it, in
    plan and launch alike; without auto the schema refuses it."""
    planned = _plan(capsys, "--config", "grpo_llama70b", key)
    assert check(planned["layout"])
    assert check(_dry_run_parallel(capsys, tmp_path, "grpo_llama70b", [key]))
    with pytest.raises(ConfigError, match="needs parallel"):
        load_config(None, [key])


def test_generation_max_concurrent_bounds_the_planned_kv_cache(capsys):
    """generation.max_concurrent reaches the planner, which sizes the KV pool it picks for that many sequences at
    once per rollout worker, not for the worker's whole share of the rollout."""
    whole = _plan(capsys, "--config", "grpo_llama70b")
    held = [f"parallel.{key}={whole['layout'][key]}" for key in ("tp", "pp", "vpp", "cp", "ep")]
    capped = _plan(capsys, "--config", "grpo_llama70b", "generation.max_concurrent=16", *held)
    assert capped["workload"]["grpo"]["generation_concurrency"] == 16
    layout = whole["layout"]
    per_worker = 128 * 16 / (layout["dp"] * layout["cp"])
    assert per_worker > 16
    assert capped["layout"] == whole["layout"]
    ratio = capped["memory_gib"]["kv_cache_generating"] / whole["memory_gib"]["kv_cache_generating"]
    assert ratio == pytest.approx(16 / per_worker, rel=1e-2)  # GiB rounded to 3 decimals


def _dry_run_generation(capsys, tmp_path, config: str | None, overrides: list[str]) -> dict:
    args = [*_config_args(config), *overrides, *PATHS, f"run.dir={tmp_path / 'run'}", "--dry-run"]
    assert cli.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    return yaml.safe_load(out.split("# resolved config\n", 1)[1].split("\n# layout chosen", 1)[0])["generation"]


NEMO_RL_8B = ["model.name=llama-3.1-8b", "cluster.nodes=2", "generation.max_new_tokens=3584",
              "generation.mean_new_tokens=1060"]
"""The rollout issue's Llama-3.1-8B job from the 70B config: NeMo RL's 16 H100, 128 prompts x 16, prompts of 1,024
and responses up to 3,584 tokens, 1,060 on average."""
NEMO_RL_32B = ["model.name=qwen3-32b", "cluster.nodes=4", "generation.max_new_tokens=3072",
               "generation.mean_new_tokens=2950"]
"""The planner issue's Qwen3-32B job: NeMo RL's 32 H100, sequences up to 4,096 tokens, 3,206 on average."""


@pytest.mark.parametrize("config, overrides, gpus", [("grpo_llama8b", [], 16), ("grpo_llama70b", NEMO_RL_8B, 16),
                                                     ("grpo_llama70b", NEMO_RL_32B, 32)],
                         ids=["llama8b-shipped", "llama8b-issue", "qwen3-32b"])
def test_grpo_at_nemo_rls_settings_plans_on_their_gpus_with_the_kv_pool_it_picks(capsys, tmp_path, config,
                                                                                 overrides, gpus):
    """The KV pool follows the tokens the rows hold, so NeMo RL's Llama-3.1-8B (16 H100) and Qwen3-32B (32 H100)
    GRPO jobs fit without a hand cap; launch writes the pool the plan shows into generation.kv_memory_gib. The
    cache the old engine allocated (every completion at its longest) does not fit there."""
    planned = _plan(capsys, "--config", config, *overrides)
    assert planned["fits"] and planned["workload"]["gpus"] == gpus
    pool = planned["kv_pool"]
    assert pool["source"] == "chosen" and pool["key"] == "generation.kv_memory_gib"
    assert pool["gib"] == pytest.approx(planned["memory_gib"]["kv_cache_generating"], abs=0.01)
    share = 2048 / (planned["layout"]["dp"] * planned["layout"]["cp"])
    assert pool["rows_at_once"] == share  # every row of the rank decodes at once
    launched = _dry_run_generation(capsys, tmp_path, config, overrides)
    assert launched["kv_memory_gib"] == pool["gib"]
    every_row = share * (1024 + launched["max_new_tokens"]) / pool["tokens"] * pool["gib"]
    assert every_row > 1.3 * pool["gib"]
    assert cli.main(["plan", "--config", config, *overrides, f"generation.kv_memory_gib={every_row:.2f}",
                     *(f"parallel.{k}={planned['layout'][k]}" for k in ("tp", "pp", "cp"))]) == 3
    assert "no layout" in capsys.readouterr().err


def test_deepseek_v3_plans_a_pool_of_latents_and_launch_writes_it(capsys, tmp_path):
    """MLA's blocks hold the latent (kv_lora_rank 512 + rope 64 per token and layer, bf16, on every TP rank): for
    the shipped DeepSeek-V3 config, which sets no cap, the planner picks the pool and launch writes it; a given
    cap bounds the rows decoding at once, not the key launch writes."""
    planned = _plan(capsys, "--config", "grpo_deepseek_v3")
    pool = planned["kv_pool"]
    assert pool["source"] == "chosen" and pool["key"] == "generation.kv_memory_gib"
    lay = planned["layout"]
    dims = ParallelDims(world_size=lay["pp"], pp=lay["pp"], vpp=lay["vpp"], pipeline_layout=lay["pipeline_layout"],
                        first_stage_layers=lay["first_stage_layers"], last_stage_layers=lay["last_stage_layers"],
                        account_for_embedding=lay["account_for_embedding"], account_for_loss=lay["account_for_loss"])
    counts = dims.stage_layers(61)
    most_layers = max(sum(counts[rank::lay["pp"]]) for rank in range(lay["pp"]))  # the fullest pipeline rank
    assert pool["gib"] * 2**30 / pool["tokens"] == pytest.approx((512 + 64) * 2 * most_layers, rel=0.01)
    assert _dry_run_generation(capsys, tmp_path, "grpo_deepseek_v3", [])["kv_memory_gib"] == pool["gib"]
    capped = _plan(capsys, "--config", "grpo_deepseek_v3", "generation.max_concurrent=4")["kv_pool"]
    assert capped["source"] == "chosen" and capped["rows_at_once"] == 4
    launched = _dry_run_generation(capsys, tmp_path, "grpo_deepseek_v3", ["generation.max_concurrent=4"])
    assert launched["max_concurrent"] == 4 and launched["kv_memory_gib"] == capped["gib"]


def test_a_cpu_job_keeps_the_engines_default_pool(capsys, tmp_path):
    """On CPU jobs the GPU memory model does not apply: nothing is written, and the plan says so."""
    planned = _plan(capsys, "parallel.auto=true")
    assert planned["kv_pool"]["source"] == "every row"
    assert _dry_run_generation(capsys, tmp_path, None, ["parallel.auto=true"])["kv_memory_gib"] is None


@pytest.mark.parametrize("where", ["command line", "yaml file", "--layout"])
def test_a_given_parallel_key_is_kept_by_plan_and_launch(capsys, tmp_path, where):
    free = _plan(capsys, "--config", "grpo_llama70b")["layout"]
    tp = 8 if free["tp"] != 8 else 4  # keeping it is a change
    assert free["micro_batch_size"] != 32  # mbs's default is free
    config, overrides = "grpo_llama70b", [f"parallel.tp={tp}"]
    if where == "yaml file":
        body = yaml.safe_load(find_config("grpo_llama70b").read_text())
        config, overrides = tmp_path / "job.yaml", []
        config.write_text(yaml.safe_dump({**body, "parallel": {"auto": True, "tp": tp}}))
    plan_args = ["--layout", f"tp={tp}"] if where == "--layout" else overrides
    planned = _plan(capsys, "--config", str(config), *plan_args)
    assert planned["layout"]["tp"] == tp and planned["constraints"] == {"tp": tp}
    assert _dry_run_parallel(capsys, tmp_path, str(config), overrides)["tp"] == tp


def test_given_keys_are_the_files_and_the_overrides_not_the_defaults(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("parallel:\n  auto: true\n  pp: 4\nmodel:\n  tokenizer: ???\n")
    assert given_keys(config, ["parallel.tp=8", "run.steps=3"]) == {"parallel.auto", "parallel.pp", "parallel.tp",
                                                                    "run.steps"}
    assert given_keys() == frozenset()


def test_shorthand_flags_set_the_config_keys(capsys):
    flags = _plan(capsys, "--model", "llama-3.3-70b", "--gpus", "64", "--mode", "grpo", "algorithm.group_size=16",
                  "--seq-len", "4096", "--global-batch-size", "256", "--gpu-type", "h200-141gb")
    keys = _plan(capsys, "model.name=llama-3.3-70b", "cluster.nodes=8", "cluster.tasks_per_node=8",
                 "cluster.gpus_per_node=8", "cluster.executor=slurm", "algorithm.name=grpo", "algorithm.group_size=16",
                 "model.seq_length=4096", "algorithm.global_batch_size=256", "cluster.gpu_type=h200-141gb")
    assert {**flags, "search": None} == {**keys, "search": None}
    assert flags["workload"]["gpus"] == 64 and flags["workload"]["grpo"]["rollout_batch_size"] == 16 * 16
    # below one node: one node of that many GPUs; sft plans as next-token training
    small = _plan(capsys, "--model", "tiny-cpu", "--gpus", "4", "--mode", "sft")
    assert small["workload"]["gpus"] == 4 and small["workload"]["mode"] == "pretrain"
    # with --config the file gives the defaults and flags override them
    assert _plan(capsys, "--config", "grpo_llama70b", "--gpus", "128")["workload"]["gpus"] == 128


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny-cpu", "--gpus", "12"], "--gpus 12 does not split into whole nodes of 8 GPUs "
                                             "(the node size of h100-80gb); give a multiple of 8, or fewer than 8"),
    (["--model", "tiny-cpu", "--gpus", "8", "cluster.gpus_per_node=4"], "cluster.gpus_per_node is given twice, by "
                                                                         "--gpus and by cluster.gpus_per_node=4"),
    (["--model", "tiny-cpu", "parallel.tpp=2"], "unknown config key 'parallel.tpp' in the command line (did you mean "
                                                "'parallel.tp'?)"),
    (["--model", "tiny-cpu", "--layout", "tpp=2"], "--layout: unknown field 'tpp' (did you mean 'tp'?)"),
    (["--model", "tiny-cpu", "model.name=tiny-cpu-moe"], "model.name is given twice, by --model and by "
                                                         "model.name=tiny-cpu-moe"),
    (["--gpus", "16", "cluster.nodes=2"], "cluster.nodes is given twice, by --gpus and by cluster.nodes=2"),
    (["--config", "grpo_llama70b", "parallel.tp=3"], "parallel.tp=3 does not divide the 64 attention heads of llama-3.3-70b"),
    (["--config", "grpo_llama70b", "--layout", "tp=8,tp=4"], "--layout: tp is given twice; give it once"),
    (["--config", "grpo_llama70b", "--layout", "tp="], "--layout tp=: must be an integer"),
    (["--config", "grpo_llama70b", "--layout", "pp"], "--layout: 'pp' is not key=value"),
    (["--config", "grpo_llama70b", "--layout", "recompute=some"], "--layout recompute=some: use one of"),
    (["--config", "grpo_llama405b", "--layout", "first_stage_layers=500"],
     "parallel.first_stage_layers=500: no pp gives a legal pipeline split of 126 layers"),
])
def test_bad_plan_input_is_one_line_and_exit_2(capsys, args, message):
    assert cli.main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err, captured.err


def test_gpus_come_in_nodes_of_the_config_files_size(capsys, tmp_path):
    config = tmp_path / "four.yaml"
    config.write_text("cluster: {executor: slurm, gpus_per_node: 4, tasks_per_node: 4}\n")
    assert _plan(capsys, "--config", str(config), "--gpus", "8")["workload"]["gpus"] == 8
    assert cli.main(["plan", "--config", str(config), "--gpus", "6"]) == 2
    assert "--gpus 6 does not split into whole nodes of 4 GPUs (cluster.gpus_per_node of the config)" in (
        capsys.readouterr().err)


def test_nothing_fitting_names_the_smallest_gpu_count_in_plan_and_the_node_count_in_launch(capsys, tmp_path):
    job = ["--config", "grpo_llama70b", "model.name=llama-3.1-405b", "cluster.nodes=1"]
    assert cli.main(["plan", *job, "--json"]) == 3
    captured = capsys.readouterr()
    smallest = json.loads(captured.out)["smallest_gpus"]
    assert smallest and f"the smallest GPU count that fits is {smallest} x h100-80gb" in captured.err
    assert cli.main([*job, *PATHS, f"run.dir={tmp_path}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"set cluster.nodes={-(-smallest // 8)}" in err


# ---------------- trainer limits: held by the planner, refused by check_layout, one reason ----------------
CONTRARY = {  # per limit key: a job that sets another value and is legal apart from the limit
    "cp": ("tiny-cpu", ["parallel.cp=2"]),
}


@pytest.mark.parametrize("limit", TRAINER_LIMITS, ids=[f"{limit.key}-{'-'.join(limit.algorithms)}"
                                                     for limit in TRAINER_LIMITS])
def test_each_limit_is_reported_by_plan_and_refused_by_check_layout_with_the_same_reason(capsys, limit):
    model, contrary = CONTRARY[limit.key]
    job = [f"model.name={model}", f"algorithm.name={limit.algorithms[0]}", "algorithm.global_batch_size=64",
           "algorithm.prompts_per_step=8"]
    assert trainer_limits(load_model_shape(model), limit.algorithms[0])[limit.key] == (limit.value, limit.reason)
    planned = _plan(capsys, *job)
    assert planned["limits"][limit.key] == [limit.value, limit.reason]
    if limit.key in planned["layout"]:
        assert planned["layout"][limit.key] == limit.value
    assert cli.main(["plan", *job]) == 0 and limit.reason in capsys.readouterr().out  # explain() lists it
    # check_layout (parallel.auto=false) refuses another value; plan refuses it as a given key: same line
    cfg = load_config(None, [*job, *contrary])
    with pytest.raises(ConfigError) as refused:
        check_layout(cfg, load_model_shape(model))
    assert limit.reason in str(refused.value)
    assert cli.main(["plan", *job, *contrary]) == 2
    assert capsys.readouterr().err == f"error: {refused.value}\n"


def test_a_limit_that_does_not_apply_is_not_held(capsys):
    # GRPO holds sequence parallelism off; pretraining does not, and picks it at tp > 1
    planned = _plan(capsys, "--model", "llama-3.3-70b", "--gpus", "64", "--global-batch-size", "128")
    assert "sequence_parallel" not in planned["limits"] and planned["layout"]["sequence_parallel"] is True
    assert planned["limits"] == {}  # pretraining runs every layout the planner can pick


def test_moe_plans_write_the_expert_tensor_parallel_size_and_keep_a_given_one(capsys):
    """Left unset, the planner takes ParallelDims' etp (1 under EP, else tp) and the launched job gets exactly that;
    a given etp is kept, ep > 1 with etp = tp included (a layout the job runs), and planned with its expert shards."""
    job = ["model.name=qwen3-235b-a22b", "algorithm.name=pretrain", "cluster.gpu_type=h200-141gb",
           "cluster.nodes=16", "cluster.gpus_per_node=8", "cluster.tasks_per_node=8", "cluster.executor=auto",
           "parallel.auto=true", "algorithm.global_batch_size=512"]
    shape = load_model_shape("qwen3-235b-a22b")
    cfg, result = apply_plan(load_config(None, job), shape)
    dims = ParallelDims.from_config(cfg.parallel, world_size=cfg.cluster.world_size)
    assert dims == result.layout.dims
    assert dims.etp == (1 if dims.ep > 1 else dims.tp)
    given = ["parallel.tp=2", "parallel.ep=8", "parallel.etp=2"]
    cfg, kept = apply_plan(load_config(None, [*job, *given]), shape, given={g.split("=")[0] for g in given})
    lay = kept.layout.dims
    assert (lay.tp, lay.ep, lay.etp, cfg.parallel.etp) == (2, 8, 2, 2)
    assert lay.edp == lay.world_size // (lay.pp * 8 * 2)
    assert kept.layout.megatron_args()["expert-tensor-parallel-size"] == 2
    assert check_layout(cfg, shape) == lay.dp
    assert cli.main(["plan", *job, *given]) == 0 and "etp=2" in capsys.readouterr().out


# ---------------- explanation and --layout ----------------
def test_the_plan_prints_the_step_time_by_part_and_why_the_runner_up_lost(capsys):
    planned = _plan(capsys, "--config", "grpo_llama70b")
    parts = planned["time_breakdown_s"]
    assert sum(parts.values()) == pytest.approx(planned["predicted"]["step_time_s"], abs=1e-3)
    assert parts["generation_decode"] > 0 and parts["logprob_passes"] > 0 and min(parts.values()) >= 0
    runner = planned["runner_up"]
    assert set(runner) == {"layout", "step_time_s", "slower_by", "main_reason", "deltas_s", "excluded_by"}
    assert runner["layout"] == planned["alternatives"][0]["layout"] and runner["excluded_by"] == {}
    assert runner["slower_by"] > 0 and runner["deltas_s"][runner["main_reason"]] == max(runner["deltas_s"].values())
    assert cli.main(["plan", "--config", "grpo_llama70b"]) == 0
    text = capsys.readouterr().out
    assert "Time per step" in text and "generation" in text and "log-prob passes" in text
    line = next(x for x in text.splitlines() if x.startswith("Runner-up"))
    assert " slower (" in line and f"tp={runner['layout']['tp']} pp={runner['layout']['pp']}" in line


def test_kept_keys_that_exclude_a_faster_layout_make_it_the_runner_up(capsys):
    free = _plan(capsys, "--config", "grpo_llama70b")
    pp = 8 if free["layout"]["pp"] != 8 else 2
    kept = _plan(capsys, "--config", "grpo_llama70b", "--layout", f"pp={pp}")
    runner = kept["runner_up"]
    assert runner["layout"] == free["layout"] and runner["excluded_by"] == {"pp": pp}
    assert runner["slower_by"] < 0 and runner["deltas_s"][runner["main_reason"]] == min(runner["deltas_s"].values())
    assert cli.main(["plan", "--config", "grpo_llama70b", "--layout", f"pp={pp}"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Runner-up"))
    assert " faster (" in line and line.endswith(f"excluded by the kept pp={pp}")


@pytest.mark.parametrize("config", ["grpo_llama405b", "grpo_deepseek_v3"])
def test_the_alternatives_of_the_shipped_large_jobs_differ_in_tp_pp_cp_ep(capsys, config):
    planned = _plan(capsys, "--config", config)
    sizes = {tuple(a["layout"][k] for k in ("tp", "pp", "cp", "ep")) for a in planned["alternatives"]}
    assert len(sizes) >= 3


@pytest.mark.parametrize("layout", ["first_stage_layers=7", "first_stage_layers=7,last_stage_layers=7",
                                    "tp=8,first_stage_layers=7"])
def test_a_layout_with_a_split_key_and_no_pp_searches_the_rest(capsys, layout):
    planned = _plan(capsys, "--config", "grpo_llama405b", "--layout", layout)
    assert planned["fits"] and planned["layout"]["pp"] > 1 and "pp" not in planned["constraints"]
    for key, value in (item.split("=") for item in layout.split(",")):
        assert planned["layout"][key] == int(value) and planned["constraints"][key] == int(value)


def test_a_fixed_layout_that_does_not_fit_exits_3_naming_the_nearest_layout_that_fits(capsys):
    too_big = "tp=8,pp=1,vpp=1,cp=1,ep=1,mbs=1,recompute=none,sp=true"
    assert cli.main(["plan", "--config", "grpo_llama70b", "--layout", too_big]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    needs = re.search(r"the leanest layout needs ([\d.]+) of ([\d.]+) GiB", captured.err)
    assert needs and float(needs[1]) > float(needs[2])
    nearest = re.search(r"nearest layout that fits: --layout (\S+) ", captured.err)[1]
    kept = dict(item.split("=") for item in too_big.split(","))
    got = dict(item.split("=") for item in nearest.split(","))
    assert {k: got[k] for k in ("tp", "cp", "ep", "sp")} == {k: kept[k] for k in ("tp", "cp", "ep", "sp")}
    assert cli.main(["plan", "--config", "grpo_llama70b", "--layout", too_big, "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["nearest_layout"] == nearest
    planned = _plan(capsys, "--config", "grpo_llama70b", "--layout", nearest)
    assert planned["fits"] and planned["memory_gib"]["total"] <= planned["memory_gib"]["capacity"]
    assert {key: planned["layout"][key] for key in parse_layout(nearest)} == parse_layout(nearest)


def test_a_model_without_a_config_plans_with_stated_defaults_not_the_tiny_jobs(capsys):
    """plan --model without --config: the batch and, for GRPO, the rollout and longest response come from stated
    rules (printed with them), not from the tiny CPU job: Llama-3.1-405B on 16,384 GPUs plans Meta's published
    2,048-sequence batch, and Qwen3-235B GRPO with a 5,671-token mean response plans instead of being refused for
    the tiny job's 4-token responses. A given value is kept."""
    pretrain = _plan(capsys, "--model", "llama-3.1-405b", "--gpus", "16384")
    assert pretrain["assumed"]["algorithm.global_batch_size"]["value"] == 2048 == pretrain["workload"]["global_batch_size"]
    assert "4M tokens per step" in pretrain["assumed"]["algorithm.global_batch_size"]["rule"]
    small = _plan(capsys, "--model", "llama-3.1-8b", "--gpus", "8")  # 4M tokens at seq 8,192: 512 sequences
    assert small["assumed"]["algorithm.global_batch_size"]["value"] == 512
    kept = _plan(capsys, "--model", "llama-3.1-405b", "--gpus", "16384", "--global-batch-size", "1024")
    assert kept["assumed"] == {} and kept["workload"]["global_batch_size"] == 1024
    grpo = _plan(capsys, "--model", "qwen3-235b-a22b", "--mode", "grpo", "--gpus", "256", "--gpu-type", "h200-141gb",
                 "--mean-response-len", "5671")
    assumed = {key: entry["value"] for key, entry in grpo["assumed"].items()}
    assert assumed["generation.max_new_tokens"] >= 2 * 5671 and assumed["algorithm.group_size"] == 16
    assert grpo["fits"] and grpo["workload"]["grpo"]["rollout_batch_size"] == 2048
    assert cli.main(["plan", "--model", "qwen3-235b-a22b", "--mode", "grpo", "--gpus", "256"]) == 0
    out = capsys.readouterr().out
    assert "Assumed     algorithm.prompts_per_step=128, algorithm.group_size=16, algorithm.global_batch_size=512" in out
    assert "generation.max_new_tokens=3072: 3/4 of model.seq_length" in out
