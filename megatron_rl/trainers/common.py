"""What every trainer shares around its loop: resume, per-step logging, periodic and preemption saves.

Preemption: Slurm sends SIGUSR1 (``--signal=USR1@N``) or SIGTERM before a time limit or a preemption. The
handler only sets a flag; the trainer finishes its current step, every rank agrees on the flag, a checkpoint
is saved, and the process exits with ``REQUEUE_EXIT_CODE`` so the job script requeues it. The next run
resumes from that checkpoint and continues the same run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_rl.runtime import checkpoint as ckpt
from megatron_rl.runtime.distributed import collective_device, global_rank, on_rank_zero
from megatron_rl.runtime.manifest import RunManifest
from megatron_rl.runtime.memory import GIB, PHASES
from megatron_rl.runtime.metrics import MetricsLogger
from megatron_rl.runtime.stops import Preempted, install_stop_handlers, stop_signal_received
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.parallel import ParallelDims
from megatron_rl.spec.run_files import REQUEUE_EXIT_CODE

def _rank_hosts() -> list[str]:
    """Every rank's hostname, indexed by rank (one all-gather; this host alone without a process group)."""
    import socket

    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if not torch.distributed.is_initialized():
        return [host]
    hosts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(hosts, host)
    return hosts


def _new_run_id() -> str:
    """A new id, the same on every rank (rank 0's, broadcast)."""
    import uuid

    box = [uuid.uuid4().hex]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


WARMUP_DONE = "warmup_steps_done"
"""Extra-state key of a trainer with a warm-up phase: its steps done when the checkpoint was saved."""
AUTO_SAVE_OVERHEAD = 10
"""checkpoint.save_interval=auto keeps at least this many save durations between saves (at most ~10% saving)."""


def auto_save_due(*, since_save_s: float, last_save_s: float, warning_window_s: float) -> bool:
    """checkpoint.save_interval=auto: save once a warning window (cluster.signal_delay_s) has passed since the
    previous save, but no sooner than AUTO_SAVE_OVERHEAD save durations. Before the first save its duration is
    unknown (0), so with no warning window the first step is saved, which measures it."""
    return since_save_s >= max(warning_window_s, AUTO_SAVE_OVERHEAD * last_save_s)


@dataclass
class _Timer:
    seconds: float = 0.0


@dataclass
class TrainerContext:
    """Run folder, metrics, checkpoints and the preemption flag for one training process."""

    cfg: JobConfig
    shape: Optional[Any] = None
    """The model's ModelShape, stored in every checkpoint so it exports to Hugging Face without extra input."""
    config_path: Optional[str] = None
    """The config.yaml this process loaded: its ``${oc.env:...}`` keys stay unresolved in the run's manifest."""
    dims: Optional[ParallelDims] = None
    """The job's parallel sizes, built once at start (``main.run``); None: from parallel over this world."""
    placement: Optional[Any] = None
    """With cluster.rollout_tasks > 0: this trainer's ``megatron_rl.rollout.placement.Placement``; None when
    generation is colocated."""
    logger: MetricsLogger = field(init=False)
    extra_state: Callable[[], dict] = field(default=lambda: {})
    resumed_extra: dict = field(default_factory=dict, init=False)
    companions: dict[str, Any] = field(default_factory=dict)
    """Further engines saved and resumed with the trainer's (PPO's critic): name -> Engine, each a checkpoint of
    its own (weights, optimizer, schedule) in ``<checkpoint dir>/<name>/`` at the same step, saved first, so
    that the main checkpoint of a step (the commit point) never exists without theirs."""

    def __post_init__(self) -> None:
        self.rank = global_rank()
        self.logger = MetricsLogger(self.cfg.run.dir, total_steps=self.cfg.run.steps,
                                    console=self.cfg.logging.console, tensorboard=self.cfg.logging.tensorboard,
                                    wandb=self.cfg.logging.wandb, enabled=self.rank == 0)
        install_stop_handlers()
        self.manifest = RunManifest(self.cfg, enabled=self.rank == 0, config_path=self.config_path, rank=self.rank)
        self.manifest.start(rank_hosts=_rank_hosts())  # a collective: every rank makes its context once
        # Deterministic preemption for tests: "N" stops after training step N, "sft:N" after warm-up step N.
        phase, _, at = os.environ.get("MEGATRON_RL_STOP_AFTER_STEP", "").rpartition(":")
        self._stop_after = (phase or None, int(at)) if at else None
        self._last_save_end = time.monotonic()
        self._last_step_end: Optional[float] = None
        self._save_s = 0.0
        self._warned_window = False
        self.last_step = 0  # the last step the loop finished (or resumed at)
        self.last_saved_step: Optional[int] = None  # the newest checkpoint this process saved or resumed from

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
        if engine.trainable_fraction is not None:  # LoRA
            self.say(f"LoRA: {engine.trainable_fraction:.4%} of the parameters are trainable")
        found = (ckpt.resumable_checkpoint(self.ckpt_dir, companions=tuple(self.companions), warn=self.say)
                 if self.cfg.checkpoint.resume else None)
        if found is not None:
            state = ckpt.load_checkpoint(found, chunks=engine.chunks, optimizer=engine.optimizer,
                                         scheduler=engine.scheduler)
            engine.step = state["step"]
            for name, companion in self.companions.items():
                ckpt.load_checkpoint(self.ckpt_dir / name / ckpt.step_dir_name(engine.step), chunks=companion.chunks,
                                     optimizer=companion.optimizer, scheduler=companion.scheduler)
                companion.step = engine.step
            self.resumed_extra = state["extra"]
            ckpt.set_run_id(state["extra"].get("run_id"))  # None for checkpoints of older versions
            self.logger.truncate_after(engine.step, warmup_kept=state["extra"].get(WARMUP_DONE))
            self.last_step = self.last_saved_step = engine.step
            self.manifest.resumed(engine.step)
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
            # The optimizer was built before the load: with bf16/fp16 parameters its fp32 main copies still hold
            # the random init, and its first step would write that back into the model.
            engine.optimizer.reload_model_params()
        self.logger.truncate_after(0, warmup_kept=0)
        return 0

    def end_step(self, engine, step: int, metrics: dict[str, float]) -> None:
        """Log the step (with each phase's peak memory on the fullest rank); save at the interval; on a
        preemption request save and exit for requeue."""
        now = time.monotonic()
        step_s = None if self._last_step_end is None else now - self._last_step_end
        self._last_step_end = now
        peaks = [float(engine.peak_memory.get(phase, 0)) for phase in PHASES]
        stop, save_due, *peaks = self._agree(self._stop_requested(None, step), self._save_due(step, now), *peaks)
        engine.peak_memory.clear()
        if engine.trainable_fraction is not None:  # LoRA
            metrics = {**metrics, "trainable_fraction": engine.trainable_fraction}
        self.logger.log(step, {**metrics, **{f"peak_memory_{phase}_gib": round(peak / GIB, 4)
                                             for phase, peak in zip(PHASES, peaks) if peak}})
        self.last_step = step
        if step >= self.cfg.run.steps:
            return
        if stop:
            self.preempt(engine, step, what=f"step {step}")
        if save_due:
            self.save(engine, step)
            self._warn_if_the_window_is_short(step_s)

    def log_samples(self, step: int, rollout) -> None:
        """Every logging.sample_every steps: logging.samples of the step's completions (a ``Rollout``, scored) to
        samples.jsonl (rank 0; every rank holds the whole rollout)."""
        every = self.cfg.logging.sample_every
        if every and step % every == 0:
            self.logger.log_samples(step, rollout.sample_records(self.cfg.logging.samples))

    def stop_in_phase(self, phase: str, step: int) -> bool:
        """After ``phase``'s step ``step`` (e.g. the SFT warm-up): whether any rank was asked to stop. A
        collective: every rank calls it at the same point."""
        return self._agree(self._stop_requested(phase, step))[0]

    def stop_while_generating(self, phase: str, step: int, generating: bool) -> tuple[bool, bool]:
        """(whether any rank was asked to stop, whether any rank still generates): the generation engines' stop
        question (megatron_rl/generation/engine.py), asked by rollouts that end at different steps. A collective."""
        ckpt.fault_point("kill-during-generation", step)
        stop, anyone = self._agree(self._stop_requested(phase, step), generating)
        return stop, anyone

    def preempt(self, engine, step: int, *, what: str) -> None:
        """Save checkpoint ``step`` (its extra state tells where inside the run it stopped) and exit for requeue."""
        self.save(engine, step)
        self.say(f"preemption requested: saved {what}, exiting with code {REQUEUE_EXIT_CODE} for requeue")
        self.logger.close()
        raise Preempted()

    def preempt_before(self, engine, step: int, *, what: str) -> None:
        """Step ``step`` was abandoned (``what`` was stopped) with the state as it was after step - 1: save that
        state as checkpoint step - 1 (unless it is the newest saved already) and exit for requeue."""
        if self.last_saved_step != step - 1:
            self.save(engine, step - 1)
        self.say(f"preemption requested during step {step}: stopped {what}, saved step {step - 1}, exiting with "
                 f"code {REQUEUE_EXIT_CODE} for requeue")
        self.logger.close()
        raise Preempted()

    def _stop_requested(self, phase: Optional[str], step: int) -> bool:
        """This rank's view: a stop signal arrived, or MEGATRON_RL_STOP_AFTER_STEP names this phase and step."""
        return stop_signal_received() or (self._stop_after is not None and self._stop_after[0] == phase
                                            and step >= self._stop_after[1])

    def _save_due(self, step: int, now: float) -> bool:
        interval = self.cfg.checkpoint.save_interval
        if interval == "auto":  # rank 0's clock decides for everyone (the flags are max-reduced)
            return self.rank == 0 and auto_save_due(since_save_s=now - self._last_save_end, last_save_s=self._save_s,
                                                    warning_window_s=self.cfg.cluster.signal_delay_s)
        return bool(interval) and step % interval == 0

    @staticmethod
    def _agree(*values):
        """Each value's maximum over all ranks (one collective); booleans come back as booleans."""
        box = torch.tensor([float(v) for v in values], dtype=torch.float64).to(collective_device())
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(box, op=torch.distributed.ReduceOp.MAX)
        return [bool(got > 0) if isinstance(v, bool) else got for v, got in zip(values, box.tolist())]

    def _warn_if_the_window_is_short(self, step_s: Optional[float]) -> None:
        window = self.cfg.cluster.signal_delay_s
        if (self._warned_window or step_s is None or "SLURM_JOB_ID" not in os.environ
                or step_s + self._save_s <= window):
            return
        self._warned_window = True
        self.say(f"warning: a step takes {step_s:.0f} s and a save {self._save_s:.0f} s, more than the "
                 f"{window} s warning window (cluster.signal_delay_s): a preemption or time-limit warning comes "
                 f"too late to checkpoint; raise cluster.signal_delay_s to at least {step_s + self._save_s:.0f}")

    def save(self, engine, step: int, *, final: bool = False) -> Path:
        extra = dict(self.extra_state())
        if self.shape is not None:
            from megatron_rl.conversion.export import model_metadata

            extra["model"] = model_metadata(self.shape, tokenizer_dir=self.cfg.model.tokenizer)
        start = time.monotonic()
        for name, companion in self.companions.items():  # one more kept: a crash before the main save leaves step-1
            ckpt.save_checkpoint(self.ckpt_dir / name, step=step, chunks=companion.chunks, optimizer=companion.optimizer,
                                 scheduler=companion.scheduler, extra={**extra, ckpt.COMPANION_KEY: name},
                                 keep_last=self.cfg.checkpoint.keep_last + 1)
        folder = ckpt.save_checkpoint(self.ckpt_dir, step=step, chunks=engine.chunks, optimizer=engine.optimizer,
                                      scheduler=engine.scheduler, extra=extra,
                                      keep_last=self.cfg.checkpoint.keep_last)
        self.last_saved_step = step
        self._last_save_end = time.monotonic()
        self._save_s = self._last_save_end - start
        for name in self.companions:
            self.manifest.checkpoint_saved(self.ckpt_dir / name / ckpt.step_dir_name(step), step,
                                           save_s=self._save_s, kind=name)
        self.manifest.checkpoint_saved(folder, step, save_s=self._save_s)
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
            self.manifest.export_written(folder, out)

    def finish(self, engine) -> None:
        """Save the last step (the loop's step: a GRPO step takes several optimizer steps) and close the log."""
        if self.cfg.checkpoint.save_at_end and self.last_step > 0:
            folder = self.save(engine, self.last_step, final=True)
            self.say(f"saved final checkpoint {folder}")
        self.logger.close()
        if self.rank == 0:
            self.say_prediction_beside_measurement()

    def close(self, error: Optional[BaseException]) -> None:
        """The end of this process (``error``: what ended the trainer, None when it returned): the manifest
        records the attempt's end and status once every pending hash is written."""
        if error is None:
            status = "completed"
        elif isinstance(error, Preempted):
            status = "preempted"
        elif isinstance(error, SystemExit):
            status = f"exited {error.code}"
        else:
            status = f"failed: {type(error).__name__}"
        self.manifest.finished(status)

    def say_prediction_beside_measurement(self) -> None:
        """The planner's step time and memory for this job (prediction.json, written at launch) beside what the
        run measured (metrics.jsonl); nothing when the launcher wrote no prediction."""
        from megatron_rl.spec.calibrate import calibration_report, one_line
        from megatron_rl.spec.run_files import PREDICTION_FILE

        if (Path(self.cfg.run.dir) / PREDICTION_FILE).is_file():
            on = None if torch.cuda.is_available() else "cpu"  # GPU names do not map onto gpu_type names
            self.say(one_line(calibration_report(self.cfg.run.dir, on=on)))

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(message, file=sys.stdout, flush=True)


def job_model_options(cfg: JobConfig, shape, dims: Optional[ParallelDims] = None):
    """``model_options`` of the job's sections at ``dims`` (the job's, built once at start: ``main.run`` hands them
    down through ``TrainerContext.dims``; None: from parallel over this world, for a process without a context)."""
    from megatron_rl.runtime.training import model_options  # Megatron: imported after initialize patched it

    if dims is None:
        dims = ParallelDims.from_config(cfg.parallel, world_size=torch.distributed.get_world_size())
    return model_options(shape, dims, model=cfg.model, parallel=cfg.parallel, runtime=cfg.runtime,
                         seed=cfg.run.seed, router_replay=cfg.algorithm.name == "grpo" and cfg.algorithm.router_replay)


def job_engine(cfg: JobConfig, shape, *, dims: Optional[ParallelDims] = None, total_steps: Optional[int] = None,
               lr: Optional[float] = None, build_chunks: Optional[Callable] = None):
    """``build_engine`` of the job's sections: the model at ``job_model_options``, the optimizer section's
    schedule over ``total_steps`` (default run.steps) at peak ``lr`` (default optimizer.lr)."""
    from megatron_rl.runtime.training import build_engine  # Megatron: imported after initialize patched it

    return build_engine(shape, job_model_options(cfg, shape, dims), optimizer=cfg.optimizer, runtime=cfg.runtime,
                        parallel=cfg.parallel, steps=total_steps or cfg.run.steps, lr=lr,
                        **({"build_chunks": build_chunks} if build_chunks is not None else {}))


def record_eval(path: Path, stage: str, entry: dict) -> None:
    """Add (or replace) ``stage``'s entry in the eval.json at ``path`` (the eval trainer's), privately."""
    import json

    from megatron_rl.spec.private import write_private_text

    entries = json.loads(path.read_text()) if path.is_file() else {}
    entries[stage] = entry
    write_private_text(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")
