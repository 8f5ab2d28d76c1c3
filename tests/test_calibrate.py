"""The planner's prediction beside a run's measurements (megatron_rl/spec/calibrate.py), without a run: numbers by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.spec.calibrate import calibration_report, compare, measured, one_line
from megatron_rl.spec.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
PREDICTION = {"gpu_type": "h100-80gb", "step_time_s": 2.0, "memory_gib": {"total": 40.0}, "layout": {}}
METRICS = [{"step": 1, "phase": "sft", "loss": 1.0},  # the warm-up is not a training step
           {"step": 1, "step_time_s": 2.0, "peak_memory_generate_gib": 30.0, "peak_memory_train_gib": 44.0},
           {"step": 2, "step_time_s": 3.0, "peak_memory_generate_gib": 31.0, "peak_memory_train_gib": 42.0},
           {"step": 3, "step_time_s": 2.5, "peak_memory_train_gib": 43.0},
           {"step": 3, "phase": "eval", "pass_at_1": 0.5}]


def test_median_step_and_worst_phase_against_the_prediction_by_hand() -> None:
    report = compare(PREDICTION, measured(METRICS), on=None)
    assert report["steps"] == 3
    assert report["step_time_s"] == {"predicted": 2.0, "measured": 2.5, "error": pytest.approx(0.25)}
    assert report["peak_memory_gib"] == {"predicted": 40.0, "measured": 44.0, "error": pytest.approx(0.1)}
    assert report["peak_memory_by_phase_gib"] == {"generate": 31.0, "train": 44.0}
    assert one_line(report) == ("planner vs this run (3 steps): step time 2 s predicted, 2.5 s measured (+25%); "
                                "peak memory 40 GiB predicted, 44 GiB measured (+10%) (fullest rank, worst phase)")
    assert one_line(compare(PREDICTION, measured(METRICS), on="cpu")).endswith(
        "; measured on cpu, planned for h100-80gb: not comparable")


def test_a_run_folder_is_read_and_a_half_written_last_line_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "prediction.json").write_text(json.dumps(PREDICTION))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS) + '{"step": 4, "ste')
    assert calibration_report(tmp_path)["steps"] == 3


@pytest.mark.parametrize(("files", "message"), [
    ({}, "no prediction.json"),
    ({"prediction.json": "{nope"}, "prediction.json is not JSON"),
    ({"prediction.json": json.dumps(PREDICTION)}, "no metrics.jsonl yet"),
    ({"prediction.json": json.dumps(PREDICTION), "metrics.jsonl": "{bad\n{}\n"}, "metrics.jsonl line 1 is not JSON"),
])
def test_missing_or_broken_files_are_one_line_errors(tmp_path: Path, files: dict, message: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        calibration_report(tmp_path)
    assert "\n" not in str(info.value)


def test_plan_calibrate_on_a_missing_folder_exits_2_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(REPO_ROOT / "launch.py"), "plan", "--calibrate",
                             str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "no such run folder" in result.stderr
