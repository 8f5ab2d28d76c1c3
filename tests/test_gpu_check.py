"""The device call rehearsed here: ``bench/gpu_check.sh --rehearse`` end to end (tiny model, fp32), in a subprocess.

The rehearsal is the GPU machine's call on this CPU: ``--prepare`` downloads the carried wheels (PyPI), a fresh venv
holds only the GPU image's packages (``bench/gpu_image.py``), the wheels install with ``pip --no-index`` and the
network refused, then the check's CPU mode (the same Python path as ``--dry-run``) and the collection of the unit
tests the GPU runs.

Run: ``.venv/bin/python -m pytest tests/test_gpu_check.py -q`` (one rehearsal, ~60-110 s on 2 cores: part 7 starts
two 2-rank jobs).
The GPU run itself (``bench/gpu_check.sh`` on an H100/H200) needs a device; this proves everything up to it on the CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "bench" / "gpu_check.sh"


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[dict, Path, subprocess.CompletedProcess]:
    out, wheels = tmp_path_factory.mktemp("gpu_check_out"), tmp_path_factory.mktemp("gpu_wheels")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "2",
           "GPU_CHECK_WHEELS": str(wheels)}
    proc = subprocess.run(["bash", str(SCRIPT), "--rehearse"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    install = (out / "install.log").read_text() if (out / "install.log").exists() else ""
    assert proc.returncode == 0, (f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}\n"
                                  f"{install[-2000:]}\n{log[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return json.loads(lines[-1]), out, proc


def test_dry_run_prints_one_json_line_and_writes_it_under_out(rehearsal):
    result, out, _ = rehearsal
    assert json.loads((out / "gpu_check.json").read_text()) == result
    assert result["mode"] == "dry-run" and result["passed"] is True
    assert result["checks"] and all(result["checks"].values()), result["checks"]
    env = result["environment"]
    assert env["cpu_redirection_active"] is True and env["layer_spec"] == "local"
    assert env["transformer_engine"] is False
    assert result["model"]["params"] == result["model"]["planner_params"] == 90432  # tiny-cpu, untied
    assert "error" not in result and "failed_parts" not in result
    # gpu_check.sh merged step 3 in: the rehearsal collects every unit test the GPU runs, with the image's packages
    assert result["unit_tests"]["rc"] == 0 and result["checks"]["unit_tests"] is True
    assert " collected" in result["unit_tests"]["summary"]


def test_the_rehearsal_installs_from_the_carried_wheels_alone_without_network(rehearsal):
    """--prepare's wheels, installed with no index into the image's venv; the checkout's own presets load."""
    result, out, _ = rehearsal
    assert result["install"]["rc"] == 0 and result["checks"]["install"] is True
    summary = result["install"]["summary"]
    for wheel in ("megatron_core-0.19.2", "omegaconf-2.4.0", "submitit-1.5.4"):
        assert wheel in summary
    assert "tiny-cpu 90432 params; grpo_tiny grpo" in summary and f"checkout {REPO_ROOT}" in summary
    assert "gpu_check_site" in summary.split("megatron-core 0.19.2 from ")[1]  # the carried wheel, not this venv's
    assert result["environment"]["package_path"] == str(REPO_ROOT)
    rehearsal_python = result["rehearsal"]["python"]
    assert rehearsal_python != sys.executable and "gpu_check_image" in rehearsal_python
    assert result["rehearsal"]["network"].startswith("refused")


def test_the_image_venv_holds_only_the_image_packages(tmp_path):
    """bench/gpu_image.py: the image's distributions and their requirements; not the project or what travels."""
    bench = str(REPO_ROOT / "bench")
    sys.path.insert(0, bench)
    try:
        import gpu_image
    finally:
        sys.path.remove(bench)
    names = set(gpu_image.closure())
    assert {"torch", "numpy", "transformers", "safetensors", "pyyaml", "pytest", "cloudpickle"} <= names
    assert not names & {"megatron-rl", "megatron-core", "omegaconf", "submitit", "datasets", "peft"}
    python = gpu_image.make(tmp_path / "venv")
    probe = ("import importlib.util as u; print([m for m in ('torch', 'transformers', 'megatron', 'omegaconf', "
             "'megatron_rl', 'launcher', 'datasets') if u.find_spec(m)])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                           check=True, timeout=60).stdout
    assert found.strip() == "['torch', 'transformers']"


def test_the_install_check_fails_on_a_checkout_whose_presets_do_not_travel(tmp_path):
    """The mistake of the old carried wheel (its shipped/ links dangled: 0 presets): the install check names it."""
    copy = tmp_path / "checkout"
    shutil.copytree(REPO_ROOT / "megatron_rl", copy / "megatron_rl", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO_ROOT / "launcher", copy / "launcher", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))  # configs/ and slurm/ left behind
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(copy)}
    check = [sys.executable, str(REPO_ROOT / "bench" / "gpu_install_check.py")]
    broken = subprocess.run([*check, str(copy)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert broken.returncode != 0 and "is missing" in broken.stderr
    shutil.copytree(REPO_ROOT / "configs", copy / "configs")
    whole = subprocess.run([*check, str(copy)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0 and "tiny-cpu 90432 params" in whole.stdout, whole.stderr


def test_kv_cache_logprobs_equal_training_forward_in_fp32(rehearsal):
    result, _, _ = rehearsal
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


def test_training_flops_and_mfu_follow_the_hand_count(rehearsal):
    result, _, _ = rehearsal
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


def test_generation_and_grpo_figures_are_present_and_consistent(rehearsal):
    result, _, _ = rehearsal
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


def test_the_decode_graphs_part_reports_the_optimizer_offload(rehearsal):
    """Part 4c's four offload phases: the same bytes each way every phase, through one host buffer that holds them
    (pinned on the GPU; plain memory here)."""
    offload = rehearsal[0]["decode_graphs"]["optimizer_offload"]
    assert offload["phases"] == 4 and offload["bytes_per_phase"] > 0 and offload["host_buffer_pinned"] is None
    assert offload["bytes_per_phase"] <= offload["host_buffer_bytes"] < offload["bytes_per_phase"] * 1.1
    assert offload["offload_s_per_phase"] > 0 and offload["restore_s_per_phase"] > 0


def test_router_replay_figures_in_fp32(rehearsal):
    """Dry run (fp32): no route differs between generation and the training forward, so replay changes nothing."""
    result, _, _ = rehearsal
    replay = result["router_replay"]
    assert replay["tokens"] > 0 and replay["route_flip_fraction"] == 0.0
    assert replay["router_replay"] == replay["free_routing"]
    assert replay["free_routing"]["log_ratio_max_abs"] < 1e-5


def test_gloo_staging_part_equals_plain_gloo_in_the_dry_run(rehearsal):
    """Part 7 on the CPU: the TP=2 job with the test hook (every tensor staged through a CPU buffer) equals plain
    gloo exactly, and the hook staged the TP and distributed-optimizer collectives."""
    result, out, _ = rehearsal
    part = result["gloo_staging"]
    assert part["passed"] and part["reference"]["kind"] == "dry-run" and part["tolerance"] == 1e-6
    assert part["initial_weights_equal"] is True  # on one GPU the reference runs on the CPU: the same weights
    assert part["max_abs_loss_diff"] == 0.0 and part["max_abs_grad_norm_diff"] == 0.0
    assert part["staged"]["losses"] == part["reference"]["losses"] and len(part["staged"]["losses"]) == part["steps"]
    assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"} <= set(part["staged_ops"])
    assert part["staged_calls_rank0"]["all_reduce@megatron/core/tensor_parallel/mappings.py:_reduce"] > 0
    assert sorted(p.name for p in out.glob("gloo_staging_*_rank*.log")) == [
        "gloo_staging_reference_rank0.log", "gloo_staging_reference_rank1.log",
        "gloo_staging_staged_rank0.log", "gloo_staging_staged_rank1.log"]


def test_the_device_call_leaves_a_minute_spare_and_the_readme_states_it():
    """The inner time limits of gpu_check.sh's GPU mode (each step's, the kill grace included) sum to at least 60 s
    under the device call's timeout_s, which the script's header and the README's command both give."""
    import re

    script = SCRIPT.read_text()
    limits = dict(re.findall(r"(INSTALL_LIMIT|CHECK_LIMIT|TESTS_LIMIT)=(\d+)", script))
    graces = [int(k) for k in re.findall(r'timeout -k (\d+) "\$(?:CHECK|TESTS)_LIMIT"', script)]
    used = 2 * int(limits["INSTALL_LIMIT"]) + int(limits["CHECK_LIMIT"]) + int(limits["TESTS_LIMIT"]) + sum(graces)
    command = 'run(command="bash bench/gpu_check.sh", carry=["build/gpu_wheels"], timeout_s='
    stated = {int(m) for text in (script, (REPO_ROOT / "README.md").read_text())
              for m in re.findall(re.escape(command) + r"(\d+)\)", text)}
    assert len(graces) == 2 and len(stated) == 1, (graces, stated)
    assert used + 60 <= stated.pop() <= 600
