"""Per-step metrics: one JSON line per step in ``run.dir/metrics.jsonl``, a console progress line, TensorBoard
scalars (``logging.tensorboard``) and Weights & Biases (``logging.wandb``).

Only global rank 0 writes. Metrics are plain floats that every rank already agrees on (see
``megatron_rl.runtime.training.reduce_reports``).

RL trainers also write a few completions of every ``logging.sample_every``-th step to ``run.dir/samples.jsonl``
(``log_samples``; a W&B table ``samples`` beside them).

A resumed run rewrites the steps after its checkpoint, and each log shows every step once: metrics.jsonl and
samples.jsonl drop the later lines (``truncate_after``); TensorBoard keeps one folder per phase (``tensorboard/train``,
``tensorboard/sft``, ...) whose writer purges the later steps (``purge_step``); W&B continues the run named in
``run.dir/wandb_run_id`` (``resume="allow"``), its step being the metrics.jsonl line number, and skips the lines
it already has (a step redone after a crash logs the same values again).

Test: `.venv/bin/python -m pytest tests/test_logging.py -q`
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional, TextIO

import yaml

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.private import open_private_append, write_private_text
from megatron_rl.spec.run_files import CONFIG_FILE, METRICS_FILE, SAMPLES_FILE

CONSOLE_KEYS = ("loss", "reward_mean", "accuracy", "pass_at_1", "kl", "response_length", "grad_norm", "lr",
                "step_time_s")
WANDB_RUN_ID_FILE = "wandb_run_id"


class MetricsLogger:
    """Appends each step's metrics to metrics.jsonl, TensorBoard and W&B, and shows a short progress line."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, console: str = "progress",
                 tensorboard: bool = True, wandb: Optional[Any] = None, enabled: bool = True,
                 stream: TextIO = sys.stdout) -> None:
        """wandb: a ``megatron_rl.spec.config.schema.WandbConfig`` (None: no W&B)."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.console = console
        self.stream = stream
        self._file = None
        self._writers: dict[str, Any] = {}
        self._writer_class = None
        self._wandb = None
        self._kept: Optional[tuple[int, Optional[int]]] = None  # (step, warm-up step) of the last truncate_after
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.samples_path = self.run_dir / SAMPLES_FILE
        self._lines = len(_read_records(self.path))
        self._file = self.path.open("a", buffering=1)
        if tensorboard:
            self._writer_class = _summary_writer_class()
        if wandb is not None:
            self._wandb, resumed = _start_wandb(self.run_dir, wandb)
            self._wandb_has = self._lines if resumed else 0  # W&B steps (line numbers) the run already holds
            self._wandb_phases: set[str] = set()
        self._started = time.monotonic()

    def truncate_after(self, step: int, *, warmup_kept: Optional[int] = None) -> None:
        """Drop lines of steps > step (a resumed run rewrites what it does again), and warm-up ("sft") lines of
        warm-up steps > warmup_kept (None keeps them all); TensorBoard hides the same steps."""
        if not self.enabled:
            return
        self._kept = (step, warmup_kept)
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()  # reopened with purge_step at the next log
        self._file.close()
        for path in (self.path, self.samples_path):
            records = _read_records(path)
            kept = [line for line, record in records if record.get("step", 0) <= self._last_kept(record.get("phase"))]
            if path.exists():
                write_private_text(path, "".join(line + "\n" for line in kept))
            if path == self.path:
                self._lines = len(kept)
        self._file = self.path.open("a", buffering=1)

    def _last_kept(self, phase: Optional[str]) -> float:
        """The last step of phase that survived truncate_after (inf before any truncation)."""
        if self._kept is None:
            return math.inf
        step, warmup_kept = self._kept
        if phase == "sft":
            return math.inf if warmup_kept is None else warmup_kept
        return step

    def log(self, step: int, metrics: dict[str, float], *, phase: Optional[str] = None,
            total: Optional[int] = None) -> None:
        if not self.enabled:
            return
        record = {"step": step, **({"phase": phase} if phase else {}), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        line = self._lines
        self._lines += 1
        name = phase or "train"
        scalars = {f"{name}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._writer_class is not None:
            writer = self._writer(name)
            for key, value in scalars.items():
                writer.add_scalar(key, value, step)
        if self._wandb is not None and line >= self._wandb_has:
            if name not in self._wandb_phases:  # each phase's charts use its own step as the x axis
                self._wandb.define_metric(f"{name}/*", step_metric=f"{name}/step")
                self._wandb_phases.add(name)
            self._wandb.log({**scalars, f"{name}/step": step}, step=line)
        if self.console == "json":
            print(json.dumps(record), file=self.stream, flush=True)
        elif self.console == "progress":
            shown = "  ".join(f"{k} {_fmt(metrics[k])}" for k in CONSOLE_KEYS if k in metrics)
            total = self.total_steps if total is None else total
            where = f"step {step:>4}/{total}  " if total else ""  # total=0: a record of no training step (eval runs)
            print(f"{phase + ' ' if phase else ''}{where}{shown}", file=self.stream, flush=True)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Append ``samples`` (``Rollout.sample_records``) of step ``step`` to samples.jsonl, and to W&B as the
        table ``samples`` at the line of the step's metrics (logged next)."""
        if not self.enabled or not samples:
            return
        records = [{"step": step, **sample} for sample in samples]
        with open_private_append(self.samples_path) as handle:  # prompts and answers are the user's data
            handle.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode())
        if self._wandb is not None and self._lines >= self._wandb_has:
            import wandb

            columns = list(records[0])
            table = wandb.Table(columns=columns, data=[[_table_cell(c, r[c]) for c in columns] for r in records])
            self._wandb.log({"samples": table}, step=self._lines, commit=False)

    def _writer(self, phase: str):
        if phase not in self._writers:
            last = self._last_kept(phase)
            self._writers[phase] = self._writer_class(str(self.run_dir / "tensorboard" / phase),
                                                        purge_step=None if math.isinf(last) else int(last) + 1)
        return self._writers[phase]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()  # stops the wandb-core service process now rather than at interpreter exit
            self._wandb = None


def _read_records(path: Path) -> list[tuple[str, dict]]:
    if not path.exists():
        return []
    return [(line, json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _summary_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("warning: logging.tensorboard=true but tensorboard is not installed, so no TensorBoard logs are "
              "written: pip install 'megatron-rl[logging]' (or set logging.tensorboard=false)",
              file=sys.stderr, flush=True)
        return None
    return SummaryWriter


def _start_wandb(run_dir: Path, settings: Any) -> tuple[Any, bool]:
    """(the W&B run of this run folder, whether it continues one that an earlier attempt started); ``settings``:
    the logging.wandb section."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("logging.wandb is set but wandb is not installed: pip install 'megatron-rl[logging]' "
                          "(or set logging.wandb=null)") from None
    id_path = run_dir / WANDB_RUN_ID_FILE
    resumed = id_path.is_file()
    if resumed:
        run_id = id_path.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:16]
        write_private_text(id_path, run_id + "\n")
    config_path = run_dir / CONFIG_FILE  # as written by the launcher: ${oc.env:...} secrets stay unresolved
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else None
    run = wandb.init(project=settings.project, entity=settings.entity, mode=settings.mode, id=run_id, resume="allow",
                     name=run_dir.name, config=config, dir=os.environ.get("WANDB_DIR") or str(run_dir),
                     settings=wandb.Settings(console="off"))  # rank 0's stdout stays the job log
    return run, resumed


def _table_cell(column: str, value):
    """A W&B table cell: per-function rewards as JSON text, and the reference answer as text (a column keeps
    one type, and a data set may mix numbers and strings)."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return str(value) if column == "answer" and value is not None else value


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
