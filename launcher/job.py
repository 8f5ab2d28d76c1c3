"""Turn a loaded config into a job that is safe to start: model shape, executor, layout (planned or checked).

Everything here runs on the login node before anything queues, and never imports torch or megatron.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launcher.config import JobConfig, to_yaml
from launcher.config.validate import check_layout
from launcher.errors import ConfigError
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


def apply_plan(cfg: JobConfig, shape: ModelShape):
    """Run the planner for cfg's GPUs and write its layout into cfg.parallel; returns (cfg, PlanResult)."""
    from launcher.planner import GrpoSizing, evaluate

    cluster, algo = cfg.cluster, cfg.algorithm
    grpo = None
    if algo.name == "grpo":
        grpo = GrpoSizing(rollout_batch_size=algo.rollout_size, max_response_length=cfg.generation.max_new_tokens,
                          reference_model=algo.kl_coef > 0, kv_cache_released_for_training=True)
    # Restricted to what the trainers run today: no context parallelism, MoE layers at tp=1, and for GRPO what
    # colocated generation supports (no sequence parallelism, no expert parallelism).
    runnable = {"cp": 1, **({"tp": 1} if shape.is_moe else {})}
    if algo.name == "grpo":
        runnable.update(sequence_parallel=False, ep=1)
    result = evaluate(shape, runnable, num_gpus=cluster.world_size, gpu_type=cluster.gpu_type,
                      seq_length=cfg.model.seq_length, global_batch_size=algo.global_batch_size,
                      mode=PLANNER_MODES[algo.name], grpo=grpo)
    if not result.fits:
        raise ConfigError(f"no layout for {shape.name} on {cluster.world_size} x {cluster.gpu_type} fits in memory "
                          f"(best needs {result.memory['total']:.1f} GiB of {result.memory['capacity']:.1f}); "
                          "add nodes (see `python launch.py plan`) or shorten model.seq_length")
    even = [e.layout for e in (result.estimate, *result.alternatives) if e.fits and _even_split(e.layout)]
    if not even:
        raise ConfigError(f"the planner's layouts for {shape.name} need an uneven pipeline split "
                          f"({result.layout.split_name()}) that the trainers cannot build yet; set parallel.auto=false "
                          "and give tp/pp explicitly")
    layout = even[0]
    parallel = dataclasses.replace(
        cfg.parallel, tp=layout.tp, pp=layout.pp, vpp=layout.vpp if layout.vpp > 1 else None, cp=layout.cp,
        ep=layout.ep, micro_batch_size=layout.micro_batch_size, recompute=layout.recompute,
        sequence_parallel=layout.sequence_parallel)
    return dataclasses.replace(cfg, parallel=parallel), result


def _even_split(layout) -> bool:
    return (layout.first_stage_layers is None and layout.last_stage_layers is None
            and not layout.account_for_embedding and not layout.account_for_loss)


def prepare(cfg: JobConfig) -> PreparedJob:
    """Load the shape, pick the executor and the layout, and check that the job can run."""
    shape = load_model_shape(cfg.model.name)
    executor = resolve_executor(cfg.cluster.executor)
    if executor == "local" and cfg.cluster.nodes != 1:
        raise ConfigError(f"cluster.nodes={cfg.cluster.nodes} needs Slurm, but `sbatch` is not on PATH; "
                          "set cluster.nodes=1 for a local run or run from a Slurm login node")
    result = None
    if cfg.parallel.auto:
        cfg, result = apply_plan(cfg, shape)
    dp = check_layout(cfg, shape)
    run_dir = Path(cfg.run.dir).expanduser().resolve()
    return PreparedJob(cfg=cfg, shape=shape, executor=executor, run_dir=run_dir, data_parallel_size=dp,
                       plan=result)
