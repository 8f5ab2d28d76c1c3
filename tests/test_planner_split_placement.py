"""The planner's split placement (cluster.rollout_tasks) and gloo collectives on GPUs, torch-free and fast:

- a rollout GPU holds its bf16 weight shard and a KV pool for generation.max_concurrent rows, nothing else;
- the trainer GPUs hold no KV cache, and the step is trainer + generation (max_staleness=0) or the longer of the
  two (max_staleness > 0), with the weight sync on the trainer's side;
- the layouts are searched over the training processes, with rollout_tasks a multiple of tp*pp and ep=1, and the
  job accepts every layout the planner proposes (Plan = launch);
- a suggested rollout_tasks balances generation against training;
- parallel.backend=gloo on GPUs puts every collective on TCP, which moves the pick to less communication.

    .venv/bin/python -m pytest tests/test_planner_split_placement.py -q
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.spec import limits
from megatron_rl.spec.config.loader import given_keys, load_config
from megatron_rl.spec.config.validate import check_layout
from megatron_rl.spec.errors import ConfigError
from launcher.job import apply_plan, plan_job
from megatron_rl.spec.model_shape import load_model_shape
from megatron_rl.spec.parallel import ParallelDims, rollout_replica_error
from launcher.planner import GrpoSizing, NoFeasibleLayout, Runtime, SplitPlacement, plan
from launcher.planner.costs import IB_LATENCY_S, LINK_EFFICIENCY, TCP_GB_S, TCP_LATENCY_S, Workload
from launcher.planner.estimate import Layout
from launcher.planner.gpus import GIB, get_gpu
from launcher.planner.rl_step import KV_HEADROOM, estimate, rollout_estimate, suggest_rollout_tasks, weight_sync_s

LLAMA70B = load_model_shape("llama-3.3-70b")
ROLLOUT = GrpoSizing(rollout_batch_size=256, max_prompt_length=512, max_response_length=1024, samples_per_prompt=8,
                     generation_concurrency=32)
TP8 = Layout.of(tp=8, pp=1, vpp=1, cp=1, ep=1, dp=2, micro_batch_size=1, recompute="full", sequence_parallel=True)
CONFIG = "configs/grpo_llama70b.yaml"


def _workload(split: SplitPlacement | None, *, runtime: Runtime | None = None, grpo: GrpoSizing = ROLLOUT,
              gpus: int = 16) -> Workload:
    return Workload(shape=LLAMA70B, gpu=get_gpu("h100-80gb"), num_gpus=gpus, seq_length=4096, global_batch_size=64,
                    mode="grpo", grpo=grpo, runtime=runtime or Runtime(), split=split)


def _config(*overrides: str):
    return load_config(CONFIG, ["data.train_path=train.jsonl", *overrides], allow_missing=True)


# ---- memory ----

POOL_TOKENS = 32 * (512 / 8 + KV_HEADROOM * 512 + 256 / 2)
"""The pool the planner picks for 32 rows at once (generation.max_concurrent): each row's share of its group's prompt,
KV_HEADROOM x the mean response (half the longest) and half a block."""


def test_a_rollout_gpu_holds_its_weight_shard_and_a_kv_pool_for_max_concurrent_rows():
    w = _workload(SplitPlacement(rollout_gpus=16))
    gpu = rollout_estimate(w, TP8)
    # 16 rollout GPUs / (tp 8 x pp 1) = 2 replicas of 128 sequences each, decoded 32 at a time
    assert gpu.weights == LLAMA70B.num_params() * 2 / 8  # bf16, no gradients or optimizer state
    assert (gpu.gradients, gpu.optimizer, gpu.activations, gpu.reference_model) == (0, 0, 0, 0)
    kv_per_token_layer = 2 * (8 // 8) * 128 * 2  # K and V of one query group per TP rank, kv_channels 128, bf16
    assert gpu.kv_pool.rows == 32 and gpu.kv_pool.source == "chosen"
    assert gpu.kv_cache == pytest.approx(POOL_TOKENS * 80 * kv_per_token_layer, rel=1e-12)
    logits = 32 * LLAMA70B.vocab_size * 10  # the live rows' logits and sampling tensors
    assert gpu.inference_buffers > logits
    base = gpu.weights + gpu.kv_cache + gpu.inference_buffers
    assert gpu.total == pytest.approx(base * 1.05 + 3 * GIB, rel=1e-12)  # fragmentation, fixed overhead
    assert gpu.fits


def test_rollout_replicas_at_their_own_tp_and_pp_are_sized_at_those():
    """parallel.rollout_tp / rollout_pp: 16 rollout GPUs at tp 4 x pp 2 beside a TP8 training layout are 2
    replicas; a GPU holds 1/8 of the layers' weights split over tp 4 x pp 2 (the fullest stage: half the layers)
    and the KV pool of its stage's 40 layers at tp 4 (2 query groups per rank), for 32 rows."""
    w = _workload(SplitPlacement(rollout_gpus=16, rollout_tp=4, rollout_pp=2))
    gpu = rollout_estimate(w, TP8)
    assert (gpu.layout.dims.tp, gpu.layout.dims.pp, gpu.layout.dims.dp) == (4, 2, 2)
    same = rollout_estimate(_workload(SplitPlacement(rollout_gpus=16)), TP8)
    assert (same.layout.dims.tp, same.layout.dims.pp, same.layout.dims.dp) == (8, 1, 2)
    kv_per_token_layer = 2 * (8 // 4) * 128 * 2
    assert gpu.kv_cache == pytest.approx(POOL_TOKENS * 40 * kv_per_token_layer, rel=1e-12)
    assert gpu.kv_cache == pytest.approx(same.kv_cache, rel=1e-12)
    assert 0.45 * LLAMA70B.num_params() * 2 / 4 < gpu.weights < 0.6 * LLAMA70B.num_params() * 2 / 4
    assert rollout_replica_error(12, *SplitPlacement(rollout_gpus=12, rollout_tp=4, rollout_pp=2).replica(8, 1), 1) \
        .startswith("cluster.rollout_tasks=12 is not a multiple of the rollout replica's tp*pp = 4*2 = 8")


def test_the_trainer_gpus_hold_no_kv_cache_with_split_placement():
    colocated = estimate(_workload(None), TP8)
    split = estimate(_workload(SplitPlacement(rollout_gpus=16)), TP8)
    assert colocated.kv_cache_generating > 0
    assert split.kv_cache == split.inference_buffers == split.kv_cache_generating == 0
    assert split.weights == colocated.weights and split.reference_model == colocated.reference_model
    assert split.total < colocated.total


def test_a_rollout_gpu_that_overflows_is_refused_with_the_reason():
    """A pool the planner picks fits by construction (it fills what memory leaves); a given one may not."""
    everything = dataclasses.replace(ROLLOUT, rollout_batch_size=4096, generation_concurrency=None, kv_memory_gib=70)
    with pytest.raises(NoFeasibleLayout) as info:
        plan(LLAMA70B, num_gpus=32, gpu_type="h100-80gb", seq_length=4096, global_batch_size=512, mode="grpo",
             grpo=everything, split=SplitPlacement(rollout_gpus=8))
    text = str(info.value)
    assert "\n" not in text and "rollout GPU memory" in text and "lower generation.kv_memory_gib" in text
    assert "32 x h100-80gb training GPUs (+ 8 rollout)" in text


# ---- time ----

@pytest.mark.parametrize("staleness", [0, 1])
def test_the_step_is_the_sum_when_synchronous_and_the_longer_side_when_overlapped(staleness):
    w = _workload(SplitPlacement(rollout_gpus=16, max_staleness=staleness))
    e = estimate(w, TP8)
    sp = e.split
    assert sp.replicas == 2 and sp.rollout_gpus == 16 and sp.overlapped == bool(staleness)
    assert sp.generation_s == rollout_estimate(w, TP8).step_time_s
    expected = max(sp.trainer_s, sp.generation_s) if staleness else sp.trainer_s + sp.generation_s
    assert e.step_time_s == pytest.approx(expected, rel=1e-12)
    parts = e.breakdown_s
    assert sum(parts.values()) == pytest.approx(e.step_time_s, rel=1e-9)
    assert parts["generation_prefill"] == parts["generation_decode"] == parts["phase_switch"] == 0
    assert parts["weight_sync"] == sp.weight_sync_s
    assert parts["rollout_wait"] == pytest.approx(e.step_time_s - sp.trainer_s, rel=1e-9, abs=1e-12)
    # the trainer's side: what the colocated step spends outside generation, plus the weight sync
    colocated = estimate(dataclasses.replace(w, split=None), TP8).breakdown_s
    own = sum(v for k, v in colocated.items() if k not in ("generation_prefill", "generation_decode", "phase_switch"))
    assert sp.trainer_s == pytest.approx(own + sp.weight_sync_s, rel=1e-9)


def test_weight_sync_moves_the_bf16_policy_or_only_the_lora_share_over_the_named_link():
    params = LLAMA70B.num_params()
    gloo_s, gloo_bytes = weight_sync_s(_workload(SplitPlacement(rollout_gpus=16, weight_sync="gloo")))
    assert gloo_bytes == 2 * params
    assert gloo_s == pytest.approx(2 * params / (TCP_GB_S * 1e9 * LINK_EFFICIENCY) + TCP_LATENCY_S, rel=1e-12)
    files_s, _ = weight_sync_s(_workload(SplitPlacement(rollout_gpus=16, weight_sync="files")))
    assert files_s == gloo_s
    nccl_s, _ = weight_sync_s(_workload(SplitPlacement(rollout_gpus=16, weight_sync="nccl")))
    assert nccl_s == pytest.approx(2 * params / (50e9 * LINK_EFFICIENCY) + IB_LATENCY_S, rel=1e-12)  # H100 NDR
    lora_s, lora_bytes = weight_sync_s(_workload(SplitPlacement(rollout_gpus=16),
                                                 runtime=Runtime(trainable_fraction=0.01)))
    assert lora_bytes == pytest.approx(0.01 * 2 * params, rel=1e-12) and lora_s < gloo_s / 50


def test_the_suggested_rollout_tasks_is_the_fewest_whole_replicas_that_keep_up_with_training():
    w = _workload(SplitPlacement(rollout_gpus=16, max_staleness=1))
    chosen = estimate(w, TP8)
    hint = suggest_rollout_tasks(w, chosen)
    assert hint.rollout_tasks == 8 * hint.replicas and hint.balanced
    assert hint.trainer_s == chosen.split.trainer_s
    assert rollout_estimate(w, TP8, hint.replicas).step_time_s <= hint.trainer_s
    if hint.replicas > 1:
        assert rollout_estimate(w, TP8, hint.replicas - 1).step_time_s > hint.trainer_s


def test_when_no_rollout_count_keeps_up_the_suggestion_is_the_fewest_near_the_fastest_generation():
    tiny = load_model_shape("tiny-cpu")  # decode is latency-bound: more replicas hardly help
    w = Workload(shape=tiny, gpu=get_gpu("h100-80gb"), num_gpus=1, seq_length=64, global_batch_size=128, mode="grpo",
                 grpo=GrpoSizing(rollout_batch_size=128, max_prompt_length=16, max_response_length=4,
                                 samples_per_prompt=8), split=SplitPlacement(rollout_gpus=1, max_staleness=1))
    lay = Layout.of(tp=1, pp=1, vpp=1, cp=1, ep=1, dp=1, micro_batch_size=32, recompute="none", sequence_parallel=False)
    hint = suggest_rollout_tasks(w, estimate(w, lay))
    fastest = rollout_estimate(w, lay, 128).step_time_s  # one sequence per replica
    assert not hint.balanced and fastest > hint.trainer_s
    assert hint.generation_s <= 1.05 * fastest and hint.rollout_tasks == hint.replicas
    if hint.replicas > 1:
        assert rollout_estimate(w, lay, hint.replicas - 1).step_time_s > 1.05 * fastest


# ---- layouts: training world, tp*pp, ep; Plan = launch ----

def test_the_layout_is_searched_over_the_training_processes_and_the_job_runs_it(monkeypatch):
    monkeypatch.setattr(limits, "JOB_LIMITS", {})  # the trainer's own key limits are not the planner's business
    cfg = _config("cluster.rollout_tasks=32", "algorithm.max_staleness=1", "generation.max_concurrent=256")
    assert cfg.cluster.training_tasks == 32
    result = plan_job(cfg, LLAMA70B, given=given_keys(CONFIG, []))
    for e in (result.estimate, *result.alternatives):
        lay = e.layout
        assert lay.dims.tp * lay.dims.pp * lay.dims.cp * lay.dims.dp == 32
        assert 32 % (lay.dims.tp * lay.dims.pp) == 0 and lay.dims.ep == 1
        assert e.split is not None and e.split.rollout_gpu.fits
    planned, _ = apply_plan(cfg, LLAMA70B, given=given_keys(CONFIG, []))
    assert check_layout(planned, LLAMA70B) == result.layout.dims.dp
    text = result.explain()
    assert "on 32 training + 32 rollout x h100-80gb" in text
    assert "Rollout GPUs 32 = " in text and "Split step  training " in text and "generation " in text
    assert "Suggested   cluster.rollout_tasks=" in text
    assert result.to_dict()["split"]["rollout_gpus"] == 32


def test_rollout_tasks_that_are_not_whole_replicas_are_refused_in_one_line_naming_the_key_and_the_fix(monkeypatch):
    monkeypatch.setattr(limits, "JOB_LIMITS", {})
    cfg = _config("cluster.rollout_tasks=6", "parallel.auto=false", "parallel.tp=4", "parallel.pp=1",
                  "parallel.sequence_parallel=true", "parallel.micro_batch_size=1")
    message = ("cluster.rollout_tasks=6 is not a multiple of the rollout replica's tp*pp = 4*1 = 4 "
               "(parallel.rollout_tp/rollout_pp, or the training tp/pp); set cluster.rollout_tasks to a multiple of "
               "4, e.g. 4 or 8")
    with pytest.raises(ConfigError) as info:
        check_layout(cfg, LLAMA70B)
    assert str(info.value) == message
    # the planner holds the same rule: given tp and pp, it names the keys too
    with pytest.raises(ConfigError) as info:
        plan_job(cfg, LLAMA70B, given={"parallel.tp", "parallel.pp"})
    assert str(info.value) == f"parallel.tp=4,pp=1: {message}"
    assert rollout_replica_error(8, 4, 2, 1) is None and rollout_replica_error(0, 3, 1, 1) is None


def test_split_placement_searches_no_expert_parallelism():
    qwen = load_model_shape("qwen3-235b-a22b")
    kwargs = dict(num_gpus=64, gpu_type="h200-141gb", seq_length=4096, global_batch_size=256, mode="grpo",
                  grpo=dataclasses.replace(ROLLOUT, rollout_batch_size=512), split=SplitPlacement(rollout_gpus=64))
    result = plan(qwen, **kwargs)
    assert {e.layout.dims.ep for e in (result.estimate, *result.alternatives)} == {1}
    with pytest.raises(ConfigError, match=r"^--layout ep=8: cluster.rollout_tasks=64 with parallel.ep=8: .*set "
                                          r"parallel.ep=1"):
        plan(qwen, **kwargs, fixed={"ep": 8})


def test_the_dims_error_names_the_training_processes_with_rollout_tasks():
    with pytest.raises(ConfigError, match=r"does not divide the 6 training processes \(cluster.nodes\*"
                                          r"cluster.tasks_per_node - cluster.rollout_tasks\)"):
        ParallelDims(world_size=6, tp=4, rollout_tasks=4)
    with pytest.raises(ConfigError, match=r"the world size 6 \(cluster.nodes\*cluster.tasks_per_node\)"):
        ParallelDims(world_size=6, tp=4)


# ---- gloo collectives on GPUs ----

def test_gloo_on_gpus_puts_every_link_on_tcp_and_cpu_jobs_plan_as_nccl():
    from launcher.planner.inputs import runtime_of

    tcp = TCP_GB_S * 1e9 * LINK_EFFICIENCY
    w = _workload(None, runtime=Runtime(comm_backend="gloo"))
    assert w.nvlink == w.ib == tcp and w.nvlink_latency == w.ib_latency == TCP_LATENCY_S
    assert runtime_of(_config("parallel.backend=gloo"), LLAMA70B).comm_backend == "gloo"
    assert runtime_of(_config(), LLAMA70B).comm_backend == "nccl"
    cpu = load_config(None, ["parallel.backend=gloo"], allow_missing=True)  # the built-in CPU job
    assert not cpu.cluster.has_gpus and runtime_of(cpu).comm_backend == "nccl"


def test_gloo_picks_less_communication_and_predicts_a_slower_step():
    kwargs = dict(num_gpus=64, gpu_type="h100-80gb", seq_length=4096, global_batch_size=512, mode="pretrain", top_k=0)
    nccl = plan(LLAMA70B, **kwargs)
    gloo = plan(LLAMA70B, **kwargs, runtime=Runtime(comm_backend="gloo"))
    comm = ("tp_comm", "cp_comm", "ep_all_to_all", "pp_p2p", "dp_comm")
    # what nccl's pick would communicate over TCP, against gloo's own pick
    nccl_pick_on_tcp = plan(LLAMA70B, **kwargs, runtime=Runtime(comm_backend="gloo"),
                            fixed={k: nccl.layout.value(k) for k in ("tp", "pp", "vpp", "cp", "ep",
                                                                        "micro_batch_size", "recompute")})
    assert gloo.layout.dims.tp < nccl.layout.dims.tp or (
        sum(gloo.estimate.breakdown_s[k] for k in comm) < sum(nccl_pick_on_tcp.estimate.breakdown_s[k] for k in comm))
    assert gloo.estimate.step_time_s > nccl.estimate.step_time_s
    assert gloo.estimate.step_time_s <= nccl_pick_on_tcp.estimate.step_time_s
    assert "gloo collectives (every link at TCP, 25 Gb/s)" in gloo.explain()
