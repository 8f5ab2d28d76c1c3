"""The planner's prediction for a job beside what the job measured, and the error of each.

    python launch.py plan --calibrate RUN_DIR [--json]

``launch.py`` writes ``RUN_DIR/prediction.json`` when it prepares a job (the plan of the job's own layout, on its
``cluster.gpu_type``); every trainer logs per-phase times and the fullest rank's peak memory per phase
(``peak_memory_<phase>_gib``) into ``metrics.jsonl``. ``compare`` lines them up: step time (median over the
run's steps) and peak memory (the worst phase of the fullest rank) against the plan's step time and per-GPU
total. The trainers print the same comparison when they finish. Torch-free: it runs on the login node.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Optional

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.run_files import METRICS_FILE, PREDICTION_FILE


def prediction_record(plan, *, gpu_type: str) -> dict[str, Any]:
    """What prediction.json holds for a PlanResult of the job's layout."""
    summary = plan.to_dict()
    return {"gpu_type": gpu_type, "layout": summary["layout"], "step_time_s": plan.estimate.step_time_s,
            "memory_gib": summary["memory_gib"], "mfu": plan.estimate.mfu, "workload": summary["workload"]}


def measured(metrics: list[dict]) -> dict[str, Any]:
    """From metrics.jsonl lines: median step time of the training steps, and the largest peak per phase."""
    steps = [m for m in metrics if m.get("phase") is None and "step_time_s" in m]
    peaks: dict[str, float] = {}
    for m in steps:
        for key, value in m.items():
            if key.startswith("peak_memory_") and key.endswith("_gib"):
                phase = key[len("peak_memory_"):-len("_gib")]
                peaks[phase] = max(peaks.get(phase, 0.0), float(value))
    return {"steps": len(steps), "step_time_s": statistics.median(m["step_time_s"] for m in steps) if steps else None,
            "peak_memory_gib": peaks}


def compare(prediction: dict[str, Any], seen: dict[str, Any], *, on: Optional[str]) -> dict[str, Any]:
    """Predicted, measured and relative error ((measured - predicted) / predicted) of step time and peak
    memory; ``on`` names the hardware the run used, when known (the line says when it is not the planned GPU)."""
    peak = max(seen["peak_memory_gib"].values(), default=None)
    rows = {"step_time_s": (prediction["step_time_s"], seen["step_time_s"]),
            "peak_memory_gib": (prediction["memory_gib"]["total"], peak)}
    return {"planned_for": prediction["gpu_type"], "measured_on": on, "steps": seen["steps"],
            **{name: {"predicted": want, "measured": got,
                      "error": None if got is None or not want else (got - want) / want}
               for name, (want, got) in rows.items()},
            "peak_memory_by_phase_gib": seen["peak_memory_gib"]}


def one_line(report: dict[str, Any]) -> str:
    """The comparison as the trainers print it at the end of a run."""
    def part(name: str, unit: str) -> str:
        row = report[name]
        got = "?" if row["measured"] is None else f"{row['measured']:.3g} {unit}"
        error = "" if row["error"] is None else f" ({100 * row['error']:+.0f}%)"
        label = {"step_time_s": "step time", "peak_memory_gib": "peak memory"}[name]
        return f"{label} {row['predicted']:.3g} {unit} predicted, {got} measured{error}"

    on, planned = report["measured_on"], report["planned_for"]
    note = "" if on is None or on == planned else f"; measured on {on}, planned for {planned}: not comparable"
    return (f"planner vs this run ({report['steps']} steps): {part('step_time_s', 's')}; "
            f"{part('peak_memory_gib', 'GiB')} (fullest rank, worst phase){note}")


def read_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict]]:
    """(prediction.json, metrics.jsonl lines) of a run folder; one-line ConfigErrors naming what is missing."""
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise ConfigError(f"--calibrate {run}: no such run folder; give the run.dir of a finished or running job")
    try:
        prediction = json.loads((run / PREDICTION_FILE).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--calibrate {run}: no {PREDICTION_FILE} (the launcher writes it for jobs whose "
                          "layout the planner can evaluate); rerun the job with this version") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--calibrate {run}: {PREDICTION_FILE} is not JSON ({exc})") from None
    try:
        lines = (run / METRICS_FILE).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"--calibrate {run}: no {METRICS_FILE} yet; wait for the job's first step") from None
    metrics = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            metrics.append(json.loads(line))
        except ValueError:
            if number < len(lines):  # the last line may be half written by a running job
                raise ConfigError(f"--calibrate {run}: {METRICS_FILE} line {number} is not JSON") from None
    return prediction, metrics


def calibration_report(run_dir: str | Path, *, on: Optional[str] = None) -> dict[str, Any]:
    """``compare`` for a run folder; ``on``: the hardware it ran on, when known."""
    prediction, metrics = read_run(run_dir)
    return compare(prediction, measured(metrics), on=on)
