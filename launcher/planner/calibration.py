"""Replay the published layouts (tests/data/published_layouts_calibration.json) through the planner.

Each row becomes a model shape, the software features of its era (Runtime), and the published layout as a
partial layout; fields the row leaves open (micro-batch, VPP, recompute) are chosen by the planner.
Targets: MFU as published (Korthikanti, Megatron-Core); for Narayanan 2021 rows, whose "% of peak" uses
96*B*s*l*h^2*(1 + s/6h + V/16lh) and so counts the recompute forward, MFU = tflops * F_model / F_narayanan / peak
with F_model = 72*B*s*l*h^2*(1 + s/6h + V/12lh) (Korthikanti's model FLOPs, the same convention as ours).

Print the table: ``.venv/bin/python -m launcher.planner.calibration``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.planner import Runtime, evaluate
from launcher.planner.costs import GIB, Workload
from launcher.planner.estimate import Layout
from launcher.planner.report import layout_line
from launcher.planner.rl_step import estimate
from megatron_rl.spec.model_shape import ModelShape

DEFAULT_ROWS = Path(__file__).resolve().parents[2] / "tests" / "data" / "published_layouts_calibration.json"


@dataclass(frozen=True, kw_only=True)
class CalibrationRow:
    """One published run, ready to evaluate."""

    name: str
    """Row label from the file."""
    era: str
    """narayanan2021 | korthikanti2022 | mcore2024."""
    shape: ModelShape
    """GPT shape from the row's numbers."""
    gpu_type: str
    """Catalogue key."""
    num_gpus: int
    """GPUs in the run."""
    global_batch_size: int
    """Sequences per step."""
    fixed: dict
    """Published layout fields (None fields left for the planner)."""
    runtime: Runtime
    """Software features of the run's era."""
    target_mfu: float
    """Published (or derived) MFU, fraction."""
    raw: dict
    """The row as in the file."""


def _era(row: dict) -> str:
    if "Narayanan" in row["model"]:
        return "narayanan2021"
    if "Korthikanti" in row["model"]:
        return "korthikanti2022"
    return "mcore2024"


def load_rows(path: str | Path = DEFAULT_ROWS) -> list[CalibrationRow]:
    """Rows of the calibration file as CalibrationRow."""
    rows = []
    for row in json.loads(Path(path).read_text()):
        era = _era(row)
        h, n, s = row["hidden_size"], row["num_attention_heads"], row["seq_length"]
        old = era != "mcore2024"
        shape = ModelShape(
            name=row["model"], family="gpt", num_layers=row["num_layers"], hidden_size=h,
            ffn_hidden_size=row["ffn_hidden_size"], num_attention_heads=n, num_query_groups=row["num_query_groups"],
            kv_channels=h // n, vocab_size=row["vocab_size"], seq_length=s, max_position_embeddings=s,
            gated_linear_unit=False, activation="gelu", normalization="LayerNorm",
            position_embedding_type="learned_absolute", add_bias_linear=True, tie_embeddings=old,
            hidden_dropout=0.1 if old else 0.0, attention_dropout=0.1 if old else 0.0)
        fixed = {k: row[k] for k in ("tp", "pp", "cp", "ep", "dp")}
        if row.get("vpp"):
            fixed["vpp"] = row["vpp"]
        if row.get("micro_batch_size"):
            fixed["micro_batch_size"] = row["micro_batch_size"]
        if era == "narayanan2021":
            fixed.update(recompute="full", sequence_parallel=False)
            runtime = Runtime(flash_attention=False, tp_comm_overlap=False, overlap_grad_reduce=False,
                              overlap_param_gather=False, distributed_optimizer=False, grad_reduce_bytes=2)
            f_model = 72 * (1 + s / (6 * h) + row["vocab_size"] / (12 * row["num_layers"] * h))
            f_nara = 96 * (1 + s / (6 * h) + row["vocab_size"] / (16 * row["num_layers"] * h))
            target = row["tflops_per_gpu"] * f_model / f_nara / 312.0
        elif era == "korthikanti2022":
            fixed.update(recompute="selective", sequence_parallel=True)
            runtime = Runtime(flash_attention=False, tp_comm_overlap=False, overlap_grad_reduce=False,
                              overlap_param_gather=False, distributed_optimizer=False,
                              selective_modules=("core_attn",))
            target = row["mfu_pct"] / 100
        else:  # Megatron-Core 2024 weak-scaling runs: TE, flash attention, TP communication overlapped
            runtime = Runtime(tp_comm_overlap=True)
            target = row["mfu_pct"] / 100
        gpu = "h100-80gb" if "H100" in row["gpu"] else "a100-80gb"
        rows.append(CalibrationRow(name=row["model"], era=era, shape=shape, gpu_type=gpu,
                                   num_gpus=row["total_gpus"], global_batch_size=row["global_batch_size"],
                                   fixed=fixed, runtime=runtime, target_mfu=target, raw=row))
    return rows


def evaluate_row(row: CalibrationRow):
    """The planner's evaluation of the published layout (PlanResult)."""
    return evaluate(row.shape, row.fixed, num_gpus=row.num_gpus, gpu_type=row.gpu_type,
                    global_batch_size=row.global_batch_size, runtime=row.runtime)


def korthikanti_memory(row: CalibrationRow) -> dict[str, tuple[float, float]] | None:
    """(predicted, measured) GiB for the Korthikanti rows: params+grads+optimizer (fullest rank and a middle
    rank, which holds no embedding), activations with SP+selective, activations with TP only and no recompute."""
    measured = row.raw.get("measured_mem_GiB_per_gpu")
    if not measured:
        return None
    w = Workload(shape=row.shape, gpu=_gpu(row.gpu_type), num_gpus=row.num_gpus, seq_length=row.shape.seq_length,
                 global_batch_size=row.global_batch_size, runtime=row.runtime)
    base = dict(tp=row.fixed["tp"], pp=row.fixed["pp"], vpp=row.fixed.get("vpp", 1), cp=1, ep=1, dp=row.fixed["dp"],
                micro_batch_size=row.fixed["micro_batch_size"])
    sel = estimate(w, Layout.of(**base, recompute="selective", sequence_parallel=True))
    none = estimate(w, Layout.of(**base, recompute="none", sequence_parallel=False))
    layer = row.shape.attention_params() + row.shape.dense_mlp_params()
    middle = layer * row.shape.num_layers / row.fixed["pp"] / row.fixed["tp"] * 18
    mp = measured["params+grads+optimizer"]
    return {
        "params+grads+optimizer (fullest rank)": ((sel.weights + sel.gradients + sel.optimizer) / GIB, mp),
        "params+grads+optimizer (middle rank)": (middle / GIB, mp),
        "activations SP+selective": (sel.activations / GIB, measured["activations_seqpar+selective"]),
        "activations TP only, no recompute": (none.activations / GIB, measured["activations_no_recompute"]),
    }


def _gpu(name: str):
    from launcher.planner.gpus import get_gpu

    return get_gpu(name)


def table(path: str | Path = DEFAULT_ROWS) -> str:
    """Markdown table of predicted vs published MFU and Korthikanti memory."""
    lines = ["| row | layout evaluated | fits | predicted MFU | published MFU | error |",
             "|---|---|---|---|---|---|"]
    mem_lines = ["| row | quantity | predicted GiB | measured GiB | error |", "|---|---|---|---|---|"]
    for row in load_rows(path):
        res = evaluate_row(row)
        lay = res.layout
        mfu = res.estimate.mfu
        lines.append(f"| {row.name} | {layout_line(lay)} | {res.fits} | {100 * mfu:.1f}% | {100 * row.target_mfu:.1f}% | "
                     f"{100 * (mfu / row.target_mfu - 1):+.1f}% |")
        for label, (pred, meas) in (korthikanti_memory(row) or {}).items():
            mem_lines.append(f"| {row.name} | {label} | {pred:.2f} | {meas:.2f} | {100 * (pred / meas - 1):+.1f}% |")
    return "\n".join(lines) + "\n\n" + "\n".join(mem_lines)


if __name__ == "__main__":
    print(table(*sys.argv[1:2]))
