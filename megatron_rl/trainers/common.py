"""What every trainer shares around its loop: resume, per-step logging, periodic and preemption saves.

Preemption: Slurm sends SIGUSR1 (``--signal=USR1@N``) or SIGTERM before a time limit or a preemption. The
handler only sets a flag; the trainer finishes its current step, every rank agrees on the flag, a checkpoint
is saved, and the process exits with ``REQUEUE_EXIT_CODE`` so the job script requeues it. The next run
resumes from that checkpoint and continues the same run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from launcher.config.schema import JobConfig
from launcher.slurm import REQUEUE_EXIT_CODE
from megatron_rl.runtime import checkpoint as ckpt
from megatron_rl.runtime.distributed import global_rank, on_rank_zero
from megatron_rl.runtime.metrics import MetricsLogger


_stop_signal = {"received": False}


def install_stop_handlers() -> None:
    """Catch SIGUSR1/SIGTERM from the first moment of the process: the flag waits for the next step's end."""
    def request_stop(signum: int, frame: Any) -> None:
        _stop_signal["received"] = True

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, request_stop)


def _new_run_id() -> str:
    """A new id, the same on every rank (rank 0's, broadcast)."""
    import uuid

    box = [uuid.uuid4().hex]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is saved; exits the process with REQUEUE_EXIT_CODE."""

    def __init__(self) -> None:
        super().__init__(REQUEUE_EXIT_CODE)


@dataclass
class _Timer:
    seconds: float = 0.0


@dataclass
class TrainerContext:
    """Run folder, metrics, checkpoints and the preemption flag for one training process."""

    cfg: JobConfig
    shape: Optional[Any] = None
    """The model's ModelShape, stored in every checkpoint so it exports to Hugging Face without extra input."""
    logger: MetricsLogger = field(init=False)
    extra_state: Callable[[], dict] = field(default=lambda: {})
    resumed_extra: dict = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.rank = global_rank()
        self.logger = MetricsLogger(self.cfg.run.dir, total_steps=self.cfg.run.steps,
                                    console=self.cfg.logging.console, tensorboard=self.cfg.logging.tensorboard,
                                    enabled=self.rank == 0)
        install_stop_handlers()
        if os.environ.get("MEGATRON_RL_STOP_AFTER_STEP"):
            self._stop_after = int(os.environ["MEGATRON_RL_STOP_AFTER_STEP"])
        else:
            self._stop_after = None

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.cfg.checkpoint_dir)

    @contextlib.contextmanager
    def timer(self) -> Iterator[_Timer]:
        t = _Timer()
        start = time.perf_counter()
        try:
            yield t
        finally:
            t.seconds = time.perf_counter() - start

    def resume(self, engine, *, init_from: Optional[str] = None,
               load_init: Optional[Callable[[str, list], str]] = None) -> int:
        """Load the newest complete checkpoint of this run (or ``init_from`` weights); return its step.

        ``load_init(path, chunks) -> description`` loads starting weights for models whose keys differ from
        the checkpoint's (a reward model started from a policy); default: a plain model-only load.
        """
        ckpt.remove_partial_saves(self.ckpt_dir)
        found = ckpt.latest_checkpoint(self.ckpt_dir) if self.cfg.checkpoint.resume else None
        if found is not None:
            state = ckpt.load_checkpoint(found, chunks=engine.chunks, optimizer=engine.optimizer,
                                         scheduler=engine.scheduler)
            engine.step = state["step"]
            self.resumed_extra = state["extra"]
            ckpt.set_run_id(state["extra"].get("run_id"))  # None for checkpoints of older versions
            self.logger.truncate_after(engine.step)
            self.say(f"resumed from {found} (step {engine.step}"
                     f"{', new layout: RNG reseeded' if state['layout_changed'] else ''})")
            return engine.step
        ckpt.set_run_id(_new_run_id())  # a fresh start: its saves (and reference model) are its own
        source = init_from or self.cfg.model.init_from
        if source:
            if load_init is None:
                ckpt.load_checkpoint(source, chunks=engine.chunks, load_optimizer=False)
                self.say(f"initialised weights from {source}")
            else:
                self.say(f"initialised weights from {source} ({load_init(source, engine.chunks)})")
        self.logger.truncate_after(0, keep_warmup=False)
        return 0

    def end_step(self, engine, step: int, metrics: dict[str, float]) -> None:
        """Log the step; save at the interval; on a preemption request save and exit for requeue."""
        self.logger.log(step, metrics)
        stop = self._agree_on_stop(step)
        interval = self.cfg.checkpoint.save_interval
        if stop or (interval and step % interval == 0 and step < self.cfg.run.steps):
            self.save(engine, step)
        if stop:
            self.say(f"preemption requested: saved step {step}, exiting with code {REQUEUE_EXIT_CODE} for requeue")
            self.logger.close()
            raise Preempted()

    def _agree_on_stop(self, step: int) -> bool:
        local = _stop_signal["received"] or (self._stop_after is not None and step >= self._stop_after)
        flag = torch.tensor([1.0 if local else 0.0])
        if torch.cuda.is_available():
            flag = flag.cuda()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0) and step < self.cfg.run.steps

    def save(self, engine, step: int, *, final: bool = False) -> Path:
        extra = dict(self.extra_state())
        if self.shape is not None:
            from megatron_rl.conversion.export import model_metadata

            extra["model"] = model_metadata(self.shape, tokenizer_dir=self.cfg.model.tokenizer)
        folder = ckpt.save_checkpoint(self.ckpt_dir, step=step, chunks=engine.chunks, optimizer=engine.optimizer,
                                      scheduler=engine.scheduler, extra=extra,
                                      keep_last=self.cfg.checkpoint.keep_last)
        self._saves = getattr(self, "_saves", 0) + 1
        every = self.cfg.checkpoint.export_hf_every
        if self.cfg.checkpoint.export_hf and (final or (every and self._saves % every == 0)):
            self.export_hf(folder, final=final)
        return folder

    def export_hf(self, folder: Path, *, final: bool) -> None:
        """Hugging Face export of a saved checkpoint on this job's own nodes (rank 0 reads it tensor by tensor)."""
        from megatron_rl.conversion.export import export_checkpoint_to_hf

        out = Path(self.cfg.run.dir) / "hf" / ("final" if final else folder.name)
        summary = on_rank_zero(lambda: export_checkpoint_to_hf(folder, out, hf_source=self.cfg.model.tokenizer,
                                                               overwrite=True))
        if summary is not None:
            self.say(f"exported {folder.name} to Hugging Face format: {out} ({summary.num_shards} shard(s))")

    def finish(self, engine) -> None:
        if self.cfg.checkpoint.save_at_end and engine.step > 0:
            folder = self.save(engine, engine.step, final=True)
            self.say(f"saved final checkpoint {folder}")
        self.logger.close()

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(message, file=sys.stdout, flush=True)
