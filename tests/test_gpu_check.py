"""The GPU check's CPU dry mode: ``bench/gpu_check.sh --dry-run`` end to end (tiny model, fp32), in a subprocess.

Run: ``.venv/bin/python -m pytest tests/test_gpu_check.py -q`` (one dry run, ~60-100 s on 2 cores: part 7 starts
two 2-rank jobs).
The GPU run itself (``bench/gpu_check.sh`` on an H200) needs a device; this proves its Python path on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "bench" / "gpu_check.sh"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu_check_out")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}\n{log[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return json.loads(lines[-1]), out, proc


def test_dry_run_prints_one_json_line_and_writes_it_under_out(dry_run):
    result, out, _ = dry_run
    assert json.loads((out / "gpu_check.json").read_text()) == result
    assert result["mode"] == "dry-run" and result["passed"] is True
    assert result["checks"] and all(result["checks"].values()), result["checks"]
    env = result["environment"]
    assert env["cpu_redirection_active"] is True and env["layer_spec"] == "local"
    assert env["transformer_engine"] is False
    assert result["model"]["params"] == result["model"]["planner_params"] == 90432  # tiny-cpu, untied
    assert "error" not in result and "failed_parts" not in result
    # gpu_check.sh merged step 2 in: the dry run checks that the GPU test selection still exists
    assert result["unit_tests"]["rc"] == 0 and result["checks"]["unit_tests"] is True
    assert result["install"] == {"rc": None, "summary": "skipped (dry run)"}


def test_kv_cache_logprobs_equal_training_forward_in_fp32(dry_run):
    result, _, _ = dry_run
    for section in (result["exactness_fp32"], result["generation"], result["grpo"]):
        check = section["kv_cache_vs_training_forward"]
        assert check["passed"] and check["tokens"] > 0
        assert check["max_abs_diff"] <= 1e-4 and check["tolerance"] == {"max_abs": 1e-4}
    # the same weights in transformers: identical log-probs and greedy tokens (fp32)
    assert result["exactness_fp32"]["transformers_vs_training_forward"]["max_abs_diff"] <= 1e-4
    assert result["exactness_fp32"]["greedy_tokens_vs_transformers"]["rows_equal_fraction"] == 1.0
    assert result["generation"]["transformers_vs_training_forward"]["max_abs_diff"] <= 1e-4
    # on-policy: the first GRPO update sees ratio 1 between rollout and training log-probs
    for step in (result["grpo"]["cold"], result["grpo"]["warm"]):
        assert step["first_ratio_min"] == pytest.approx(1.0, abs=1e-4)
        assert step["first_ratio_max"] == pytest.approx(1.0, abs=1e-4)


def test_training_flops_and_mfu_follow_the_hand_count(dry_run):
    result, _, _ = dry_run
    t = result["training"]
    # tiny-cpu: 2 layers, h 64, SwiGLU 128, 4 heads of 16, 2 KV groups, vocab 128 untied, seq 64.
    h, ffn, heads, groups, d, vocab, seq, layers = 64, 128, 4, 2, 16, 128, 64, 2
    attn_matrices = h * heads * d + 2 * h * groups * d + heads * d * h
    per_layer = 2 * attn_matrices + 2 * seq * heads * (d + d) + 2 * 3 * h * ffn
    by_hand = 3 * (layers * per_layer + 2 * h * vocab)  # fwd + bwd = 3 x fwd
    assert t["model_flops_per_token"] == pytest.approx(by_hand, rel=2e-3)  # the planner also counts norm weights
    tokens = t["global_batch_size"] * t["seq_length"]
    assert t["achieved_tflops"] * 1e12 == pytest.approx(t["model_flops_per_token"] * tokens / t["step_time_s"])
    assert t["mfu"] == pytest.approx(t["achieved_tflops"] / t["peak_tflops"])
    assert t["peak_tflops"] == 989.0 and t["timed_steps"] == 2 and t["step_time_s"] > 0
    planner = result["planner"]
    for key in ("training_default_runtime", "training_unfused_attention", "grpo_step_unfused_attention"):
        assert planner[key]["step_time_s"] > 0 and 0 < planner[key]["mfu"] < 1 and planner[key]["fits"]
    assert "--gpus 1 --gpu-type h200-141gb" in planner["cli"]


def test_generation_and_grpo_figures_are_present_and_consistent(dry_run):
    result, _, _ = dry_run
    g = result["generation"]
    new_tokens = g["batch"] * g["new_tokens"]
    assert g["ours_tokens_per_s"] == pytest.approx(new_tokens / g["ours_s_median"])
    assert g["transformers_tokens_per_s"] == pytest.approx(new_tokens / g["transformers_s_median"])
    assert g["speedup_vs_transformers"] == pytest.approx(g["transformers_s_median"] / g["ours_s_median"])
    assert len(g["ours_s_all"]) == len(g["transformers_s_all"]) == g["repeats"]
    assert g["forward_passes"] == g["new_tokens"] and g["greedy_tokens_vs_transformers"]["rows_equal_fraction"] == 1.0
    grpo = result["grpo"]
    for step in (grpo["cold"], grpo["warm"]):
        parts = step["time_generate_s"] + step["time_score_s"] + step["time_train_s"]
        assert step["step_time_s"] == pytest.approx(parts) and min(step["time_generate_s"], step["time_train_s"]) > 0
        assert step["completions"] == grpo["prompts_per_step"] * grpo["group_size"]
        assert 0 < step["response_length"] <= grpo["max_new_tokens"]


def test_usage_error_exits_2():
    proc = subprocess.run(["bash", str(SCRIPT), "--bogus"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "usage: bench/gpu_check.sh" in proc.stderr


def test_router_replay_figures_in_fp32(dry_run):
    """Dry run (fp32): no route differs between generation and the training forward, so replay changes nothing."""
    result, _, _ = dry_run
    replay = result["router_replay"]
    assert replay["tokens"] > 0 and replay["route_flip_fraction"] == 0.0
    assert replay["router_replay"] == replay["free_routing"]
    assert replay["free_routing"]["log_ratio_max_abs"] < 1e-5


def test_gloo_staging_part_equals_plain_gloo_in_the_dry_run(dry_run):
    """Part 7 on the CPU: the TP=2 job with the test hook (every tensor staged through a CPU buffer) equals plain
    gloo exactly, and the hook staged the TP and distributed-optimizer collectives."""
    result, out, _ = dry_run
    part = result["gloo_staging"]
    assert part["passed"] and part["reference"]["kind"] == "dry-run" and part["tolerance"] == 1e-6
    assert part["max_abs_loss_diff"] == 0.0 and part["max_abs_grad_norm_diff"] == 0.0
    assert part["staged"]["losses"] == part["reference"]["losses"] and len(part["staged"]["losses"]) == part["steps"]
    assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"} <= set(part["staged_ops"])
    assert part["staged_calls_rank0"]["all_reduce@megatron/core/tensor_parallel/mappings.py:_reduce"] > 0
    assert sorted(p.name for p in out.glob("gloo_staging_*_rank*.log")) == [
        "gloo_staging_reference_rank0.log", "gloo_staging_reference_rank1.log",
        "gloo_staging_staged_rank0.log", "gloo_staging_staged_rank1.log"]
