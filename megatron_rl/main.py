"""Entry point of every training process: ``python -m megatron_rl.main RUN_DIR/config.yaml``.

The launcher writes the resolved config and starts one of these per rank (local processes, ``srun`` or
submitit). Rank, world size and rendezvous come from the environment (see ``runtime.distributed``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
import sys
from pathlib import Path

from megatron_rl.spec.config import load_config
from megatron_rl.spec.config.validate import check_layout, with_pipeline_split
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import load_model_shape

# algorithm.name -> module with ``train(cfg, shape, ctx)``; imported only when chosen.
TRAINERS = {
    "pretrain": "megatron_rl.trainers.pretrain",
    "sft": "megatron_rl.trainers.sft",
    "grpo": "megatron_rl.trainers.rl",
    "ppo": "megatron_rl.trainers.rl",
    "rm": "megatron_rl.trainers.rm",
    "dpo": "megatron_rl.trainers.dpo",
    "eval": "megatron_rl.trainers.evaluate",
}
SPLIT_PLACEMENT_TRAINERS = {"grpo": "megatron_rl.trainers.rl"}
"""The trainer of an algorithm when rollout workers generate (cluster.rollout_tasks > 0)."""


KNOWN_NOTICES = (
    ".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*",
    ".*full scope is deprecated.*", ".*is deprecated. Please use `torch.distributed.*",
    ".*The .grad attribute of a Tensor that is not a leaf Tensor is being accessed.*",
    # megatron-core 0.19: GPTModel is kept (HybridModel is its successor; GPTModel still gets critical fixes),
    # DDP computes its own parameter layout, the synchronous save runs Megatron's own writer, torch's DCP notices
    ".*GPTModel IS DEPRECATED.*", ".*full_param_layout not provided.*", ".*MCore's async save is deprecated.*",
    ".*MimoModelConfig is experimental.*", ".*torch.distributed is disabled, unavailable or uninitialized.*",
    ".*The argument order of load has been changed.*", ".*Please use DTensor instead.*",
    ".*No CUDA runtime is found.*",  # torch's C++-extension helper, imported by megatron-core 0.19, on a CPU
    ".*load_common is deprecated.*",  # 0.19 reading a 0.16 checkpoint's common.pt
)
"""Known, harmless notices from megatron-core and torch.distributed that would bury the progress lines."""


class _KnownNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(re.match(pattern, record.getMessage(), re.DOTALL) for pattern in KNOWN_NOTICES)


def quiet_known_notices() -> None:
    """Drop ``KNOWN_NOTICES`` from Python warnings and from Megatron's loggers."""
    import warnings

    for pattern in KNOWN_NOTICES:
        warnings.filterwarnings("ignore", message=pattern)
    known = _KnownNotices()
    for handler in logging.getLogger().handlers:
        handler.addFilter(known)
    logging.lastResort.addFilter(known)  # Megatron's loggers have no handler of their own
    logging.getLogger("torch.utils.cpp_extension").addFilter(known)  # it has one


def run(config_path: str) -> int:
    from megatron_rl.runtime.stops import install_stop_handlers

    install_stop_handlers()  # before the slow imports, so an early preemption signal is not lost
    quiet_known_notices()
    from megatron_rl.runtime.distributed import initialize, read_dist_env, shutdown
    from megatron_rl.spec.parallel import ParallelDims, reshards, rollout_parallel
    from megatron_rl.trainers.common import TrainerContext

    cfg = load_config(config_path)
    shape = load_model_shape(cfg.model.name)
    check_layout(with_pipeline_split(cfg, shape), shape)  # the launch check: a config started by hand is refused too
    placement, resharded = None, False
    if cfg.cluster.rollout_tasks:  # split placement: this process trains, or only generates, in its role's world
        from megatron_rl.rollout.placement import split_placement

        placement = split_placement(read_dist_env(), rollout_tasks=cfg.cluster.rollout_tasks, run_dir=cfg.run.dir)
        placement.enter()
        if placement.role == "rollout":
            resharded = reshards(cfg.parallel)
            cfg = dataclasses.replace(cfg, parallel=rollout_parallel(cfg.parallel, shape.num_layers))
    dims = ParallelDims.from_config(cfg.parallel, world_size=read_dist_env().world_size)
    initialize(dims, seed=cfg.run.seed, backend=cfg.parallel.backend, timeout_s=cfg.parallel.timeout_s)
    ctx, error = None, None
    try:
        if placement is not None and placement.role == "rollout":
            from megatron_rl.trainers.rollout_worker import serve

            return serve(cfg, shape, placement, dims=dims, resharded=resharded)
        ctx = TrainerContext(cfg, shape=shape, dims=dims, config_path=config_path, placement=placement)
        trainers = TRAINERS if placement is None else SPLIT_PLACEMENT_TRAINERS
        importlib.import_module(trainers[cfg.algorithm.name]).train(cfg, shape, ctx)
    except BaseException as exc:
        error = exc
        if isinstance(exc, ConfigError) and exc.__cause__ is not None:  # a user's code failed (a reward fn)
            exc.traceback_file = _keep_traceback(exc.__cause__, cfg.run.dir)
        raise
    finally:
        if ctx is not None:
            ctx.close(error)  # the manifest's end time and status, after its pending checkpoint hashes
        _write_call_site_counts(cfg.run.dir)
        shutdown()
    return 0


def _keep_traceback(exc: BaseException, run_dir: str) -> Path | None:
    """Write ``exc``'s traceback to ``logs/error_rank<N>.log`` of the run, for its one-line error to name (the
    console and the launcher's tail of the rank log show that line only); None when it cannot be written."""
    import traceback

    from megatron_rl.runtime.distributed import job_rank
    from megatron_rl.spec.private import make_private_dir, write_private_text

    try:
        return write_private_text(make_private_dir(Path(run_dir) / "logs") / f"error_rank{job_rank()}.log",
                                  "".join(traceback.format_exception(exc)))
    except (OSError, ConfigError):
        return None


def _write_call_site_counts(run_dir: str) -> None:
    """Record, per call site, which Megatron calls the CPU redirection rewrote (tests check them against
    KNOWN_SITES), which ops gloo staging copied through CPU buffers (tests/test_gloo_staging.py) and which deferred
    imports were never needed (lazy_imports): one JSON file of each that is active, per rank of the job."""
    import json
    import os

    from megatron_rl.runtime import cpu_compat, gloo_staging, lazy_imports
    from megatron_rl.runtime.distributed import job_rank

    for name, active, counts in (("cpu_redirects", cpu_compat.is_active(), cpu_compat.redirect_counts),
                                 ("gloo_staged", gloo_staging.is_installed(), gloo_staging.staged_counts),
                                 ("deferred_imports", True, lambda: {module: lazy_imports.is_deferred(module)
                                                                     for module in lazy_imports.DEFERRED})):
        if not active:
            continue
        path = os.path.join(run_dir, "logs", f"{name}_rank{job_rank()}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(counts(), f, indent=1, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.spec.private import private_umask

    private_umask()  # checkpoints, exports, logs and metrics are 0600 in 0700 folders, whatever the caller's umask
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m megatron_rl.main RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    try:
        return run(argv[0])
    except ConfigError as exc:
        kept = getattr(exc, "traceback_file", None)
        print(f"error: {exc}" + (f" (its traceback: {kept})" if kept else ""), file=sys.stderr)
        return 2


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    try:
        code = main()
    except SystemExit as stop:  # a preemption's save-and-exit (Preempted) or a stop handler's exit
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) or stop.code is None else 1
    exit_process(code)
