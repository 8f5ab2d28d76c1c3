"""Parallelism planner: legality, memory and FLOP formulas against independent numbers, search, CLI, JSON.

Run: .venv/bin/python -m pytest tests/test_planner.py -q
"""

import json
import time

import pytest

from megatron_rl.spec.config.schema import ParallelConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import load_model_shape, shape_from_megatron_dict
from launcher.planner import PLANNED_KEYS, GrpoSizing, NoFeasibleLayout, Runtime, evaluate, parse_layout, plan
from launcher.cli.plan import main as cli_main
from launcher.planner.costs import Workload
from megatron_rl.spec.parallel import virtual_stage_layers
from megatron_rl.spec.pipeline_layout import expand_layout
from launcher.planner.estimate import Layout
from launcher.planner.rl_step import estimate
from launcher.planner.gpus import GPUS, get_gpu
from launcher.planner.search import search

GIB = 1024**3
H100 = "h100-80gb"


def _workload(name, gpus, gbs, seq=None, **kw):
    shape = load_model_shape(name)
    return Workload(shape=shape, gpu=get_gpu(kw.pop("gpu", H100)), num_gpus=gpus,
                    seq_length=seq or shape.seq_length, global_batch_size=gbs, **kw)


# ---------------- GPU catalogue ----------------
def test_gpu_catalogue_has_required_parts():
    for name in ("a100-80gb", "h100-80gb", "h200-141gb"):
        g = GPUS[name]
        assert g.memory_gib > 0 and g.bf16_tflops > 0 and g.nvlink_gb_s > g.internode_gb_s > 0
        assert g.gpus_per_node == 8
    assert GPUS["h100-80gb"].fp8_tflops == pytest.approx(2 * GPUS["h100-80gb"].bf16_tflops, rel=0.01)
    assert GPUS["h200-141gb"].bf16_tflops == GPUS["h100-80gb"].bf16_tflops
    with pytest.raises(ConfigError, match="did you mean 'h100-80gb'"):
        get_gpu("h100-80g")


# ---------------- legality ----------------
@pytest.mark.parametrize("model, layout, reason", [
    ("llama-3.1-405b", "tp=3", "tp=3 does not divide the 128 attention heads of llama-3.1-405b"),
    ("llama-3.1-405b", "tp=16", "exceeds the 8 GPUs of one NVLink node"),
    ("qwen3-235b-a22b", "tp=8", r"tp=8 does not divide the 4 query groups \(KV heads\)"),
    ("llama-3.1-405b", "tp=8,cp=1,pp=5", "1024 GPUs not divisible by tp\\*cp\\*pp=40"),
    ("llama-3.1-405b", "tp=8,pp=16,vpp=9", "no legal pipeline split for 126 layers"),
    ("qwen3-235b-a22b", "ep=3", "ep=3 does not divide the 128 experts"),
    ("llama-3.3-70b", "ep=2", "ep=2 but llama-3.3-70b has no experts; set ep=1"),
    ("llama-3.3-70b", "tp=8,pp=1,cp=1,mbs=3", r"global batch 1024 not divisible by dp\*mbs=384"),
    ("llama-3.3-70b", "cp=3", "is not a multiple of 6"),
    ("llama-3.3-70b", "tp=8,pp=4,cp=1,vpp=2,mbs=16", r"interleaving needs the micro-batches per step \(2 ="),
    ("llama-3.3-70b", dict(tp=8, pp=4, cp=1, dp=3), "give dp"),  # dp is no parallel: key, so not in --layout
])
def test_illegal_layouts_are_rejected_with_the_reason(model, layout, reason):
    with pytest.raises(ConfigError, match=reason):
        evaluate(load_model_shape(model), layout, num_gpus=1024, gpu_type=H100, global_batch_size=1024)


def test_parse_layout():
    assert parse_layout("tp=8,pp=16,vpp=4,cp=1,ep=1,mbs=1,recompute=selective,sp=true") == {
        "tp": 8, "pp": 16, "vpp": 4, "cp": 1, "ep": 1, "micro_batch_size": 1, "recompute": "selective",
        "sequence_parallel": True}
    # the names are the parallel: keys (and the planner's JSON layout keys)
    every = ("tp=8,pp=16,vpp=1,cp=1,ep=1,etp=1,micro_batch_size=1,recompute=none,sequence_parallel=false,"
             "first_stage_layers=7,last_stage_layers=7,account_for_embedding=false,account_for_loss=false,"
             "recompute_num_layers=2")
    # a pipeline layout replaces the four split keys; its comma is Megatron's, not a key's
    assert parse_layout("pp=8,pipeline_layout=Et*3|(tt|)*29,m|L,tp=2") == {
        "pp": 8, "pipeline_layout": "Et*3|(tt|)*29,m|L", "tp": 2}
    # not layout keys: the search's switches, the rollout replicas' sizes (split placement's own input) and
    # packing (a rollout input: GrpoSizing.micro_batch_tokens)
    assert set(parse_layout(every)) | {"pipeline_layout"} == set(ParallelConfig.__dataclass_fields__) - {
        "auto", "distributed_optimizer", "backend", "timeout_s", "rollout_tp", "rollout_pp", "micro_batch_tokens"}
    assert set(PLANNED_KEYS) == set(parse_layout(every)) | {"pipeline_layout"}
    assert set(Layout.of(**parse_layout(every), dp=1).to_dict()) == {*PLANNED_KEYS, "dp"}
    with pytest.raises(ConfigError, match="unknown field 'dp'"):
        parse_layout("dp=4")
    with pytest.raises(ConfigError, match="did you mean 'recompute'"):
        parse_layout("recomput=full")
    with pytest.raises(ConfigError, match="recompute=some"):
        parse_layout("recompute=some")
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_layout("tp=eight")


def test_pipeline_splits_for_126_and_61_layers():
    # Llama-3.1-405B on PP16: embedding and loss counted as layers -> 7 | 8 x 14 | 7
    counts = virtual_stage_layers(126, 16, 1, None, None, True, True)
    assert counts[0] == 7 and counts[-1] == 7 and set(counts[1:-1]) == {8} and sum(counts) == 126
    # with VPP 8: one layer per virtual stage, none in the embedding and loss slots
    counts = virtual_stage_layers(126, 16, 8, None, None, True, True)
    assert len(counts) == 128 and counts[0] == 0 and counts[-1] == 0 and sum(counts) == 126
    # DeepSeek-V3 on PP16: uneven first/last stages without interleaving
    res = evaluate(load_model_shape("deepseek-v3"), "tp=1,pp=16,vpp=1,ep=64,cp=1", num_gpus=2048, gpu_type=H100,
                   global_batch_size=4096)
    lay = res.layout
    assert lay.dims.first_stage_layers is not None and lay.dims.last_stage_layers is not None
    assert lay.dims.first_stage_layers + lay.dims.last_stage_layers + 14 * 4 == 61
    assert res.fits
    # ... and with it, which no first/last split reaches (61 is odd): a pipeline layout of 32 stages
    res = evaluate(load_model_shape("deepseek-v3"), "tp=1,pp=16,vpp=2,ep=64,cp=1", num_gpus=2048, gpu_type=H100,
                   global_batch_size=4096)
    stages = expand_layout(res.layout.dims.pipeline_layout)
    assert len(stages) == 32 and stages[0].startswith("E") and stages[-1].endswith("L")
    assert sum(stage.count("t") for stage in stages) == 61 and res.fits


# ---------------- memory against independent numbers ----------------
def test_weights_grads_optimizer_bytes_per_param():
    shape = load_model_shape("llama-3.3-70b")
    w = _workload("llama-3.3-70b", 256, 256, seq=4096)
    lay = Layout.of(tp=8, pp=4, vpp=1, cp=1, ep=1, dp=8, micro_batch_size=1, recompute="full", sequence_parallel=True)
    est = estimate(w, lay)
    # a middle rank holds 20 layers / 8; the fullest rank adds the embedding or output layer
    layer = shape.attention_params() + shape.dense_mlp_params()
    first = (20 * layer + shape.vocab_size * shape.hidden_size) / 8
    last = (20 * layer + shape.vocab_size * shape.hidden_size + shape.hidden_size) / 8
    params = first if est.worst_rank == 0 else last
    assert est.weights == pytest.approx(2 * params, rel=1e-9)
    assert est.gradients == pytest.approx(4 * params, rel=1e-9)
    assert est.optimizer == pytest.approx(12 * params / 8, rel=1e-9)  # distributed optimizer over dp=8
    plain = estimate(_workload("llama-3.3-70b", 256, 256, seq=4096, runtime=Runtime(distributed_optimizer=False)),
                     lay)
    params = first if plain.worst_rank == 0 else last
    assert plain.weights + plain.gradients + plain.optimizer == pytest.approx(18 * params, rel=1e-9)


def test_llama_activation_bytes_and_interleaving_factor():
    # TE/flash, SP, no recompute: per token per layer 2h (x) + 2h (ln out) + 2(n+2g)d (qkv) + 2nd (attn out)
    # + 2h + 2h (mlp side) + 4f (fc1 out, gated) + 2f (swiglu out) + 4n/t lse, all over t
    shape = load_model_shape("llama-3.1-405b")
    h, n, g, d, f, t, s = 16384, 128, 8, 128, 53248, 8, 8192
    per_token = (2 * h + 2 * h + 2 * (n + 2 * g) * d + 2 * n * d + 2 * h + 2 * h + 4 * f + 2 * f + 4 * n) / t
    w = _workload("llama-3.1-405b", 16384, 2048, seq=s)
    per_layer = w.layer_cost("dense", t, 1, True, 1, "none", 1).stored_bytes
    assert per_layer == pytest.approx(per_token * s, rel=1e-9)
    sel = w.layer_cost("dense", t, 1, True, 1, "selective", 1).stored_bytes
    assert per_layer - sel == pytest.approx(4 * h / t * s, rel=1e-9)  # layernorm outputs recomputed
    full = w.layer_cost("dense", t, 1, True, 1, "full", 1).stored_bytes
    assert full == pytest.approx(2 * h / t * s, rel=1e-9)  # only the layer input
    # first stage of an even split holds L * (1 + (p-1)/(p*v)) layer-activations (Megatron's formula)
    for vpp in (1, 3, 9):
        lay = Layout.of(tp=8, pp=14, vpp=vpp, cp=1, ep=1, dp=1, micro_batch_size=1, recompute="none",
                     sequence_parallel=True)
        w14 = _workload("llama-3.1-405b", 112, 112, seq=s)
        est = estimate(w14, lay)
        factor = 1 + 13 / (14 * vpp) if vpp > 1 else 1
        # the embedding's output is the first layer's input, stored there; no dropout mask (hidden_dropout 0)
        expected = per_layer * 126 * factor
        assert est.worst_rank == 0
        assert est.activations == pytest.approx(expected, rel=1e-6)
    assert shape.num_layers == 126


def test_grpo_adds_kv_cache_and_reference_model_and_rm_has_no_logits():
    kw = dict(num_gpus=64, gpu_type=H100, global_batch_size=256, seq_length=4096)
    shape = load_model_shape("llama-3.3-70b")
    layout = dict(tp=8, pp=2, vpp=1, cp=1, mbs=1, recompute="full")
    pre = evaluate(shape, layout, **kw)
    grpo = evaluate(shape, layout, mode="grpo", grpo=GrpoSizing(max_prompt_length=1024, max_response_length=3072),
                    **kw)
    rm = evaluate(shape, layout, mode="rm", **kw)
    # KV cache: 256 rollouts / dp 4 x 4096 tokens x 40 layers x 2 (K,V) x (8 groups / tp 8) x 128 x 2 bytes
    assert grpo.estimate.kv_cache == pytest.approx(64 * 4096 * 40 * 2 * 1 * 128 * 2, rel=1e-9)
    assert grpo.estimate.reference_model == pytest.approx(pre.estimate.weights, rel=1e-9)
    assert pre.estimate.kv_cache == 0 and pre.estimate.reference_model == 0
    assert grpo.predicted["step_time_s"] > pre.predicted["step_time_s"]  # rollouts and log-prob passes cost
    assert rm.estimate.activations < pre.estimate.activations  # no vocab logits
    assert rm.estimate.weights < pre.estimate.weights  # scalar head instead of the output layer


def test_a_released_kv_cache_reuses_training_only_memory_and_offload_adds_grads_and_optimizer():
    # GRPO's phases: generation holds weights + reference + KV cache, training weights + reference + grads +
    # optimizer + activations. Released, the cache reuses the activations' memory; with the optimizer offloaded
    # while generating, also the grads' and the optimizer's. One pipeline rank, so every variant's worst rank is
    # the same GPU.
    kw = dict(num_gpus=64, gpu_type=H100, global_batch_size=512, seq_length=4096, mode="grpo")
    layout = dict(tp=8, pp=1, vpp=1, cp=1, ep=1, mbs=1, recompute="selective", sequence_parallel=True)
    # the engine's default pool (every row at its longest), so the cache's size does not follow the memory left
    shape = load_model_shape("llama-3.3-70b")
    sizing = dict(rollout_batch_size=2048, max_response_length=2048, plans_kv_memory=False)

    def peak(**flags):
        return evaluate(shape, layout, grpo=GrpoSizing(**sizing, **flags), **kw).estimate

    kept, released = peak(), peak(kv_cache_released_for_training=True)
    offloaded = peak(kv_cache_released_for_training=True, optimizer_offloaded_for_generation=True)
    kv = kept.kv_cache  # the whole cache: 2048 rollouts / dp 8 x 3072 tokens x 80 layers x K,V x 1 group x 128 x 2 B
    assert kv == pytest.approx(256 * 3072 * 80 * 2 * 128 * 2, rel=1e-9)
    assert released.kv_cache == pytest.approx(kv - released.activations, rel=1e-9) and released.kv_cache > 0
    training_only = offloaded.activations + offloaded.gradients + offloaded.optimizer
    assert offloaded.kv_cache == pytest.approx(max(0.0, kv - training_only), abs=1.0)
    assert offloaded.total < released.total < kept.total
    # an offloaded optimizer frees nothing while the cache stays through training
    assert peak(optimizer_offloaded_for_generation=True).total == pytest.approx(kept.total, rel=1e-12)


def test_mla_kv_cache_is_the_latent_on_every_tp_rank():
    """The paged engine's MLA blocks hold the 576-element latent (kv_lora_rank 512 + rope 64) per token and layer,
    the same at any TP, not per-head K (nope 128 + rope 64) and V (128), 5,120 elements at TP8
    (generation/paged_mla.py; engine: test_kv_cache_count.py)."""
    from launcher.planner.costs import kv_cache_elements_per_token_per_layer

    w = _workload("deepseek-v3", 2048, 2048, mode="grpo")
    _, prompt, response, _ = w.grpo_sizes()  # one row at its longest: 1024 + 3072 tokens, on one layer, bf16

    def row_bytes(tp: int) -> float:
        return (prompt + response) * kv_cache_elements_per_token_per_layer(w.shape, tp) * GrpoSizing().kv_cache_bytes

    assert row_bytes(8) == pytest.approx((512 + 64) * 4096 * 2, rel=1e-9) == row_bytes(1)
    assert 128 // 8 * (128 + 64 + 128) / (512 + 64) == pytest.approx(8.89, abs=0.01)  # the expanded K/V at TP8


# ---------------- FLOPs against Megatron's formula ----------------
def _megatron_flops_per_token(shape, seq):
    """Megatron-LM num_floating_point_operations (2024, causal unhalved), divided by batch*seq."""
    h, n, g, d = shape.hidden_size, shape.num_attention_heads, shape.num_query_groups, shape.kv_channels
    gated = 1.5 if shape.gated_linear_unit else 1.0
    layers = shape.num_layers
    ffn = shape.ffn_hidden_size
    if shape.is_moe:
        mlp = shape.moe_ffn_hidden_size * shape.moe_router_topk + shape.moe_shared_expert_intermediate_size
    else:
        mlp = ffn
    q_ratio = n * d / h
    return 12 * layers * h * h * ((1 + g / n + seq / h) * q_ratio + mlp / h * gated) + 6 * h * shape.vocab_size


@pytest.mark.parametrize("name", ["llama-3.1-405b", "llama-3.3-70b", "qwen3-235b-a22b", "tiny-cpu-moe"])
def test_model_flops_match_megatron(name):
    w = _workload(name, 8, 8)
    ours = w.model_flops_per_token()
    theirs = _megatron_flops_per_token(w.shape, w.seq_length)
    assert ours == pytest.approx(theirs, rel=0.01)  # we also count the router GEMM; Megatron does not


# ---------------- time model ----------------
def test_bubble_follows_interleaved_formula():
    w = _workload("nemotron-4-340b", 1536, 768)
    for vpp in (1, 2, 4, 8):
        lay = Layout.of(tp=8, pp=12, vpp=vpp, cp=1, ep=1, dp=16, micro_batch_size=1, recompute="none",
                     sequence_parallel=True)
        est = estimate(w, lay)
        m = 768 // 16
        # stages differ only by the embedding/output layer; the bubble is close to (p-1)/(v*m + p-1)
        assert est.bubble_fraction == pytest.approx(11 / (vpp * m + 11), rel=0.15)


def test_recompute_and_tp_overlap_cost_time():
    w = _workload("llama-3.3-70b", 64, 64, seq=4096)
    none = w.layer_cost("dense", 8, 1, True, 1, "none", 1)
    sel = w.layer_cost("dense", 8, 1, True, 1, "selective", 1)
    full = w.layer_cost("dense", 8, 1, True, 1, "full", 1)
    assert none.bwd_s < sel.bwd_s < full.bwd_s
    assert full.bwd_s - none.bwd_s == pytest.approx(none.fwd_s, rel=1e-9)
    assert not Runtime().tp_comm_overlap  # no trainer turns it on by default
    fast = _workload("llama-3.3-70b", 64, 64, seq=4096, runtime=Runtime(tp_comm_overlap=True))
    assert fast.layer_cost("dense", 8, 1, True, 1, "none", 1).fwd_s < none.fwd_s


# ---------------- search ----------------
def test_plan_picks_the_fastest_fitting_layout_and_pruning_keeps_the_answer():
    w = _workload("llama-3.3-70b", 128, 512, seq=4096)
    brute = search(w, keep_all=True, prune=False)
    best = min(brute.fitting, key=lambda e: e.step_time_s)
    res = plan(w.shape, num_gpus=128, gpu_type=H100, global_batch_size=512, seq_length=4096)
    assert res.fits and res.estimate.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    assert all(a.fits and a.step_time_s >= res.estimate.step_time_s for a in res.alternatives)
    assert res.rejections["memory"]["count"] > 0


def test_nothing_fits_names_the_smallest_gpu_count():
    shape = load_model_shape("llama-3.3-70b")
    with pytest.raises(NoFeasibleLayout, match=r"smallest GPU count that fits is \d+ x h100-80gb") as info:
        plan(shape, num_gpus=4, gpu_type=H100, global_batch_size=64, seq_length=4096)
    smallest = info.value.smallest_gpus
    assert smallest is not None and smallest > 4
    assert plan(shape, num_gpus=smallest, gpu_type=H100, global_batch_size=64, seq_length=4096).fits
    below = smallest - 8 if smallest > 8 else None
    if below and below > 4:
        with pytest.raises(NoFeasibleLayout):
            plan(shape, num_gpus=below, gpu_type=H100, global_batch_size=64, seq_length=4096)


def test_evaluate_too_big_layout_reports_fits_false():
    res = evaluate(load_model_shape("llama-3.1-405b"), "tp=8,pp=2,cp=1,recompute=none", num_gpus=16,
                   gpu_type=H100, global_batch_size=16, seq_length=8192)
    assert res.fits is False and res.memory["total"] > res.memory["capacity"]


def test_search_speed_1t_on_16k_gpus():
    shape = shape_from_megatron_dict(dict(num_layers=128, hidden_size=25600, ffn_hidden_size=102400,
                                          num_attention_heads=160, vocab_size=51200, seq_length=2048,
                                          gated_linear_unit=False, family="gpt"), name="gpt-1t", source="test")
    start = time.perf_counter()
    res = plan(shape, num_gpus=16384, gpu_type=H100, global_batch_size=4096)
    assert time.perf_counter() - start < 1.0
    assert res.considered > 10000 and res.fits


# ---------------- JSON and CLI ----------------
def test_json_schema():
    res = plan(load_model_shape("llama-3.3-70b"), num_gpus=64, gpu_type=H100, global_batch_size=128)
    obj = json.loads(res.to_json())
    assert set(obj["layout"]) >= {"tp", "pp", "vpp", "cp", "ep", "dp", "micro_batch_size", "recompute",
                                  "sequence_parallel"}
    assert set(obj["memory_gib"]) >= {"weights", "gradients", "optimizer", "activations", "kv_cache", "overhead",
                                      "total", "capacity"}
    assert isinstance(obj["fits"], bool) and obj["fits"]
    assert set(obj["predicted"]) == {"step_time_s", "mfu", "training_mfu", "tokens_per_s_per_gpu"}
    assert 0 < obj["predicted"]["mfu"] == obj["predicted"]["training_mfu"] < 1  # pretraining: the whole step trains
    assert isinstance(obj["alternatives"], list) and obj["alternatives"]
    assert {"layout", "memory_gib", "fits", "predicted"} <= set(obj["alternatives"][0])
    mem = obj["memory_gib"]
    parts = sum(mem[k] for k in ("weights", "gradients", "optimizer", "activations", "kv_cache", "inference_buffers",
                                 "reference_model", "reward_model", "critic", "overhead"))
    assert parts == pytest.approx(mem["total"], abs=0.01)


def test_cli_json_and_table(capsys):
    assert cli_main(["--model", "llama-3.3-70b", "--gpus", "64", "--gpu-type", "h100-80gb",
                     "--global-batch-size", "128", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["fits"] and obj["layout"]["dp"] * obj["layout"]["tp"] * obj["layout"]["pp"] * obj["layout"]["cp"] == 64
    assert cli_main(["--model", "llama-3.3-70b", "--gpus", "64", "--gpu-type", "h100-80gb",
                     "--layout", "tp=8,pp=4,vpp=5,cp=1,mbs=1,recompute=selective,sp=true"]) == 0
    text = capsys.readouterr().out
    assert "tp=8 pp=4 vpp=5 cp=1 ep=1 dp=2 mbs=1 recompute=selective" in text and "Memory per GPU" in text


def test_cli_errors(capsys):
    assert cli_main(["--model", "llama-3.1-405b", "--gpus", "1024", "--layout", "tp=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: parallel.tp=3 does not divide the 128 attention heads")  # --layout = parallel.*
    assert cli_main(["--model", "llama-3.1-405b", "--gpus", "8", "--seq-len", "8192"]) == 3
    assert "smallest GPU count that fits is" in capsys.readouterr().err
    assert cli_main(["--model", "no-such-model", "--gpus", "8"]) == 2
    assert "no such preset" in capsys.readouterr().err
    assert cli_main(["--model", "tiny-cpu", "--gpus", "8", "--mode", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: plan: argument --mode")


# ---------------- explanation: step time by part, runner-up, alternatives, --layout ----------------
def _grpo_llama70b_plan():
    from megatron_rl.spec.config.loader import given_keys, load_config
    from launcher.job import load_shape, plan_job

    cfg = load_config("grpo_llama70b", [], allow_missing=True)
    return plan_job(cfg, load_shape(cfg.model.name), given=given_keys("grpo_llama70b", []))


BREAKDOWN_PLANS = {
    "dense-pretrain": lambda: plan(load_model_shape("llama-3.3-70b"), num_gpus=64, gpu_type=H100,
                                   global_batch_size=128, seq_length=4096),
    "moe-mtp-pretrain": lambda: plan(load_model_shape("deepseek-v3"), num_gpus=256, gpu_type="h200-141gb",
                                     global_batch_size=512),
    "shipped-grpo-llama70b": _grpo_llama70b_plan,
}


@pytest.mark.parametrize("case", BREAKDOWN_PLANS, ids=list(BREAKDOWN_PLANS))
def test_time_breakdown_parts_are_non_negative_and_sum_to_the_step_time(case):
    from launcher.planner import TIME_PARTS

    res = BREAKDOWN_PLANS[case]()
    for e in (res.estimate, *res.alternatives):
        parts = e.breakdown_s
        assert list(parts) == list(TIME_PARTS) and min(parts.values()) >= 0, parts
        assert sum(parts.values()) == pytest.approx(e.step_time_s, rel=1e-6)
    parts = res.estimate.breakdown_s
    assert parts["compute"] > 0 and (parts["pp_bubble"] > 0) == (res.layout.dims.pp > 1)
    rl = case == "shipped-grpo-llama70b"
    assert (parts["generation_prefill"] > 0 and parts["generation_decode"] > 0 and parts["logprob_passes"] > 0) == rl
    assert (parts["ep_all_to_all"] > 0) == (res.layout.dims.ep > 1)
    if case == "moe-mtp-pretrain":
        assert res.layout.dims.ep > 1
    obj = json.loads(res.to_json())
    assert sum(obj["time_breakdown_s"].values()) == pytest.approx(res.estimate.step_time_s, abs=1e-4)
    text = res.explain().split("Time per step", 1)[1].split("\n\n", 1)[0]
    assert all(TIME_PARTS[key] in text for key, seconds in parts.items() if seconds > 0)


def test_the_runner_up_over_slow_tp_links_loses_on_tp_communication():
    """Two layouts that differ only in TP (dp and etp follow), on a GPU whose TP links are as slow as the network between
    nodes: the larger TP must lose mainly on TP communication."""
    from dataclasses import replace

    slow_tp = replace(GPUS["h100-80gb"], name="h100-tp-over-ib", nvlink_gb_s=GPUS["h100-80gb"].internode_gb_s)
    res = evaluate(load_model_shape("llama-3.3-70b"), "pp=8,vpp=1,cp=1,mbs=1,recompute=none,sp=true,"
                   "account_for_embedding=false,account_for_loss=false", num_gpus=64, gpu_type=slow_tp,
                   global_batch_size=128, seq_length=4096)
    runner = res.runner_up
    assert runner is not None and runner.estimate is res.alternatives[0] and runner.excluded_by == {}
    differs = {k for k, v in res.layout.to_dict().items() if runner.estimate.layout.to_dict()[k] != v}
    assert differs == {"tp", "etp", "dp"} and runner.estimate.layout.dims.tp > res.layout.dims.tp
    assert runner.slower_by > 0 and runner.main_reason == "tp_comm"
    assert sum(runner.deltas_s.values()) == pytest.approx(runner.estimate.step_time_s - res.estimate.step_time_s,
                                                          rel=1e-6)
    line = res.explain().split("Runner-up   ", 1)[1].splitlines()[0]
    assert "slower" in line and line.endswith("TP communication")
    assert json.loads(res.to_json())["runner_up"]["main_reason"] == "tp_comm"


def test_alternatives_list_the_fastest_of_each_other_parallel_size_first():
    shape = load_model_shape("llama-3.3-70b")
    res = plan(shape, num_gpus=128, gpu_type=H100, global_batch_size=512, seq_length=4096, top_k=6)
    sizes = [(a.layout.dims.tp, a.layout.dims.pp, a.layout.dims.cp, a.layout.dims.ep) for a in res.alternatives]
    chosen = (res.layout.dims.tp, res.layout.dims.pp, res.layout.dims.cp, res.layout.dims.ep)
    brute = search(_workload("llama-3.3-70b", 128, 512, seq=4096), keep_all=False)
    fastest = {}
    for e in sorted(brute.fitting, key=lambda e: (e.step_time_s, e.total)):
        fastest.setdefault((e.layout.dims.tp, e.layout.dims.pp, e.layout.dims.cp, e.layout.dims.ep), e)
    distinct = len(fastest) - 1
    assert distinct >= 3 and len(res.alternatives) == 6
    head = res.alternatives[:min(distinct, 6)]
    assert chosen not in sizes[:len(head)] and len(set(sizes[:len(head)])) == len(head)
    for a in head:
        key = (a.layout.dims.tp, a.layout.dims.pp, a.layout.dims.cp, a.layout.dims.ep)
        assert a.step_time_s == fastest[key].step_time_s
    assert [a.step_time_s for a in head] == sorted(a.step_time_s for a in head)


def test_layout_arg_reads_back_as_the_same_layout():
    from launcher.planner import layout_arg

    for lay in (Layout.of(tp=8, pp=16, vpp=2, cp=2, ep=1, dp=4, micro_batch_size=2, recompute="selective",
                       sequence_parallel=True, account_for_embedding=True, account_for_loss=True),
                Layout.of(tp=1, pp=16, vpp=1, cp=1, ep=64, dp=128, micro_batch_size=1, recompute="full",
                       sequence_parallel=False, first_stage_layers=4, last_stage_layers=1)):
        parsed = parse_layout(layout_arg(lay))
        assert parsed == {k: v for k, v in lay.to_dict().items() if k != "dp" and v is not None}


def test_parse_layout_refuses_a_key_given_twice():
    with pytest.raises(ConfigError, match="micro_batch_size is given twice"):
        parse_layout("mbs=1,micro_batch_size=2")


@pytest.mark.parametrize("split", [{"first_stage_layers": 7}, {"first_stage_layers": 7, "last_stage_layers": 7},
                                   {"account_for_embedding": True, "account_for_loss": True}])
def test_pipeline_split_keys_without_pp_search_the_pp(split):
    res = plan(load_model_shape("llama-3.1-405b"), num_gpus=256, gpu_type="h200-141gb", global_batch_size=512,
               seq_length=4096, fixed=split)
    assert res.fits and res.layout.dims.pp > 1 and res.constraints == split
    assert all(res.layout.value(k) == v for k, v in split.items())


def test_a_split_that_no_pp_accepts_is_a_config_error():
    with pytest.raises(ConfigError, match=r"first_stage_layers=500: no pp gives a legal pipeline split of 126 "
                                          r"layers \(at pp=\d+: "):
        plan(load_model_shape("llama-3.1-405b"), num_gpus=256, gpu_type="h200-141gb", global_batch_size=512,
             seq_length=4096, fixed={"first_stage_layers": 500})
