"""Planner against published DGX-H100 MoE / CP / FP8 runs (tests/data/published_h100_moe_cp.json).

Fit rows fixed one constant each (calibration.md, "MoE, CP and FP8 on H100"); held-out rows were never fitted on.
Table: .venv/bin/python -m launcher.planner.calibration_h100
"""

import dataclasses
import statistics

import pytest

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import load_model_shape
from launcher.planner import Runtime, plan
from launcher.planner.calibration_h100 import compare, load_h100_rows
from launcher.planner.moe_comm import a2a_shares, deepep_inter_share

ROWS = load_h100_rows()
HELD_OUT = [r for r in ROWS if r.role == "held_out"]
LLAMA_405B_CP2 = "Llama3.1-405B FP8 CP2 (Megatron-Bridge 25.11, DGX-H100)"


def test_fit_and_held_out_sets_are_disjoint_and_named():
    roles = {r.role for r in ROWS}
    assert roles <= {"fit", "held_out", "reported"}
    fit = [r for r in ROWS if r.role == "fit"]
    assert sorted(r.fits_constant for r in fit) == ["A2A_NIC_EFFICIENCY", "FLASH_ATTN_EFFICIENCY", "FP8_GEMM_RELATIVE"]
    assert not any(r.fits_constant for r in HELD_OUT)
    assert all(r.raw["source"] for r in ROWS)


@pytest.mark.parametrize("row", [r for r in ROWS if r.role == "fit"], ids=lambda r: r.name)
def test_fit_rows_reproduce_within_10_percent(row):
    c = compare(row)
    assert c["fits"] and abs(c["error"]) < 0.10


@pytest.mark.parametrize("row", HELD_OUT, ids=lambda r: r.name)
def test_held_out_rows_fit_and_within_20_percent(row):
    c = compare(row)
    assert c["fits"]
    assert abs(c["error"]) < 0.20


def test_llama_405b_cp2_runs_its_recipe_without_recompute_only_with_fp8_weights():
    """The recipe (fp8 current scaling, fp8_param_gather) holds fp8 weights without a bf16 copy: then the
    published layout fits without recompute, as the recipe runs it; with bf16 weights + an fp8 copy it would not."""
    row = next(r for r in HELD_OUT if r.name == LLAMA_405B_CP2)
    assert row.runtime.fp8_param_gather
    c = compare(row)
    assert c["layout"].recompute == "none" and abs(c["error"]) < 0.10
    raw = dict(row.raw, runtime={**row.raw["runtime"], "fp8_param_gather": False})
    bf16_copy = compare(dataclasses.replace(row, raw=raw))
    assert bf16_copy["layout"].recompute != "none" and bf16_copy["error"] < -0.15


def test_held_out_median_within_10_percent():
    assert statistics.median(abs(compare(r)["error"]) for r in HELD_OUT) < 0.10


def test_ep_traffic_follows_the_topology():
    assert a2a_shares(8, 8) == (7 / 8, 0.0)
    assert a2a_shares(64, 8) == (7 / 64, 56 / 64)
    # DeepSeek-V3's group-limited routing (4 of 8 node groups): node dedup sends ~3.2 of 8 copies off-node
    assert 0.35 < deepep_inter_share(ep=64, gpus_per_node=8, topk=8, group_topk=4) < 0.45


def test_ep_wider_than_a_node_is_no_cliff_with_rail_nics():
    """EP16 crosses to a second node over each GPU's own NIC: slower than EP8, but not by the NIC/NVLink ratio."""
    from launcher.planner.costs import Workload
    from launcher.planner.gpus import get_gpu

    w = Workload(shape=load_model_shape("qwen3-235b-a22b"), gpu=get_gpu("h100-80gb"), num_gpus=256,
                 seq_length=4096, global_batch_size=2048, runtime=Runtime(moe_dropless_imbalance=1.0))
    ep8, ep16 = (w.layer_cost("moe", 2, 1, True, 1, "none", ep).parts_s["ep_all_to_all"] for ep in (8, 16))
    assert 1.5 < ep16 / ep8 < 450 / (50 * 0.78)


def test_deepep_is_refused_by_plan():
    with pytest.raises(ConfigError, match="DeepEP"):
        plan(load_model_shape("qwen3-235b-a22b"), num_gpus=256, gpu_type="h100-80gb", global_batch_size=2048,
             runtime=Runtime(moe_deepep=True))
    assert Runtime().moe_deepep is False and Runtime().moe_a2a_overlap is False
