"""Turn a loaded config into a job that is safe to start: model shape, executor, layout (planned or checked).

Everything here runs on the login node before anything queues, and never imports torch or megatron.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Optional

from launcher.config import JobConfig, to_yaml
from launcher.config.validate import check_layout, with_pipeline_split
from launcher.errors import ConfigError
from launcher.limits import check_limits, trainer_limits
from launcher.model_shape import ModelShape, load_model_shape

PLANNER_MODES = {"grpo": "grpo", "rm": "rm", "sft": "pretrain", "pretrain": "pretrain"}


@dataclass(frozen=True, kw_only=True)
class PreparedJob:
    """A checked job: what every executor needs to start it."""

    cfg: JobConfig
    """The resolved config (layout filled in when the planner chose it)."""
    shape: ModelShape
    """The model's shape."""
    executor: str
    """local or slurm (auto resolved)."""
    run_dir: Path
    """Absolute run folder."""
    data_parallel_size: int
    """World size / (tp * pp * cp)."""
    plan: Optional[Any] = None
    """The planner's PlanResult when parallel.auto chose the layout."""

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.yaml"

    def write_config(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(to_yaml(self.cfg))
        return self.config_path


def resolve_executor(name: str) -> str:
    """auto means slurm when `sbatch` is on PATH, else local."""
    if name == "auto":
        return "slurm" if shutil.which("sbatch") else "local"
    return name


def plan_job(cfg: JobConfig, shape: ModelShape, *, given: Collection[str] = frozenset(), precision: str = "bf16",
             top_k: int = 5):
    """The one sizing call for a job, made by ``prepare`` (parallel.auto=true) and by ``launch.py plan``: the
    planner's search for cfg's world size, GPU type, sequence length, global batch and trainer, and for GRPO its
    rollout size, response length (generation.max_new_tokens), reference model (algorithm.kl_coef > 0), KV cache
    release and optimizer offload (generation.offload_optimizer). It keeps the ``parallel.*`` keys named in
    ``given`` (``launcher.config.loader.given_keys``) and the trainer limits (``launcher.limits``).
    Returns the PlanResult; NoFeasibleLayout when nothing fits, ConfigError when a given key cannot be kept."""
    from launcher.planner import PLANNED_KEYS, GrpoSizing, NoFeasibleLayout, Runtime, plan

    algo, par = cfg.algorithm, cfg.parallel
    limits = trainer_limits(shape, algo.name)
    given_parallel = {key.removeprefix("parallel.") for key in given if key.startswith("parallel.")}
    check_limits({key: getattr(par, key) for key in given_parallel}, limits)
    if shape.is_moe and "etp" in given_parallel:
        raise ConfigError(f"parallel.etp={par.etp}: the planner models experts at etp=1 under ep > 1 and etp=tp "
                          "otherwise; leave parallel.etp unset, or give the whole layout with parallel.auto=false")
    fixed = {key: getattr(par, key) for key in PLANNED_KEYS if key in given_parallel}
    if "vpp" in fixed:
        fixed["vpp"] = fixed["vpp"] or 1  # null: plain 1F1B
    grpo = None
    if algo.name == "grpo":
        grpo = GrpoSizing(rollout_batch_size=algo.rollout_size, max_response_length=cfg.generation.max_new_tokens,
                          reference_model=algo.kl_coef > 0, kv_cache_released_for_training=True,
                          optimizer_offloaded_for_generation=cfg.generation.offload_optimizer)
    try:
        return plan(shape, num_gpus=cfg.cluster.world_size, gpu_type=cfg.cluster.gpu_type,
                    seq_length=cfg.model.seq_length, global_batch_size=algo.global_batch_size,
                    mode=PLANNER_MODES[algo.name], precision=precision, grpo=grpo, top_k=top_k,
                    runtime=Runtime(distributed_optimizer=par.distributed_optimizer), fixed=fixed, limits=limits)
    except NoFeasibleLayout:
        raise
    except ConfigError as exc:  # the search names held keys as --layout ones; here they are parallel.* keys
        raise ConfigError(str(exc).replace("--layout ", "parallel.", 1)) from None


def apply_plan(cfg: JobConfig, shape: ModelShape, *, given: Collection[str] = frozenset()):
    """``plan_job`` and its layout written into cfg.parallel; returns (cfg, PlanResult). Nothing fitting is a
    ConfigError naming the node count that would fit."""
    from launcher.planner import NoFeasibleLayout

    try:
        result = plan_job(cfg, shape, given=given)
    except NoFeasibleLayout as exc:
        nodes = -(-exc.smallest_gpus // cfg.cluster.tasks_per_node) if exc.smallest_gpus else None
        raise ConfigError(f"parallel.auto: {exc}" + (f"; set cluster.nodes={nodes}" if nodes else "")) from None
    layout = result.layout
    parallel = dataclasses.replace(
        cfg.parallel, tp=layout.tp, pp=layout.pp, vpp=layout.vpp if layout.vpp > 1 else None, cp=layout.cp,
        ep=layout.ep, micro_batch_size=layout.micro_batch_size, recompute=layout.recompute,
        sequence_parallel=layout.sequence_parallel, first_stage_layers=layout.first_stage_layers,
        last_stage_layers=layout.last_stage_layers, account_for_embedding=layout.account_for_embedding,
        account_for_loss=layout.account_for_loss, etp=None)  # None: 1 under EP, else tp, as the planner models
    return dataclasses.replace(cfg, parallel=parallel), result


def prepare(cfg: JobConfig, *, given: Collection[str] = frozenset()) -> PreparedJob:
    """Load the shape, pick the executor and the layout, and check that the job can run. ``given``: the keys the
    user set (``given_keys`` of the same file and overrides); with parallel.auto the planner keeps those."""
    shape = load_model_shape(cfg.model.name)
    executor = resolve_executor(cfg.cluster.executor)
    if executor == "local" and cfg.cluster.nodes != 1:
        raise ConfigError(f"cluster.nodes={cfg.cluster.nodes} needs Slurm, but `sbatch` is not on PATH; "
                          "set cluster.nodes=1 for a local run or run from a Slurm login node")
    result = None
    if cfg.parallel.auto:
        cfg, result = apply_plan(cfg, shape, given=given)
    cfg = with_pipeline_split(cfg, shape)
    dp = check_layout(cfg, shape)
    run_dir = Path(cfg.run.dir).expanduser().resolve()
    return PreparedJob(cfg=cfg, shape=shape, executor=executor, run_dir=run_dir, data_parallel_size=dp,
                       plan=result)
