"""Planner against published training runs: tests/data/published_layouts_calibration.json (copied from
../shared/data) plus a few published layouts that were NOT used for fitting.

Run: .venv/bin/python -m pytest tests/test_planner_calibration.py -q
Table: .venv/bin/python -m launcher.planner.calibration
"""

import pytest

from megatron_rl.spec.model_shape import load_model_shape
from launcher.planner import Runtime, evaluate, plan
from launcher.planner.calibration import evaluate_row, korthikanti_memory, load_rows

ROWS = load_rows()
IDS = [r.name for r in ROWS]


def test_file_has_the_ten_rows():
    assert len(ROWS) == 10 and sum(r.era == "korthikanti2022" for r in ROWS) == 4


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_published_layout_fits_and_mfu_within_15_percent(row):
    res = evaluate_row(row)
    lay = res.layout
    for key in ("tp", "pp", "cp", "ep", "dp"):
        assert lay.value(key) == row.fixed[key]
    assert res.fits, res.memory
    assert res.estimate.mfu == pytest.approx(row.target_mfu, rel=0.15)


def test_narayanan_mfu_derivation():
    # 1T row: 163 TFLOP/s counted with 96*B*s*l*h^2*(1+s/6h+V/16lh) -> model FLOPs 72*(...+V/12lh)
    row = next(r for r in ROWS if r.name == "GPT-1T (Narayanan Tab.1)")
    h, l, s, v = 25600, 128, 2048, 51200
    ratio = 72 * (1 + s / (6 * h) + v / (12 * l * h)) / (96 * (1 + s / (6 * h) + v / (16 * l * h)))
    assert row.target_mfu == pytest.approx(163 * ratio / 312, rel=1e-12)
    assert 0.38 < row.target_mfu < 0.40


@pytest.mark.parametrize("row", [r for r in ROWS if r.era == "korthikanti2022"], ids=lambda r: r.name)
def test_korthikanti_memory_within_10_percent(row):
    for label, (predicted, measured) in korthikanti_memory(row).items():
        assert predicted == pytest.approx(measured, rel=0.10), label


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_planner_pick_is_no_slower_than_published(row):
    published = evaluate_row(row).estimate
    own = plan(row.shape, num_gpus=row.num_gpus, gpu_type=row.gpu_type, global_batch_size=row.global_batch_size,
               runtime=row.runtime)
    assert own.fits and own.estimate.step_time_s <= published.step_time_s * (1 + 1e-9)


# ---- published layouts not in the calibration file (not used for fitting) ----
OVERLAPPED_TP = Runtime(tp_comm_overlap=True)
"""The held-out runs below are of the TE era with TP communication overlapped (NeMo's Nemotron-4 and Llama 3.1
405B recipes set tp_comm_overlap at TP8; the planner's own default is off because no trainer here turns it on)."""


def test_llama3_405b_on_16k_h100():
    """Llama 3 paper Table 4: TP8 CP1 PP16 DP128, seq 8192, 16 sequences per DP rank: 41% BF16 MFU (43% at 8K
    GPUs). With Megatron's fp32 gradient buffers CP1 needs full recompute here; CP2 runs without."""
    shape = load_model_shape("llama-3.1-405b")
    cp1 = evaluate(shape, "tp=8,pp=16,cp=1", num_gpus=16384, gpu_type="h100-80gb", global_batch_size=2048,
                   seq_length=8192, runtime=OVERLAPPED_TP)
    # held-out tolerance (issue 15): 20%; we predict -16% here because full recompute is forced (calibration.md)
    assert cp1.fits and cp1.estimate.mfu == pytest.approx(0.41, rel=0.20)
    cp2 = evaluate(shape, "tp=8,pp=16,cp=2", num_gpus=16384, gpu_type="h100-80gb", global_batch_size=2048,
                   seq_length=8192, runtime=OVERLAPPED_TP)
    assert cp2.fits and 0.38 * 0.85 < cp2.estimate.mfu < 0.43 * 1.15
    eight_k = evaluate(shape, "tp=8,pp=16,cp=1", num_gpus=8192, gpu_type="h100-80gb", global_batch_size=2048,
                       seq_length=8192, runtime=OVERLAPPED_TP)
    assert eight_k.estimate.mfu > cp1.estimate.mfu  # more micro-batches per pipeline, smaller bubble


@pytest.mark.parametrize("gpus, gbs, mfu", [(1536, 768, 0.424), (6144, 2304, 0.410)])
def test_nemotron4_340b_tp8_pp12(gpus, gbs, mfu):
    """Nemotron-4 340B report: TP8 PP12 on H100, seq 4096, MFU 42.4% (1536 GPUs) and 41.0% (6144 GPUs)."""
    res = evaluate(load_model_shape("nemotron-4-340b"), "tp=8,pp=12,cp=1", num_gpus=gpus, gpu_type="h100-80gb",
                   global_batch_size=gbs, runtime=OVERLAPPED_TP)
    assert res.fits and res.estimate.mfu == pytest.approx(mfu, rel=0.15)


def test_deepseek_v3_pp16_ep64_fits():
    """DeepSeek-V3 report: PP16, EP64 (over 8 nodes), TP1, 2048 GPUs, 61 layers: needs an uneven pipeline split."""
    res = evaluate(load_model_shape("deepseek-v3"), "tp=1,pp=16,ep=64,cp=1", num_gpus=2048, gpu_type="h100-80gb",
                   global_batch_size=15360, seq_length=4096, precision="fp8")
    assert res.fits and res.layout.dims.first_stage_layers is not None
    assert 0.1 < res.estimate.mfu < 0.5
