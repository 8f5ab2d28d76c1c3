"""Per-step metrics: one JSON line per step in ``run.dir/metrics.jsonl``, a console progress line, TensorBoard.

Only global rank 0 writes. Metrics are plain floats that every rank already agrees on (see
``megatron_rl.runtime.training.reduce_reports``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

CONSOLE_KEYS = ("loss", "reward_mean", "accuracy", "kl", "response_length", "grad_norm", "lr", "step_time_s")


class MetricsLogger:
    """Appends each step's metrics to metrics.jsonl and shows a short progress line on the console."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, console: str = "progress",
                 tensorboard: bool = True, enabled: bool = True, stream: TextIO = sys.stdout) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.console = console
        self.stream = stream
        self._writer = None
        self._file = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._writer = SummaryWriter(str(run_dir / "tensorboard"))
            except Exception:  # tensorboard is optional
                self._writer = None
        self._started = time.monotonic()

    def truncate_after(self, step: int, *, keep_warmup: bool = True) -> None:
        """Drop lines of steps > step (a resumed run rewrites what it does again); warm-up ("sft") lines stay."""
        if not self.enabled or not self.path.exists():
            return
        self._file.close()
        records = [(line, json.loads(line)) for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line, record in records if (keep_warmup and record.get("phase") == "sft")
                or (record.get("phase") != "sft" and record.get("step", 0) <= step)]
        self.path.write_text("".join(line + "\n" for line in kept))
        self._file = self.path.open("a", buffering=1)

    def log(self, step: int, metrics: dict[str, float], *, phase: Optional[str] = None,
            total: Optional[int] = None) -> None:
        if not self.enabled:
            return
        record = {"step": step, **({"phase": phase} if phase else {}), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(f"{phase or 'train'}/{key}", value, step)
        if self.console == "json":
            print(json.dumps(record), file=self.stream, flush=True)
        elif self.console == "progress":
            shown = "  ".join(f"{k} {_fmt(metrics[k])}" for k in CONSOLE_KEYS if k in metrics)
            label = f"{phase} " if phase else ""
            print(f"{label}step {step:>4}/{total or self.total_steps}  {shown}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.4f}"
    return f"{value:.3e}"
