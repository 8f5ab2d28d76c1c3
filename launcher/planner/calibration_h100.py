"""MoE, CP and FP8 calibration on published DGX-H100 runs (tests/data/published_h100_moe_cp.json).

Each row is marked ``fit`` (one physical constant was fitted on it: ``fits_constant``), ``held_out`` (never used
to fit; judged) or ``reported`` (printed, not asserted; calibration.md says why). Rows are compared on
tokens/s/GPU, which does not depend on a FLOP-counting convention; where a source publishes only TFLOP/s/GPU
(NeMo's long-sequence table) it is converted with our own model FLOPs per token. MFU is ours: our model FLOPs x
the row's tokens/s over the bf16 peak.

Print the table: ``.venv/bin/python -m launcher.planner.calibration_h100``; refit: ``... calibration_h100 --fit``.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.planner import PlanResult, Runtime, costs, evaluate, moe_comm
from launcher.planner.report import layout_line
from megatron_rl.spec.model_shape import ModelShape, load_model_shape, shape_from_megatron_dict

ROWS_FILE = Path(__file__).resolve().parents[2] / "tests" / "data" / "published_h100_moe_cp.json"

_INLINE_SHAPES = {
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                          num_query_groups=4, kv_channels=128, vocab_size=151936, seq_length=4096,
                          gated_linear_unit=True, normalization="RMSNorm", position_embedding_type="rope",
                          qk_layernorm=True, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                          tie_embeddings=False),
    # meta-llama/Llama-2-7b config.json; positions extended as NeMo's long-sequence runs do
    "llama-2-7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                       num_query_groups=32, kv_channels=128, vocab_size=32000, seq_length=4096,
                       max_position_embeddings=1048576, gated_linear_unit=True, normalization="RMSNorm",
                       position_embedding_type="rope", tie_embeddings=False),
}

FITTED = {"FP8_GEMM_RELATIVE": (costs, "FP8_GEMM_RELATIVE"), "FLASH_ATTN_EFFICIENCY": (costs, "FLASH_ATTN_EFFICIENCY"),
          "A2A_NIC_EFFICIENCY": (moe_comm, "A2A_NIC_EFFICIENCY")}
"""Constant name -> (module, attribute) of the constants fitted here, in fitting order."""


@dataclass(frozen=True, kw_only=True)
class H100Row:
    """One published H100 run."""

    name: str
    """Row label."""
    role: str
    """fit | held_out | reported."""
    fits_constant: str | None
    """For fit rows: the constant fitted on this row."""
    shape: ModelShape
    """Model shape."""
    raw: dict
    """The row as in the file."""

    @property
    def runtime(self) -> Runtime:
        """The run's software features, as its recipe states them."""
        return Runtime(**self.raw.get("runtime", {}))


def _shape(name: str) -> ModelShape:
    if name in _INLINE_SHAPES:
        return shape_from_megatron_dict(dict(_INLINE_SHAPES[name], name=name), name=name, source="calibration_h100")
    return load_model_shape(name)


def load_h100_rows(path: str | Path = ROWS_FILE) -> list[H100Row]:
    """Rows of the H100 calibration file."""
    return [H100Row(name=r["name"], role=r["set"], fits_constant=r.get("fits_constant"), shape=_shape(r["model"]),
                    raw=r) for r in json.loads(Path(path).read_text())]


def evaluate_h100(row: H100Row) -> PlanResult:
    """The planner's evaluation of the published layout (fields it leaves open are searched)."""
    r = row.raw
    return evaluate(row.shape, r["layout"], num_gpus=r["gpus"], gpu_type=r["gpu"], seq_length=r["seq_length"],
                    global_batch_size=r["global_batch_size"], precision=r["precision"], runtime=row.runtime)


def flops_per_token(res: PlanResult, row: H100Row) -> float:
    """Our model FLOPs per trained token for the row (MFU convention of calibration.md)."""
    return res.estimate.mfu * res.estimate.step_time_s * row.raw["gpus"] * _peak(row) / _tokens(row)


def _tokens(row: H100Row) -> float:
    return row.raw["global_batch_size"] * row.raw["seq_length"]


def _peak(row: H100Row) -> float:
    from launcher.planner.gpus import get_gpu

    return get_gpu(row.raw["gpu"]).bf16_tflops * 1e12


def compare(row: H100Row) -> dict:
    """Predicted vs published tokens/s/GPU and MFU (ours) for one row."""
    res = evaluate_h100(row)
    predicted = _tokens(row) / res.estimate.step_time_s / row.raw["gpus"]
    fpt = flops_per_token(res, row)
    published = row.raw["tokens_per_s_per_gpu"] or row.raw["tflops_per_gpu"] * 1e12 / fpt
    return {"fits": res.fits, "layout": res.layout, "predicted_tps": predicted, "published_tps": published,
            "predicted_mfu": res.estimate.mfu, "published_mfu": published * fpt / _peak(row),
            "error": predicted / published - 1}


def fit(path: str | Path = ROWS_FILE, grid: int = 200) -> dict[str, float]:
    """Refit each constant on its fit row (grid search over 0.30-1.00, in FITTED order); restores nothing."""
    rows = {r.fits_constant: r for r in load_h100_rows(path) if r.role == "fit"}
    out = {}
    for name, (module, attr) in FITTED.items():
        row = rows[name]
        best = min((abs(_set(module, attr, 0.3 + 0.7 * i / grid) and compare(row)["error"]), 0.3 + 0.7 * i / grid)
                   for i in range(grid + 1))
        out[name] = round(_set(module, attr, best[1]), 3)
    return out


def _set(module, attr: str, value: float) -> float:
    setattr(module, attr, value)
    return value


def table(path: str | Path = ROWS_FILE) -> str:
    """Markdown table: role, layout evaluated, fits, tokens/s/GPU and MFU predicted vs published, error."""
    lines = ["| row | set | layout evaluated | fits | predicted tok/s/GPU | published | error | predicted MFU | "
             "published MFU |", "|---|---|---|---|---|---|---|---|---|"]
    held = []
    for row in load_h100_rows(path):
        c = compare(row)
        lay = c["layout"]
        if row.role == "held_out":
            held.append(abs(c["error"]))
        lines.append(f"| {row.name} | {row.role}{' (' + row.fits_constant + ')' if row.fits_constant else ''} | "
                     f"{layout_line(lay)} | {c['fits']} | {c['predicted_tps']:.0f} | {c['published_tps']:.0f} | "
                     f"{100 * c['error']:+.1f}% | {100 * c['predicted_mfu']:.1f}% | {100 * c['published_mfu']:.1f}% |")
    lines.append(f"\nHeld-out median |error| {100 * statistics.median(held):.1f}%, max {100 * max(held):.1f}%.")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--fit" in sys.argv:
        print(fit())
    print(table())
