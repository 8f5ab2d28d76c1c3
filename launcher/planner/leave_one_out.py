"""The leave-one-out replay behind the planner's error bands (error_bands.py says what it does and why).

    .venv/bin/python -m launcher.planner.leave_one_out            # the table
    .venv/bin/python -m launcher.planner.leave_one_out --write    # and error_bands.json (about 1 s)

Test: ``.venv/bin/python -m pytest tests/test_planner_error_bands.py -q``
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from typing import Iterator

from launcher.planner.error_bands import BANDS_FILE, KINDS, Band, band_of

GEMM_GRID = [round(0.50 + 0.01 * i, 2) for i in range(46)]
"""gemm_efficiency values a leave-one-out refit tries (0.50-0.95)."""
PRIORS = {"FP8_GEMM_RELATIVE": 0.75, "FLASH_ATTN_EFFICIENCY": 0.75, "A2A_NIC_EFFICIENCY": 0.80}
"""The values calibration_h100.py's single-row constants had before they were fitted (calibration.md)."""
RL_ROWS = [  # preset, GPUs, published average sequence (prompt + response), step s
    ("llama-3.1-8b", 16, 1060, 97.7),
    ("qwen3-32b", 32, 3206, 393.0),
]
"""NeMo RL v0.4 GRPO (DGX-H100, vLLM generation): 128 prompts x 16 completions, optimizer steps of 512, sequences
of at most 4,096 tokens; prompts taken at 256 tokens, so the mean response is the average sequence less 256."""
RL_PROMPT = 256


@contextlib.contextmanager
def _constant(module, attr: str, value: float) -> Iterator[None]:
    saved = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, saved)


@contextlib.contextmanager
def _gemm_efficiency(gpu: str, value: float) -> Iterator[None]:
    from launcher.planner import gpus

    saved = gpus.GPUS[gpu]
    gpus.GPUS[gpu] = dataclasses.replace(saved, gemm_efficiency=value)
    try:
        yield
    finally:
        gpus.GPUS[gpu] = saved


def _dense_mfu_rows() -> list[dict]:
    """calibration.py's rows, each predicted with its GPU's gemm_efficiency refitted on the GPU's other rows."""
    from launcher.planner.calibration import evaluate_row, load_rows

    rows = load_rows()
    out = []
    for row in rows:
        others = [r for r in rows if r.gpu_type == row.gpu_type and r is not row]
        best = None
        for value in GEMM_GRID if others else []:
            with _gemm_efficiency(row.gpu_type, value):
                rms = math.sqrt(sum(math.log(evaluate_row(r).estimate.mfu / r.target_mfu) ** 2 for r in others)
                                / len(others))
            if best is None or rms < best[0]:
                best = (rms, value)
        efficiency = best[1] if best else None
        with (_gemm_efficiency(row.gpu_type, efficiency) if efficiency else contextlib.nullcontext()):
            predicted = evaluate_row(row).estimate.mfu
        out.append({"kind": "dense pretrain", "row": row.name, "quantity": "MFU", "predicted": predicted,
                    "published": row.target_mfu, "refit": {f"{row.gpu_type} gemm_efficiency": efficiency},
                    "log_error": math.log(predicted / row.target_mfu)})
    return out


def _h100_rows() -> list[dict]:
    """calibration_h100.py's rows, a fit row predicted with its constant back at its prior."""
    from launcher.planner.calibration_h100 import FITTED, compare, load_h100_rows

    out = []
    for row in load_h100_rows():
        refit = {}
        context = contextlib.nullcontext()
        if row.role == "fit":
            module, attr = FITTED[row.fits_constant]
            refit = {row.fits_constant: PRIORS[row.fits_constant]}
            context = _constant(module, attr, PRIORS[row.fits_constant])
        with context:
            result = compare(row)
        out.append({"kind": "MoE pretrain" if row.shape.is_moe else "dense pretrain", "row": row.name,
                    "quantity": "tokens/s/GPU", "predicted": result["predicted_tps"],
                    "published": result["published_tps"], "refit": refit,
                    "log_error": math.log(result["predicted_tps"] / result["published_tps"])})
    return out


def _rl_rows() -> list[dict]:
    """NeMo RL's GRPO steps, planned as this project runs them (nothing fitted on them)."""
    from launcher.planner import plan
    from launcher.planner.costs import GrpoSizing
    from megatron_rl.spec.model_shape import load_model_shape

    out = []
    for preset, gpus, average, step in RL_ROWS:
        sizing = GrpoSizing(rollout_batch_size=2048, max_prompt_length=RL_PROMPT, max_response_length=4096 - RL_PROMPT,
                            mean_response_length=average - RL_PROMPT, samples_per_prompt=16,
                            kv_cache_released_for_training=True, optimizer_offloaded_for_generation=True)
        ours = plan(load_model_shape(preset), num_gpus=gpus, gpu_type="h100-80gb", seq_length=4096,
                    global_batch_size=512, mode="grpo", grpo=sizing, top_k=0).estimate
        out.append({"kind": "RL step", "row": f"{preset} GRPO, {gpus} H100 (NeMo RL v0.4)", "quantity": "step s",
                    "predicted": ours.step_time_s, "published": step, "refit": {},
                    "log_error": math.log(ours.step_time_s / step)})
    return out


def replay() -> dict:
    """Every row's leave-one-out prediction, and the bands (what ``--write`` stores)."""
    rows = _dense_mfu_rows() + _h100_rows() + _rl_rows()
    bands = {}
    for kind in KINDS:
        errors = [r["log_error"] for r in rows if r["kind"] == kind]
        bands[kind] = Band(kind=kind, band=band_of(errors), rows=len(errors)).to_dict()
    return {"method": "leave-one-out (launcher/planner/leave_one_out.py)", "bands": bands, "rows": rows}


def table(result: dict) -> str:
    """Markdown: each row's leave-one-out prediction and error, then the bands."""
    lines = ["| kind | row | quantity | predicted | published | error | refitted without the row |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        refit = ", ".join(f"{k} {v}" for k, v in r["refit"].items()) or "-"
        lines.append(f"| {r['kind']} | {r['row']} | {r['quantity']} | {r['predicted']:.4g} | {r['published']:.4g} | "
                     f"{100 * (math.exp(r['log_error']) - 1):+.1f}% | {refit} |")
    lines += ["", "| kind | band | rows |", "|---|---|---|"]
    lines += [f"| {b['kind']} | ±{100 * b['band']:.0f}% | {b['rows']} |" for b in result["bands"].values()]
    return "\n".join(lines)


if __name__ == "__main__":
    outcome = replay()
    if "--write" in sys.argv[1:]:
        BANDS_FILE.write_text(json.dumps(outcome, indent=1) + "\n")
    print(table(outcome))
