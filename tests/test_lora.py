"""LoRA on Megatron Core (megatron_rl/models/lora.py): adapter numerics at TP1/TP2/SP, frozen base, resume, the
merged and PEFT exports, and GRPO learning the tiny task with adapters only.

    .venv/bin/python -m pytest tests/test_lora.py -q

One 2-process torchrun job (tests/dist/lora_check.py) gives every layout's numbers, a second
(tests/dist/lora_dropout_and_tied_check.py) adapter dropout at TP1/TP2 and tied embeddings at PP2 vs PP1 with their
exports; the PEFT round trip imports a tiny random HF Llama, trains 3 LoRA SFT steps from it at TP2 with sequence
parallelism (dropout 0.1, modules_to_save: all three), exports it merged and as a PEFT adapter, and compares
``peft.PeftModel.from_pretrained`` on the HF base with the merged model.
"""

from __future__ import annotations

import json
import sys

import pytest

from helpers import REPO_ROOT, read_metrics, torchrun_check

sys.path.insert(0, str(REPO_ROOT / "tests" / "dist"))



def _layouts(rank: dict) -> dict:
    return {name: result for name, result in rank.items() if name not in ("gradient_check", "modules_to_save")}


def _max_diff(a, b) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


slow = pytest.mark.slow


# ------------------------------------------------------------------ config and planner (no torch)
@pytest.mark.parametrize("override, message", [
    ("model.lora={targets: [q_proj]}", "model.lora.targets=['q_proj']: 'q_proj' is not valid; use names from: "
                                       "linear_qkv, linear_proj, linear_fc1, linear_fc2"),
    ("model.lora={rank: 0}", "model.lora.rank=0 must be positive"),
    ("model.lora={alpha: -1}", "model.lora.alpha=-1.0 must be positive"),
    ("model.lora={dropout: 1.0}", "model.lora.dropout=1.0 must be in [0, 1)"),
    ("model.lora={targets: []}", "model.lora.targets=[]: empty is not valid"),
    ("model.lora={modules_to_save: [lm_head]}", "model.lora.modules_to_save=['lm_head']: 'lm_head' is not valid; "
                                                "use names from: embedding, output_layer, final_layernorm"),
])
def test_bad_lora_settings_are_refused(override, message):
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_bad_lora_target_exits_2_with_one_line(launch):
    result = launch("--dry-run", "model.lora={rank: 4, targets: [linear_qkv, o_proj]}")
    assert result.returncode == 2 and "model.lora.targets" in result.stderr and "linear_fc2" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_planner_counts_adapter_gradients_and_state_only():
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from launcher.planner.costs import Workload
    from launcher.planner.estimate import Layout, training_estimate
    from launcher.planner.gpus import get_gpu
    from launcher.planner.inputs import lora_trainable_fraction, rollout_sizing, runtime_of

    shape = load_model_shape("llama-3.3-70b")
    cfg = load_config(None, ["model.name=llama-3.3-70b", "algorithm.kl_coef=0.05", "model.lora={rank: 16}"])
    full = load_config(None, ["model.name=llama-3.3-70b", "algorithm.kl_coef=0.05"])
    # 80 layers x rank 16 x (qkv 8192 + 80 x 128, proj 8192 + 8192, fc1 8192 + 2 x 28672, fc2 28672 + 8192)
    adapters = 80 * 16 * (8192 + 10240 + 8192 + 8192 + 8192 + 57344 + 28672 + 8192)
    assert adapters == 175_636_480
    assert lora_trainable_fraction(shape, cfg.model.lora) == pytest.approx(adapters / (shape.num_params() + adapters))
    assert runtime_of(cfg, shape).trainable_fraction == lora_trainable_fraction(shape, cfg.model.lora)
    assert runtime_of(full, shape).trainable_fraction == 1.0
    assert not rollout_sizing(cfg, shape, runtime_of(cfg, shape)).reference_model  # the base, not a copy
    w = dict(shape=shape, gpu=get_gpu("h100-80gb"), num_gpus=8, seq_length=4096, global_batch_size=64)
    layout = Layout.of(tp=8, pp=1, vpp=1, cp=1, ep=1, dp=1, micro_batch_size=1, recompute="full", sequence_parallel=True)
    lora_est = training_estimate(Workload(**w, runtime=runtime_of(cfg, shape)), layout)
    full_est = training_estimate(Workload(**w, runtime=runtime_of(full, shape)), layout)
    fraction = runtime_of(cfg, shape).trainable_fraction
    assert lora_est.weights == full_est.weights  # the frozen base still costs its weights
    assert lora_est.gradients == pytest.approx(full_est.gradients * fraction)
    assert lora_est.optimizer == pytest.approx(full_est.optimizer * fraction) and 0 < fraction < 0.01


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_check")
    ranks = torchrun_check("lora_check.py", out)
    return out, ranks


@slow
def test_adapter_gradients_follow_the_chain_rule_through_the_merged_weight(layouts):
    _, ranks = layouts
    check = ranks[0]["gradient_check"]
    assert check["linears"] == 8 and check["max_grad"] > 0.1 and check["max_diff"] < 1e-5


@slow
def test_zero_initialised_adapters_leave_the_base_unchanged(layouts):
    _, ranks = layouts
    for name, result in _layouts(ranks[0]).items():
        assert _max_diff(result["init_on"], result["init_off"]) == 0.0, name
        assert _max_diff(result["on"], result["off"]) > 1e-2, name  # trained: the adapters matter


@slow
def test_merged_weights_equal_the_adapter_forward(layouts):
    _, ranks = layouts
    for name, result in _layouts(ranks[0]).items():  # per TP shard: W + B A alpha / r, at TP1, TP2 and TP2 + SP
        assert _max_diff(result["merged"], result["on4"]) < 1e-5, name


@slow
def test_tp2_and_sequence_parallel_train_like_tp1(layouts):
    _, ranks = layouts
    tp1 = ranks[0]["dp2"]
    for name in ("tp2", "tp2sp"):
        result = ranks[0][name]
        for ours, ref in zip(result["steps"], tp1["steps"], strict=True):
            assert abs(ours["loss"] - ref["loss"]) < 1e-5 and abs(ours["grad_norm"] - ref["grad_norm"]) < 1e-5, name
        assert _max_diff(result["on"], tp1["on"]) < 1e-5, name
        assert abs(result["trainable_fraction"] - tp1["trainable_fraction"]) < 1e-12


@slow
def test_routed_expert_adapters_train_alike_split_over_expert_tp_and_over_ep(layouts):
    """tiny-cpu-moe with adapters on every routed expert's fc1 and fc2: at TP2 with SP (each expert split over
    expert-TP 2: the dispatcher gathers tokens and sums outputs, and the replicated A or B of an expert linear
    gets its gradient summed over the group) and at TP2 x EP2 with SP (two whole experts per rank), step by step
    as TP1 x DP2; and grouped experts (Megatron's TEGroupedMLP, one adapter per expert in each grouped linear) at
    TP1 x DP2 and TP2 x EP2 with SP, loaded from the sequential experts' untrained checkpoint, too."""
    _, ranks = layouts
    ref = ranks[0]["moe_dp2"]
    for name in ("moe_tp2sp", "moe_tp2ep2sp", "moe_grouped_dp2", "moe_grouped_tp2ep2sp"):
        result = ranks[0][name]
        if name != "moe_grouped_dp2":  # the expert path (explicit expert communication) ran
            assert result["expert_adapter_numel"] > 0, name
        for ours, theirs in zip(result["steps"], ref["steps"], strict=True):
            assert abs(ours["loss"] - theirs["loss"]) < 1e-5, name
            assert abs(ours["grad_norm"] - theirs["grad_norm"]) < 1e-5, name
        assert _max_diff(result["on"], ref["on"]) < 1e-5 and _max_diff(result["on"], result["off"]) > 1e-2, name
    # 2 layers x rank 4 x (4 experts x (fc1 64+128, fc2 64+64) + qkv 64+128 + proj 64+64) = 12800 at TP1
    assert ref["adapter_numel"] == 12800
    from megatron_rl.spec.config.schema import LoraConfig
    from megatron_rl.spec.model_shape import load_model_shape
    from launcher.planner.inputs import lora_trainable_fraction

    lora = LoraConfig(rank=4, alpha=8, targets=["linear_qkv", "linear_proj", "experts.linear_fc1", "experts.linear_fc2"])
    planned = lora_trainable_fraction(load_model_shape("tiny-cpu-moe"), lora)  # the planner counts what trains
    assert all(ranks[0][name]["trainable_fraction"] == pytest.approx(planned, abs=1e-12)
               for name in ("moe_dp2", "moe_tp2sp", "moe_tp2ep2sp", "moe_grouped_dp2", "moe_grouped_tp2ep2sp"))
    assert ranks[0]["moe_grouped_dp2"]["adapter_numel"] == ref["adapter_numel"]
    for rank in ranks:  # per-expert seeds: a fresh grouped adapter's A is its sequential twin's, at either layout
        assert rank["moe_grouped_dp2"]["fresh_a_vs_sequential"] == rank["moe_grouped_tp2ep2sp"]["fresh_a_vs_sequential"] == 0


@slow
def test_mla_and_expert_adapters_on_deepseek_v3_train_alike_and_load_in_peft(tmp_path):
    """tiny-cpu-deepseek-v3 (MLA with q-LoRA, a dense first layer, 8 routed experts + 1 shared expert) with adapters
    on every MLA projection (the TP-replicated down projections included), the dense MLP, every routed expert and the
    shared expert: TP1 x DP2 and TP2 x EP2 with SP agree step by step; merged = adapter forward; the
    planner's trainable fraction is the engine's; the merged export is transformers' DeepseekV3 with our log-probs,
    and the PEFT adapter (MLA and shared experts by target_modules, the fused routed experts by target_parameters) on
    the base export gives the merged export's logits."""
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    ranks = torchrun_check("lora_deepseek_check.py", tmp_path)
    ref = ranks[0]["dp2"]
    assert ref["shared_adapters"] == 2 * 2 * 2  # 2 MoE layers x (fc1, fc2) x (A, B)
    for name, result in ranks[0].items():
        assert result["kinds"] == ["column", "duplicated", "row"], name
        for ours, theirs in zip(result["steps"], ref["steps"], strict=True):
            assert abs(ours["loss"] - theirs["loss"]) < 1e-5, name
            assert abs(ours["grad_norm"] - theirs["grad_norm"]) < 1e-5, name
        assert _max_diff(result["on"], ref["on"]) < 1e-4 and _max_diff(result["on"], result["off"]) > 1e-2, name
        assert _max_diff(result["merged"], result["on"]) < 1e-5, name
    assert ranks[0]["tp2ep2sp"]["expert_adapters"] > 0
    from megatron_rl.spec.config.schema import LoraConfig
    from megatron_rl.spec.model_shape import load_model_shape
    from launcher.planner.inputs import lora_trainable_fraction

    from lora_deepseek_check import TARGETS

    planned = lora_trainable_fraction(load_model_shape("tiny-cpu-deepseek-v3"), LoraConfig(rank=4, alpha=8,
                                                                                          targets=TARGETS))
    assert all(result["trainable_fraction"] == pytest.approx(planned, abs=1e-12) for result in ranks[0].values())

    from megatron_rl.conversion.export import export_checkpoint_to_hf
    from megatron_rl.conversion.lora_export import export_peft_adapter

    for ckpt, out in (("ckpt_base", "hf_base"), ("ckpt", "hf_merged")):  # in this process: the CLI is tested above
        export_checkpoint_to_hf(tmp_path / ckpt, tmp_path / out, model="tiny-cpu-deepseek-v3")
    export_peft_adapter(tmp_path / "ckpt", tmp_path / "adapter", base_hf=tmp_path / "hf_base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    # PEFT on transformers 5 reads gate/up/down_proj target_modules of a MoE model as its fused experts': the dense
    # layer's and the shared expert's are adapted through their weights
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", *sorted(
        f"{parent}.{linear}.weight" for parent in ("mlp", "shared_experts") for linear in ("gate_proj", "up_proj",
                                                                                         "down_proj"))]
    assert config["target_modules"] == sorted(["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                                               "self_attn.kv_b_proj", "self_attn.o_proj"])
    tokens = torch.randint(1, 128, (4, 17), generator=torch.Generator().manual_seed(3))  # the check's tokens
    load = lambda folder: transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # noqa: E731
    merged = load(tmp_path / "hf_merged")
    adapted = peft.PeftModel.from_pretrained(load(tmp_path / "hf_base"), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        merged_logits, peft_logits = merged(tokens[:, :-1]).logits, adapted(tokens[:, :-1]).logits
    logp = torch.log_softmax(merged_logits.float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert _max_diff(logp.tolist(), ranks[0]["tp2ep2sp"]["on"]) < 1e-4
    assert float((peft_logits - merged_logits).abs().max()) < 1e-4


@slow
def test_optimizer_state_is_the_adapters_only(layouts):
    _, ranks = layouts
    for name, result in _layouts(ranks[0]).items():
        assert result["trainable_numel"] == result["adapter_numel"], name  # base frozen
        # Adam's two moments of the adapters and nothing else; the distributed optimizer splits them over DP
        held = sum(rank[name]["optimizer_state_numel"] for rank in ranks)
        assert held == 2 * sum(rank[name]["adapter_numel"] for rank in ranks) // result["dp"], name
        assert result["trainable_fraction"] < 0.1, name  # over the whole model, whatever this rank holds
    # tiny-cpu: 2 layers x rank 4 x (qkv 64+128, proj 64+64, fc1 64+256, fc2 128+64) = 6656 of 97088 parameters
    assert ranks[0]["dp2"]["adapter_numel"] == 6656 and ranks[0]["dp2"]["total_numel"] == 97088
    assert abs(ranks[0]["dp2"]["trainable_fraction"] - 6656 / 97088) < 1e-9


@slow
def test_resume_from_a_lora_checkpoint_is_exact(layouts):
    _, ranks = layouts
    for name, result in _layouts(ranks[0]).items():
        assert result["resumed_step4"] == result["step4"], name


@slow
def test_modules_to_save_train_in_full_with_their_optimizer_state(layouts):
    _, ranks = layouts
    tp2, tied = ranks[0]["modules_to_save"]["tp2"], ranks[0]["modules_to_save"]["tied"]
    assert tp2["saved_names"] == ["decoder.final_layernorm.weight", "embedding.word_embeddings.weight",
                                  "output_layer.weight"]
    assert tied["saved_names"] == ["decoder.final_layernorm.weight", "embedding.word_embeddings.weight"]  # shared
    # tiny-cpu: adapters 6656 + embedding 128 x 64 + output layer 128 x 64 (untied) + final norm 64
    assert tp2["trainable_fraction"] == pytest.approx((6656 + 2 * 8192 + 64) / 97088, abs=1e-12)
    assert tied["trainable_fraction"] == pytest.approx((6656 + 8192 + 64) / (97088 - 8192), abs=1e-12)
    import dataclasses

    from megatron_rl.spec.config.schema import LoraConfig
    from megatron_rl.spec.model_shape import load_model_shape
    from launcher.planner.inputs import lora_trainable_fraction

    lora = LoraConfig(rank=4, alpha=8, modules_to_save=["embedding", "output_layer", "final_layernorm"])
    shape = load_model_shape("tiny-cpu")
    assert lora_trainable_fraction(shape, lora) == pytest.approx(tp2["trainable_fraction"], abs=1e-12)  # the planner
    assert lora_trainable_fraction(dataclasses.replace(shape, tie_embeddings=True), lora) == \
        pytest.approx(tied["trainable_fraction"], abs=1e-12)
    for name, result in ranks[0]["modules_to_save"].items():
        assert result["trainable_numel"] == result["adapter_numel"] + result["saved_numel"], name
        held = sum(rank["modules_to_save"][name]["optimizer_state_numel"] for rank in ranks)
        assert held == 2 * sum(rank["modules_to_save"][name]["trainable_numel"] for rank in ranks) // result["dp"]
        assert result["saved_change"] > 1e-3, name


@slow
def test_the_kl_reference_keeps_the_base_weights_of_modules_to_save(layouts):
    _, ranks = layouts
    for name, result in ranks[0]["modules_to_save"].items():
        assert _max_diff(result["ref_step0"], result["base"]) == 0.0, name  # step 0: the policy
        assert _max_diff(result["policy"], result["base"]) > 1e-2, name
        assert _max_diff(result["trained_modules_only"], result["base"]) > 1e-2, name  # the modules trained
        assert _max_diff(result["ref_trained"], result["base"]) == 0.0, name  # still the untrained base
        assert _max_diff(result["policy_after_reference"], result["policy"]) == 0.0, name  # swapped back
        # resumed from the checkpoint and the reference folder
        assert _max_diff(result["resumed_policy"], result["policy"]) == 0.0, name
        assert _max_diff(result["resumed_ref"], result["base"]) == 0.0, name


@pytest.fixture(scope="module")
def dropout_and_tied(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_dropout_and_tied")
    return out, torchrun_check("lora_dropout_and_tied_check.py", out)


@slow
def test_dropout_applies_to_the_adapter_input_only(dropout_and_tied):
    _, ranks = dropout_and_tied
    for name, result in ranks[0]["dropout"].items():  # TP1 x DP2 and TP2, model.lora.dropout=0.25
        assert result["zero_b_train"] == result["base_train"], name  # B = 0: the base exactly, dropout or not
        assert result["eval1"] == result["eval2"], name  # eval: deterministic
        assert _max_diff(result["merged_eval"], result["eval1"]) < 1e-5, name  # and the merged weights
        assert _max_diff(result["eval1"], result["base_train"]) > 1e-2, name  # the random B matters
        assert _max_diff(result["train1"], result["eval1"]) > 1e-3, name  # training: masks applied,
        assert _max_diff(result["train1"], result["train2"]) > 1e-3, name  # fresh each forward
        for kind, draws in result["linear_draws"].items():  # one linear: the mean of 400 draws -> eval's output
            assert draws["single"] > 0.02 * draws["scale"], (name, kind)
            assert draws["mean"] < 0.15 * draws["single"], (name, kind, draws)


@slow
def test_dropout_masks_agree_over_tp_and_full_recompute_replays_them_and_trains_the_adapters(dropout_and_tied):
    _, ranks = dropout_and_tied
    # a column linear's A (and a row linear's B) is replicated over TP: with different masks per rank the copies
    # would get different gradients; after three steps with dropout they are still bit-identical
    tp2 = [rank["dropout"]["tp2"]["replicated_digests"] for rank in ranks]
    assert len(tp2[0]) == 8 and tp2[0] == tp2[1]
    # parallel.recompute=full: each layer re-runs in backward, from a frozen embedding's output (which then has to
    # require grad, or the adapters get none: grad_norm 0) and with the first pass's masks
    dp2 = ranks[0]["dropout"]["dp2"]
    first, recomputed = dp2["steps"][0], dp2["recompute_step"]
    assert first["grad_norm"] > 0.1
    assert abs(first["loss"] - recomputed["loss"]) < 1e-6 and abs(first["grad_norm"] - recomputed["grad_norm"]) < 1e-6


@slow
def test_tied_embeddings_with_modules_to_save_train_alike_at_pp2_and_pp1(dropout_and_tied):
    _, ranks = dropout_and_tied
    pp1, pp2 = ranks[0]["tied_pipeline"]["pp1"], ranks[0]["tied_pipeline"]["pp2"]
    for ours, ref in zip(pp2["steps"], pp1["steps"], strict=True):
        assert abs(ours["loss"] - ref["loss"]) < 1e-5 and abs(ours["grad_norm"] - ref["grad_norm"]) < 1e-5
    assert _max_diff(pp2["policy"], pp1["policy"]) < 1e-5 and _max_diff(pp2["policy"], pp2["base"]) > 1e-2
    # PP2: the first stage's embedding and the last stage's copy trained in step, and like PP1's one weight
    stages = [rank["tied_pipeline"]["pp2"] for rank in ranks]
    assert stages[0]["shared_digest"] == stages[1]["shared_digest"]
    assert all(stage["shared_diff_to_pp1"] < 1e-5 and stage["shared_change"] > 1e-3 for stage in stages)
    import dataclasses

    from megatron_rl.spec.config.schema import LoraConfig
    from megatron_rl.spec.model_shape import load_model_shape
    from launcher.planner.inputs import lora_trainable_fraction

    tied = dataclasses.replace(load_model_shape("tiny-cpu"), tie_embeddings=True)
    planned = lora_trainable_fraction(tied, LoraConfig(rank=4, alpha=8, modules_to_save=["output_layer"]))
    assert planned == pytest.approx((6656 + 8192) / (97088 - 8192), abs=1e-12)
    for result in (pp1, pp2):  # the last stage's copy is not counted twice
        assert result["trainable_fraction"] == pytest.approx(planned, abs=1e-12)
        assert _max_diff(result["ref_trained"], result["base"]) == 0.0  # the KL reference: the untrained base


@slow
def test_tied_pp2_exports_stay_tied(dropout_and_tied, tmp_path, launch):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import torch
    from safetensors.torch import load_file

    out, ranks = dropout_and_tied
    model = tmp_path / "tiny-cpu-tied.yaml"
    model.write_text((REPO_ROOT / "configs" / "models" / "tiny-cpu.yaml").read_text()
                     .replace("tie_embeddings: false", "tie_embeddings: true"))
    exports = {"merged": ("--ckpt", str(out / "ckpt_tied_pp2"), "--model", str(model)),
               "base": ("--ckpt", str(out / "ckpt_tied_pp2_base"), "--model", str(model)),
               "adapter": ("--ckpt", str(out / "ckpt_tied_pp2"), "--lora-adapter", "--base-hf", str(tmp_path / "base"))}
    for name, args in exports.items():
        result = launch("convert", "megatron-to-hf", *args, "--out", str(tmp_path / name))
        assert result.returncode == 0, (name, result.stderr[-3000:])
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert merged.config.tie_word_embeddings
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(1, 128, (4, 17), generator=torch.Generator().manual_seed(3))  # lora_check's tokens
    with torch.no_grad():
        logp = torch.log_softmax(merged(tokens[:, :-1]).logits.float(), -1)
    hf = logp.gather(-1, tokens[:, 1:, None])[..., 0].tolist()
    assert _max_diff(hf, ranks[0]["tied_pipeline"]["pp2"]["policy"]) < 1e-4
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["embed_tokens", "lm_head"] and config["ensure_weight_tying"] is True
    weights = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert torch.equal(weights["base_model.model.lm_head.weight"], weights["base_model.model.model.embed_tokens.weight"])
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    inner = adapted.base_model.model
    assert inner.lm_head.modules_to_save["default"].weight is inner.model.embed_tokens.modules_to_save["default"].weight
    with torch.no_grad():
        assert float((adapted(tokens).logits - merged(tokens).logits).abs().max()) < 1e-4


@slow
def test_merged_export_matches_our_engine_at_every_layout(layouts, tmp_path, launch):
    transformers = pytest.importorskip("transformers")
    import torch

    out, ranks = layouts
    tokens = torch.randint(1, 128, (4, 17), generator=torch.Generator().manual_seed(3))  # lora_check's tokens
    merged = {}
    for name, model_name in (("dp2", "tiny-cpu"), ("tp2sp", "tiny-cpu"), ("moe_tp2ep2sp", "tiny-cpu-moe"),
                             ("moe_grouped_tp2ep2sp", "tiny-cpu-moe")):
        hf_dir = tmp_path / f"hf_{name}"
        result = launch("convert", "megatron-to-hf", "--ckpt", str(out / f"ckpt_{name}"), "--out", str(hf_dir),
                        "--model", model_name)
        assert result.returncode == 0, result.stderr[-3000:]
        model = merged[name] = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens[:, :-1]).logits.float(), -1)
        hf = logp.gather(-1, tokens[:, 1:, None])[..., 0].tolist()
        assert _max_diff(hf, ranks[0][name]["on"]) < 1e-4, name
    # Qwen3-MoE's PEFT adapter (experts through target_parameters) on the export of the untrained checkpoint (zero
    # B: the base) gives the merged export's logits
    peft = pytest.importorskip("peft")
    from megatron_rl.conversion.export import export_checkpoint_to_hf
    from megatron_rl.conversion.lora_export import export_peft_adapter

    export_checkpoint_to_hf(out / "ckpt_base_moe_tp2ep2sp", tmp_path / "hf_moe_base", model="tiny-cpu-moe")
    export_peft_adapter(out / "ckpt_moe_tp2ep2sp", tmp_path / "moe_adapter", base_hf=tmp_path / "hf_moe_base")
    config = json.loads((tmp_path / "moe_adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["target_modules"] == ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_moe_base", dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "moe_adapter")).eval()
    with torch.no_grad():
        assert float((adapted(tokens).logits - merged["moe_tp2ep2sp"](tokens).logits).abs().max()) < 1e-4
    # the grouped experts' checkpoint holds its adapters under the sequential experts' keys: PEFT loads its export
    export_peft_adapter(out / "ckpt_moe_grouped_tp2ep2sp", tmp_path / "grouped_adapter", base_hf=tmp_path / "hf_moe_base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_moe_base", dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "grouped_adapter")).eval()
    with torch.no_grad():
        assert float((adapted(tokens).logits - merged["moe_grouped_tp2ep2sp"](tokens).logits).abs().max()) < 1e-4


# ------------------------------------------------------------------ PEFT round trip from an HF-imported model
@pytest.fixture(scope="module")
def peft_round_trip(tmp_path_factory):
    import torch
    import transformers

    from convert_fixtures import COMMON, TOKENIZER_FILES, randomize_weights
    from helpers import run_launch

    root = tmp_path_factory.mktemp("lora_peft")
    base = root / "hf_base"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**dict(COMMON, vocab_size=128, tie_word_embeddings=False, rope_theta=10000.0))
    model = transformers.LlamaForCausalLM(config).eval()
    randomize_weights(model)
    model.save_pretrained(str(base))
    for name, text in TOKENIZER_FILES.items():
        (base / name).write_text(text)
    steps = [
        ("convert", "hf-to-megatron", "--hf", str(base), "--out", str(root / "imported")),
        ("--config", "sft_tiny", f"model.name={base}", f"model.init_from={root / 'imported'}",
         "model.lora={rank: 4, alpha: 8, dropout: 0.1, targets: [linear_qkv, linear_proj, linear_fc1, linear_fc2], "
         "modules_to_save: [embedding, output_layer, final_layernorm]}",
         "parallel.tp=2", "parallel.sequence_parallel=true", "run.steps=3", "optimizer.lr=2e-2",
         "optimizer.lr_warmup_steps=0", "algorithm.global_batch_size=8", "parallel.micro_batch_size=4",
         f"run.dir={root / 'sft'}"),
        ("convert", "megatron-to-hf", "--ckpt", str(root / "sft" / "checkpoints"), "--out", str(root / "merged"),
         "--model", str(base)),
        ("convert", "megatron-to-hf", "--ckpt", str(root / "sft" / "checkpoints"), "--out", str(root / "adapter"),
         "--lora-adapter", "--base-hf", str(base)),
    ]
    for args in steps:
        result = run_launch(*args)
        assert result.returncode == 0, (args, result.stdout[-3000:] + result.stderr[-3000:])
    return root


@slow
def test_peft_adapter_on_the_hf_base_equals_the_merged_export(peft_round_trip):
    peft = pytest.importorskip("peft")
    import torch
    import transformers
    from safetensors.torch import load_file

    root = peft_round_trip
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["lora_dropout"] == 0.1
    assert config["target_modules"] == sorted(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
    weights = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    attn = "base_model.model.model.layers.1.self_attn."
    assert torch.equal(weights[attn + "q_proj.lora_A.weight"], weights[attn + "k_proj.lora_A.weight"])  # shared A
    assert weights[attn + "q_proj.lora_B.weight"].shape == (64, 4)  # 4 heads x 16
    assert weights[attn + "k_proj.lora_B.weight"].shape == (32, 4)  # GQA: 2 groups x 16
    # modules_to_save as PEFT's save_pretrained writes them (the final norm by its path: PEFT matches suffixes)
    assert config["modules_to_save"] == ["embed_tokens", "lm_head", "model.norm"]
    saved = {k: v.shape for k, v in weights.items() if "lora_" not in k}
    assert saved == {"base_model.model.model.embed_tokens.weight": (128, 64), "base_model.model.lm_head.weight": (128, 64),
                     "base_model.model.model.norm.weight": (64,)}

    tokens = torch.randint(1, 128, (3, 20), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf_base", dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(tokens).logits
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}
    adapted = peft.PeftModel.from_pretrained(base, str(root / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        peft_logits, merged_logits = adapted(tokens).logits, merged(tokens).logits
    assert float((peft_logits - base_logits).abs().max()) > 1e-3  # the adapters were trained
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):  # and the modules, merged too
        assert float((merged.state_dict()[name] - base_weights[name]).abs().max()) > 1e-4, name
    assert float((peft_logits - merged_logits).abs().max()) < 1e-4


@slow
def test_lora_adapter_export_refuses_bad_input(peft_round_trip, launch, tmp_path):
    root = peft_round_trip
    no_base = launch("convert", "megatron-to-hf", "--ckpt", str(root / "sft" / "checkpoints"), "--out",
                     str(tmp_path / "a"), "--lora-adapter")
    assert no_base.returncode == 2 and "--base-hf" in no_base.stderr and len(no_base.stderr.strip().splitlines()) == 1
    not_lora = launch("convert", "megatron-to-hf", "--ckpt", str(root / "imported"), "--out", str(tmp_path / "b"),
                      "--lora-adapter", "--base-hf", str(root / "hf_base"))
    assert not_lora.returncode == 2 and "no LoRA adapters" in not_lora.stderr, not_lora.stderr[-2000:]
    assert len(not_lora.stderr.strip().splitlines()) == 1 and not (tmp_path / "b").exists()


# ------------------------------------------------------------------ GRPO with LoRA from an SFT checkpoint
@slow
def test_grpo_lora_tiny_trains_adapters_and_the_output_layer_from_an_sft_checkpoint(launch, tmp_path):
    """The shipped LoRA config for 20 of its steps (its learning is a figure measured at 3 seeds, in the README)."""
    sft = launch("--config", "sft_tiny", "data.task=first_digit", "run.steps=30", "algorithm.global_batch_size=128",
                 "optimizer.lr=2e-3", f"run.dir={tmp_path / 'sft'}", timeout=600)
    assert sft.returncode == 0, sft.stderr[-3000:]
    # packed rows (parallel.micro_batch_tokens): every step's first ratio is 1, generation's log-probs with the
    # adapters on equal the packed training forward's (fp32 rounding: at most 8.6e-6 over 150 steps' tokens for
    # seeds 1234, 1 and 2)
    run = launch("--config", "grpo_lora_tiny", f"model.init_from={tmp_path / 'sft' / 'checkpoints'}",
                 f"run.dir={tmp_path / 'grpo'}", "parallel.micro_batch_tokens=256", "run.steps=20", timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "LoRA:" in run.stdout and "of the parameters are trainable" in run.stdout
    steps = [m for m in read_metrics(tmp_path / "grpo") if m.get("phase", "train") == "train" and "reward_mean" in m]
    assert all(m["trainable_fraction"] == steps[0]["trainable_fraction"] for m in steps)
    # rank-8 adapters (13,312) + the output layer (128 x 64) of 90,432 + 13,312 parameters
    assert steps[0]["trainable_fraction"] == pytest.approx((13312 + 8192) / (90432 + 13312), abs=1e-9)
    assert len(steps) == 20
    assert all(abs(m["first_ratio_min"] - 1) < 3e-5 and abs(m["first_ratio_max"] - 1) < 3e-5 for m in steps)
    assert any(m["grad_norm"] > 0 for m in steps)  # the adapters and the output layer train
