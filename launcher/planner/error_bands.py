"""How sure a prediction is: the planner's errors on published runs, per kind, from a leave-one-out replay.

Three kinds, each with its published rows (none of them is this project's own measurement):

* dense pretraining: the 10 Megatron layouts of calibration.py (A100 and H100, MFU) and the dense DGX-H100 rows of
  calibration_h100.py (tokens/s/GPU);
* MoE pretraining: the MoE DGX-H100 rows of calibration_h100.py (the +110% Qwen3-30B-A3B row included: leaving
  out the worst row would be choosing the band);
* RL step: NeMo RL v0.4's published GRPO steps (``leave_one_out.RL_ROWS``: DGX-H100, 2,048 completions of at most 4,096 tokens),
  planned as this project would run them (the planner's own layout and KV pool) against their step time.

Leave-one-out: each row is predicted by the planner with every constant that was fitted on it refitted without it.
``gemm_efficiency`` of the row's GPU (fitted on all 10 calibration.py rows) is refitted on that GPU's other rows
(``leave_one_out.GEMM_GRID``; ``GEMM_HALF_WIDTH`` stays, a 2-D refit per row is not worth its time); a constant fitted on this
row alone (calibration_h100.py ``fits_constant``) goes back to the value it had before that fit (``leave_one_out.PRIORS``).
Rows never fitted on are predicted as they are. A kind's band is ``exp(rms(ln(predicted / published))) - 1``: a
prediction of that kind was typically that far off, either way.

The replay is leave_one_out.py; it writes the residuals to ``error_bands.json`` beside this module (``python -m
launcher.planner.leave_one_out --write``; without ``--write`` it prints the table). ``plan`` reads the bands from
there (no replay at plan time) and prints ``step 93 s (±30%, 12 published dense runs)``; ``--json`` carries
``expected_error``.

Test: ``.venv/bin/python -m pytest tests/test_planner_error_bands.py -q``
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

BANDS_FILE = Path(__file__).with_name("error_bands.json")
KINDS = ("dense pretrain", "MoE pretrain", "RL step")


@dataclass(frozen=True)
class Band:
    """A kind's expected error: ``band`` (a fraction, either way) from ``rows`` published runs."""

    kind: str
    band: float
    rows: int

    def text(self) -> str:
        return f"±{100 * self.band:.0f}%, {self.rows} published {self.kind} runs"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "band": round(self.band, 4), "rows": self.rows}


def kind_of(mode: str, is_moe: bool) -> str:
    """The kind a prediction belongs to."""
    from launcher.planner.rl_step import RL_MODES

    if mode in RL_MODES:
        return "RL step"
    return "MoE pretrain" if is_moe else "dense pretrain"


def band(kind: str, path: Path = BANDS_FILE) -> Band | None:
    """The stored band of ``kind`` (None when the file has no row of that kind)."""
    stored = _stored(path)
    errors = [row["log_error"] for row in stored["rows"] if row["kind"] == kind]
    if not errors:
        return None
    return Band(kind=kind, band=band_of(errors), rows=len(errors))


def band_of(log_errors: list[float]) -> float:
    """exp(rms(log errors)) - 1."""
    return math.exp(math.sqrt(sum(e * e for e in log_errors) / len(log_errors))) - 1


_CACHE: dict = {}


def _stored(path: Path) -> dict:
    key = str(path)
    if key not in _CACHE:
        _CACHE[key] = json.loads(Path(path).read_text())
    return _CACHE[key]
