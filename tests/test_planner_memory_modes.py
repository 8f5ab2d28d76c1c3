"""Planner memory terms (safety margin, MoE routing imbalance, bf16 main grads, partial recompute, inference
buffers), the job's runtime as planner input, and the dpo / ppo / eval modes.

Run: .venv/bin/python -m pytest tests/test_planner_memory_modes.py -q
"""

import dataclasses
import json

import pytest

from launcher.cli import main as cli
from megatron_rl.spec.config.loader import given_keys, load_config
from launcher.job import PLANNER_MODES, load_shape, plan_job
from megatron_rl.spec.model_shape import load_model_shape
from launcher.planner import GrpoSizing, Runtime, evaluate, plan
from launcher.planner.costs import MOE_DROPLESS_IMBALANCE, Workload
from launcher.planner.estimate import TRAINING_PARTS, Layout, rank_groups
from launcher.planner.gpus import get_gpu
from launcher.planner.rl_step import SAMPLING_BYTES_PER_LOGIT, _inference_buffers, estimate, rollout

H100 = "h100-80gb"
LLAMA = load_model_shape("llama-3.3-70b")
KW = dict(num_gpus=64, gpu_type=H100, global_batch_size=512, seq_length=4096)


def _plan_json(capsys, *args):
    assert cli(["plan", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


# ---------------- safety margin ----------------
def test_the_margin_decides_fits_and_the_pick_keeps_it(capsys):
    lay = "tp=8,pp=4,vpp=1,cp=1,mbs=1,recompute=selective"
    e = evaluate(LLAMA, lay, runtime=Runtime(memory_margin=0.0), **KW).estimate
    free = 1 - e.total / e.capacity
    assert evaluate(LLAMA, lay, runtime=Runtime(memory_margin=free / 2), **KW).fits
    assert not evaluate(LLAMA, lay, runtime=Runtime(memory_margin=free * 1.5), **KW).fits
    picked = plan(LLAMA, runtime=Runtime(memory_margin=0.2), **KW).estimate
    assert picked.total <= 0.8 * picked.capacity
    assert cli(["plan", "--model", "llama-3.3-70b", "--gpus", "64", "--global-batch-size", "512"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("total"))
    assert "-> fits, margin " in line and "GiB (" in line and "keeps >= 5.0%)" in line


# ---------------- MoE routing imbalance ----------------
def test_dropless_moe_stores_the_busiest_ranks_routed_tokens():
    shape = load_model_shape("qwen3-235b-a22b")

    def stored(runtime, ep):
        w = Workload(shape=shape, gpu=get_gpu(H100), num_gpus=256, seq_length=4096, global_batch_size=256,
                     runtime=runtime)
        return w.layer_cost("moe", 4, 1, True, 1, "none", ep).stored_bytes

    even = Runtime(moe_dropless_imbalance=1.0)
    tokens, h, fm, k = 4096, shape.hidden_size, shape.moe_ffn_hidden_size, shape.moe_router_topk
    routed = tokens * k * (2 * h + 2 * h + 2 * fm * 2 + 2 * fm) / 4  # permuted in/out, fc1 (gated), act; SP over tp
    assert stored(Runtime(), 8) - stored(even, 8) == pytest.approx((MOE_DROPLESS_IMBALANCE - 1) * routed, rel=1e-9)
    assert stored(Runtime(), 1) == stored(even, 1)  # one EP rank holds every expert: nothing to balance
    assert stored(Runtime(moe_capacity_factor=1.0), 8) == stored(even, 8)  # a capacity factor bounds it


# ---------------- bf16 main gradients ----------------
def test_bf16_main_grads_halve_gradient_memory_and_dp_traffic(capsys):
    held = ["--model", "llama-3.3-70b", "--gpus", "64", "--layout", "tp=8,pp=4,vpp=1,cp=1,mbs=1,recompute=selective"]
    fp32 = _plan_json(capsys, *held)
    bf16 = _plan_json(capsys, *held, "--grad-dtype", "bf16")
    assert bf16["workload"]["runtime"]["main_grad_bytes"] == 2 and fp32["workload"]["runtime"]["main_grad_bytes"] == 4
    assert bf16["layout"] == fp32["layout"]
    assert bf16["memory_gib"]["gradients"] == pytest.approx(fp32["memory_gib"]["gradients"] / 2, abs=2e-3)
    w = Workload(shape=LLAMA, gpu=get_gpu(H100), num_gpus=64, seq_length=4096, global_batch_size=512)
    lay = Layout.of(tp=8, pp=1, vpp=1, cp=1, ep=1, dp=8, micro_batch_size=1, recompute="full", sequence_parallel=True)
    half = Workload(shape=LLAMA, gpu=get_gpu(H100), num_gpus=64, seq_length=4096, global_batch_size=512,
                    runtime=Runtime(main_grad_bytes=2, overlap_grad_reduce=False))
    full = Workload(shape=LLAMA, gpu=get_gpu(H100), num_gpus=64, seq_length=4096, global_batch_size=512,
                    runtime=Runtime(overlap_grad_reduce=False))
    assert estimate(half, lay).gradients == pytest.approx(estimate(w, lay).gradients / 2, rel=1e-12)
    assert estimate(half, lay).breakdown_s["dp_comm"] < estimate(full, lay).breakdown_s["dp_comm"]


# ---------------- partial recompute ----------------
def test_partial_recompute_recomputes_the_first_layers_of_each_virtual_stage():
    base = "tp=8,pp=4,vpp=1,cp=1,mbs=1"
    full = evaluate(LLAMA, base + ",recompute=full", **KW).estimate
    none = evaluate(LLAMA, base + ",recompute=none", **KW).estimate
    half = evaluate(LLAMA, base + ",recompute=full,recompute_num_layers=10", **KW).estimate  # 20 layers per rank
    every = evaluate(LLAMA, base + ",recompute=full,recompute_num_layers=20", **KW).estimate
    assert half.layout.recompute_num_layers == 10
    assert half.breakdown_s["recompute"] == pytest.approx(full.breakdown_s["recompute"] / 2, rel=1e-9)
    assert every.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
    assert full.activations < half.activations < none.activations
    assert half.layout.megatron_args()["recompute-method"] == "block"
    assert half.layout.megatron_args()["recompute-num-layers"] == 10
    with pytest.raises(Exception, match="needs recompute=full"):
        evaluate(LLAMA, base + ",recompute=none,recompute_num_layers=4", **KW)


def test_a_given_recompute_num_layers_is_kept_by_plan(capsys):
    planned = _plan_json(capsys, "--config", "grpo_llama70b", "parallel.recompute=full",
                         "parallel.recompute_num_layers=4")
    assert planned["layout"]["recompute"] == "full" and planned["layout"]["recompute_num_layers"] == 4


# ---------------- inference buffers ----------------
def test_generation_buffers_are_the_live_rows_logits_on_the_last_stage_and_the_prefill_working_set():
    w = Workload(shape=LLAMA, gpu=get_gpu(H100), num_gpus=64, seq_length=4096, global_batch_size=512, mode="grpo",
                 grpo=GrpoSizing(rollout_batch_size=2048, max_prompt_length=1024, max_response_length=2048,
                                 samples_per_prompt=16))
    lay = Layout.of(tp=8, pp=2, vpp=1, cp=1, ep=1, dp=4, micro_batch_size=1, recompute="full", sequence_parallel=True)
    first, last = sorted(rank_groups((), 80, 2, 1, None, None, False, False), key=lambda g: g.rank)
    rows = 2048 / 4
    gap = _inference_buffers(w, lay, rollout(w), last, rows) - _inference_buffers(w, lay, rollout(w), first, rows)
    assert gap == pytest.approx(rows * LLAMA.vocab_size * SAMPLING_BYTES_PER_LOGIT, rel=1e-12)
    # one layer's activations (no SP while generating, flash, TP8) for the wave's 512 / 16 distinct prompts:
    # x, x2 and both norm outputs 4 x 2h, qkv 2 (n + 2g) d / t, lse 4 n / t, attention out 2 n d / t,
    # gated fc1 2 x 2f / t, activation 2f / t
    h, n, g, d, f, t = 8192, 64, 8, 128, 28672, 8
    per_token = 8 * h + 2 * (n + 2 * g) * d / t + 4 * n / t + 2 * n * d / t + 4 * f / t + 2 * f / t
    assert _inference_buffers(w, lay, rollout(w), first, rows) == pytest.approx(512 / 16 * 1024 * per_token, rel=1e-12)
    # generation.cuda_graphs: the graphs' pool keeps the logits of its largest bucket (512 rows) beside the eager
    # steps' own, on the last stage only
    graphs = dataclasses.replace(w, grpo=dataclasses.replace(w.grpo, cuda_graphs=True))
    for group, extra in ((first, 0.0), (last, 512 * LLAMA.vocab_size * SAMPLING_BYTES_PER_LOGIT)):
        for live in (rows, 2 * rows):
            more = (_inference_buffers(graphs, lay, rollout(graphs), group, live)
                    - _inference_buffers(w, lay, rollout(w), group, live))
            assert more == pytest.approx(extra, rel=1e-12)


# ---------------- the job's runtime drives the plan ----------------
def _job_plan(config, *overrides, **kw):
    cfg = load_config(config, list(overrides), allow_missing=True)
    return plan_job(cfg, load_shape(cfg.model.name), given=given_keys(config, list(overrides)), **kw)


def test_the_job_runtime_maps_onto_the_planner():
    gpu = _job_plan("grpo_llama70b").workload["runtime"]
    assert gpu == {"transformer_engine": True, "attention": "flash", "tp_comm_overlap": False,
                   "overlap_grad_reduce": True, "main_grad_bytes": 4, "memory_margin": 0.05}
    cpu = _job_plan(None, "parallel.auto=true")  # the default tiny job: CPU processes, no TE
    assert cpu.workload["runtime"]["transformer_engine"] is False
    assert cpu.workload["grpo"]["recompute_old_logprobs"] is False  # fp32 on CPU, no TE, dense: the trainer skips it
    unfused = _job_plan("grpo_llama70b", "runtime.attention=unfused", "runtime.grad_dtype=bf16",
                        "runtime.tp_comm_overlap=true", "runtime.overlap_grad_reduce=false").workload["runtime"]
    assert unfused == {"transformer_engine": True, "attention": "unfused", "tp_comm_overlap": True,
                       "overlap_grad_reduce": False, "main_grad_bytes": 2, "memory_margin": 0.05}


def test_plan_flags_override_the_runtime(capsys):
    planned = _plan_json(capsys, "--config", "grpo_llama70b", "--attention", "unfused", "--tp-comm-overlap")
    runtime = planned["workload"]["runtime"]
    assert runtime["attention"] == "unfused" and runtime["tp_comm_overlap"]
    assert cli(["plan", "--config", "grpo_llama70b", "--attention", "unfused", "runtime.attention=flash"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_unfused_attention_stores_the_scores():
    flash = evaluate(LLAMA, "tp=8,pp=4,vpp=1,cp=1,mbs=1,recompute=none", **KW).estimate
    unfused = evaluate(LLAMA, "tp=8,pp=4,vpp=1,cp=1,mbs=1,recompute=none", runtime=Runtime(flash_attention=False),
                       **KW).estimate
    scores = 4096 * 64 * 4096 / 8 * 2  # bf16 s x s scores of 64 heads over TP8, per sequence per layer
    per_layer_gap = (unfused.activations - flash.activations) / (20 * 4)  # 20 layers, 4 micro-batches in flight
    assert per_layer_gap == pytest.approx(scores, rel=0.01)


# ---------------- modes ----------------
def test_planner_modes_of_the_trainers():
    assert PLANNER_MODES["dpo"] == "dpo" and PLANNER_MODES["ppo"] == "ppo"


def test_dpo_trains_chosen_and_rejected_and_holds_no_reference():
    lay = "tp=8,pp=4,vpp=1,cp=1,mbs=1,recompute=selective"
    dpo = evaluate(LLAMA, lay, mode="dpo", **{**KW, "global_batch_size": 256}).estimate
    pre = evaluate(LLAMA, lay, mode="pretrain", **{**KW, "global_batch_size": 512}).estimate
    assert dpo.step_time_s == pytest.approx(pre.step_time_s, rel=1e-12) and dpo.reference_model == 0


def test_ppo_adds_a_critic_and_eval_is_generation_only():
    sizing = GrpoSizing(rollout_batch_size=2048, max_prompt_length=1024, max_response_length=2048,
                        samples_per_prompt=16, kv_cache_released_for_training=True)
    lay = "tp=8,pp=2,vpp=1,cp=1,mbs=1,recompute=full"
    grpo = evaluate(LLAMA, lay, mode="grpo", grpo=sizing, **KW).estimate
    ppo = evaluate(LLAMA, lay, mode="ppo", grpo=sizing, **KW).estimate
    assert ppo.critic == pytest.approx(grpo.weights + grpo.gradients + grpo.optimizer, rel=1e-12)
    training = sum(grpo.breakdown_s[k] for k in TRAINING_PARTS)
    one_pass = grpo.breakdown_s["logprob_passes"] / 2
    assert ppo.breakdown_s["critic"] == pytest.approx(training + 4 * one_pass / 4, rel=1e-9)
    ev = evaluate(LLAMA, lay, mode="eval", grpo=sizing, **KW).estimate
    assert ev.gradients == ev.optimizer == ev.activations == ev.reference_model == 0
    assert ev.kv_cache == pytest.approx(grpo.kv_cache_generating, rel=1e-12)
    assert ev.training_mfu == 0 and ev.time_terms.steps == 0
    gen = ev.breakdown_s["generation_prefill"] + ev.breakdown_s["generation_decode"] + ev.breakdown_s["phase_switch"]
    assert ev.step_time_s == pytest.approx(gen, rel=1e-12)
    assert ev.tokens_per_s_per_gpu == pytest.approx(2048 * 1024 / ev.step_time_s / 64, rel=1e-9)


# ---------------- the job's runtime keys are the plan's ----------------
def test_the_configs_runtime_section_drives_the_plan(capsys):
    """A CPU job (no GPUs) is planned without TE; runtime.attention=unfused keeps the s x s scores (more
    activation memory at the same layout); bf16 grads and TP overlap reach the planner's Runtime."""
    held = ["--config", "grpo_llama70b", "parallel.tp=8", "parallel.pp=4", "parallel.vpp=1", "parallel.cp=1",
            "parallel.micro_batch_size=1", "parallel.recompute=none"]
    flash = _plan_json(capsys, *held)
    unfused = _plan_json(capsys, *held, "runtime.attention=unfused")
    assert flash["workload"]["runtime"]["attention"] == "flash" and flash["workload"]["runtime"]["transformer_engine"]
    assert unfused["workload"]["runtime"]["attention"] == "unfused"
    assert unfused["memory_gib"]["activations"] > flash["memory_gib"]["activations"]
    cpu = _plan_json(capsys, "--config", "grpo_tiny")
    assert cpu["workload"]["runtime"]["transformer_engine"] is False
    tuned = _plan_json(capsys, *held, "runtime.grad_dtype=bf16", "runtime.overlap_grad_reduce=false")
    assert tuned["workload"]["runtime"]["main_grad_bytes"] == 2
    assert tuned["workload"]["runtime"]["overlap_grad_reduce"] is False


def test_ppo_generation_has_the_critics_offloaded_optimizer_state_to_spare_too():
    """With generation.offload_optimizer the critic's grads and Adam state leave the GPU with the policy's, so the
    KV cache that training must make room for is what exceeds the activations and both models' state."""
    sizing = GrpoSizing(rollout_batch_size=2048, max_prompt_length=1024, max_response_length=8192,
                        samples_per_prompt=16, kv_cache_released_for_training=True,
                        optimizer_offloaded_for_generation=True, plans_kv_memory=False)  # one pool for both
    lay = "tp=8,pp=2,vpp=1,cp=1,mbs=1,recompute=full"
    grpo = evaluate(LLAMA, lay, mode="grpo", grpo=sizing, **KW).estimate
    ppo = evaluate(LLAMA, lay, mode="ppo", grpo=sizing, **KW).estimate
    kv = grpo.kv_cache_generating
    state = grpo.gradients + grpo.optimizer
    assert kv > grpo.activations + 2 * state  # the case where the critic's freed state matters
    assert grpo.kv_cache == pytest.approx(kv - (grpo.activations + state), rel=1e-12)
    assert ppo.kv_cache == pytest.approx(kv - (ppo.activations + 2 * state), rel=1e-12)
