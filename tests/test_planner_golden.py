"""The shipped configs' planned layouts and predicted step times, locked in a golden file, so that a change to the
cost model that moves any of them shows up here (torch-free).

    .venv/bin/python -m pytest tests/test_planner_golden.py -q
    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_planner_golden.py -q   # rewrites the golden file

Each config is sized as ``launch.py`` sizes it (``launcher.job.prepare``): ``plan_job`` with the file's given keys
when ``parallel.auto`` is on, else ``evaluate_layout`` of its own layout (the prediction the run is checked
against). Rewrite the golden file only for an intended model change, and say in the commit which picks moved.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

from megatron_rl.spec.config.loader import given_keys, load_config
from launcher.job import evaluate_layout, load_shape, plan_job

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "planner_picks.json"
LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "ep", "dp", "micro_batch_size", "recompute", "sequence_parallel",
               "first_stage_layers", "last_stage_layers", "account_for_embedding", "account_for_loss", "pipeline_layout")
REL_TOL = 1e-3
"""Step time and memory may move by 0.1% (float noise is ~1e-15); anything more is a model change."""


def _shipped_configs() -> list[Path]:
    """configs/*.yaml (megatron_rl/spec/shipped/configs is a link to it) that are one job's config (not a pipeline)."""
    assert (ROOT / "megatron_rl" / "spec" / "shipped" / "configs").resolve() == (ROOT / "configs").resolve()
    return sorted(path for path in (ROOT / "configs").glob("*.yaml")
                  if "stages" not in yaml.safe_load(path.read_text()))


def _sized(path: Path) -> dict:
    """What launch.py's sizing gives for one shipped config: its layout, step time and peak memory."""
    cfg = load_config(str(path), [], allow_missing=True)
    shape = load_shape(cfg.model.name)
    if cfg.parallel.auto:
        result = plan_job(cfg, shape, given=given_keys(str(path), []), top_k=0)
    else:
        result = evaluate_layout(cfg, shape)
        if result is None:
            return {"not_modelled": True}
    lay = result.layout.to_dict()
    est = result.estimate
    return {"sized_by": "plan_job" if cfg.parallel.auto else "evaluate_layout",
            "algorithm": cfg.algorithm.name, "gpus": cfg.cluster.world_size, "gpu_type": cfg.cluster.gpu_type,
            "layout": {k: lay[k] for k in LAYOUT_KEYS}, "fits": est.fits,
            "step_time_s": est.step_time_s, "memory_gib": est.total / 1024**3}


@pytest.fixture(scope="module")
def sized() -> dict[str, dict]:
    return {path.stem: _sized(path) for path in _shipped_configs()}


def test_shipped_configs_keep_their_planned_layouts_and_step_times(sized: dict[str, dict]) -> None:
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(sized, indent=1, sort_keys=True) + "\n")
    assert GOLDEN.is_file(), f"{GOLDEN} missing: run with UPDATE_GOLDEN=1 to create it"
    moved = _moved(json.loads(GOLDEN.read_text()), sized)
    assert not moved, ("planner picks moved (if intended, rerun with UPDATE_GOLDEN=1):\n  " + "\n  ".join(moved))


def _moved(golden: dict[str, dict], sized: dict[str, dict]) -> list[str]:
    """What differs between the golden entries and the sized ones, one line each."""
    moved = [f"{name}: {'new' if name in sized else 'gone'} config" for name in sorted(set(sized) ^ set(golden))]
    for name in sorted(set(golden) & set(sized)):
        got = sized[name]
        for key, value in golden[name].items():
            same = (isinstance(got.get(key), float) and math.isclose(got[key], value, rel_tol=REL_TOL)
                    if isinstance(value, float) else got.get(key) == value)
            if not same:
                moved.append(f"{name}.{key}: golden {value}, now {got.get(key)}")
    return moved


def test_the_golden_file_covers_the_big_configs(sized: dict[str, dict]) -> None:
    """The locked picks include the >100B configs whose layouts the planner, not the file, chooses."""
    planned = {name for name, entry in sized.items() if entry.get("sized_by") == "plan_job"}
    assert {"grpo_llama70b", "grpo_llama405b", "grpo_qwen3_235b", "grpo_deepseek_v3"} <= planned
    assert all(entry["fits"] for entry in sized.values() if "fits" in entry)
    assert "pipeline_tiny" not in sized  # a pipeline's stages are configs of their own


def test_a_moved_pick_is_reported_by_name(sized: dict[str, dict]) -> None:
    """The comparison can fail: a step time 1% off, another micro-batch size or a new config are each named."""
    name = "grpo_llama70b"
    assert _moved(sized, sized) == []
    slower = {**sized, name: {**sized[name], "step_time_s": sized[name]["step_time_s"] * 1.01}}
    assert [line.split(":")[0] for line in _moved(sized, slower)] == [f"{name}.step_time_s"]
    layout = {**sized[name]["layout"], "micro_batch_size": sized[name]["layout"]["micro_batch_size"] + 1}
    assert [line.split(":")[0] for line in _moved(sized, {**sized, name: {**sized[name], "layout": layout}})] == [
        f"{name}.layout"]
    assert _moved(sized, {**sized, "grpo_new": {}}) == ["grpo_new: new config"]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
