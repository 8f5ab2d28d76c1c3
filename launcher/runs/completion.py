"""Whether a run folder's job is complete: the rule ``launch.py`` (a rerun says so and starts nothing) and
``launch.py pipeline`` (complete stages are skipped) share."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from launcher.runs.folder import MAIN_PHASES, RunFolder
from megatron_rl.spec.config import JobConfig
from megatron_rl.spec.run_files import EVAL_FILE


def completion(cfg: JobConfig, run_dir: Path) -> Optional[str]:
    """Why the job of ``cfg`` in ``run_dir`` is complete, or None when it has to run (again): an evaluation whose
    kept entry for its checkpoint is in eval.json; a training run whose metrics reached run.steps and, with
    checkpoint.save_at_end, whose latest checkpoint did too (a run that ended before its final save runs again,
    resuming)."""
    if cfg.algorithm.name == "eval":
        key = eval_key(cfg)
        entry = read_eval(run_dir / EVAL_FILE).get(key)
        if (isinstance(entry, dict) and entry.get("kept") is True
                and entry.get("checkpoint") == str(cfg.model.init_from)):
            return f"eval.json holds its entry {key!r} (pass@1 {entry.get('pass@1')})"
        return None
    steps = [row.get("step") for row in RunFolder(path=run_dir).recent_metrics()
             if row.get("phase") in MAIN_PHASES and isinstance(row.get("step"), int)]
    if not steps or max(steps) < cfg.run.steps:
        return None
    if not cfg.checkpoint.save_at_end:
        return f"metrics.jsonl reached run.steps={cfg.run.steps}"
    final = latest_step(Path(cfg.checkpoint_dir).expanduser().absolute())
    if final is None or final < cfg.run.steps:
        return None
    return f"metrics.jsonl and its latest checkpoint reached run.steps={cfg.run.steps}"


def eval_key(cfg: JobConfig) -> str:
    """The eval.json entry an evaluation writes."""
    return cfg.eval.stage or cfg.run.name


def read_eval(path: Path) -> dict[str, Any]:
    """eval.json's entries ({} when it is missing or unreadable)."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def latest_step(checkpoints: Path) -> Optional[int]:
    """The step of the checkpoint that ``latest`` names (megatron_rl/runtime/checkpoint.py's layout), or None."""
    try:
        name = (checkpoints / "latest").read_text().strip()
    except OSError:
        return None
    match = re.fullmatch(r"step_(\d{8})", name)
    return int(match.group(1)) if match and (checkpoints / name).is_dir() else None
