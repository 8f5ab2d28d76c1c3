"""Checks that need the model shape or the world size: run before anything starts or queues."""

from __future__ import annotations

import dataclasses

from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.limits import check_job_limits, check_limits, trainer_limits
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.spec.parallel import (
    ParallelDims,
    cuda_graph_error,
    microbatch_error,
    mla_error,
    packing_error,
    pads_sequences,
    sequence_error,
)


def with_pipeline_split(cfg: JobConfig, shape: ModelShape) -> JobConfig:
    """cfg with an uneven pipeline split filled in when pp (x vpp) does not divide the layers and none is given."""
    dims = ParallelDims.from_config(cfg.parallel, world_size=cfg.cluster.training_tasks,
                                    rollout_tasks=cfg.cluster.rollout_tasks).with_split(shape.num_layers)
    if (dims.first_stage_layers, dims.last_stage_layers) == (cfg.parallel.first_stage_layers,
                                                            cfg.parallel.last_stage_layers):
        return cfg
    parallel = dataclasses.replace(cfg.parallel, first_stage_layers=dims.first_stage_layers,
                                   last_stage_layers=dims.last_stage_layers)
    return dataclasses.replace(cfg, parallel=parallel)


def check_layout(cfg: JobConfig, shape: ModelShape) -> int:
    """Raise ConfigError naming the key and the fix when the layout cannot run; return the data-parallel size."""
    check_job_limits(cfg)
    par = cfg.parallel
    dims = ParallelDims.from_config(par, world_size=cfg.cluster.training_tasks, rollout_tasks=cfg.cluster.rollout_tasks)
    dims.check_model(shape)
    dp = dims.dp
    transformer_engine = cfg.runtime.uses_transformer_engine(gpus=cfg.cluster.has_gpus)
    seq = cfg.model.seq_length or shape.seq_length
    packs = par.micro_batch_tokens is not None  # micro-batches of tokens, any number of rows (rollout/packing.py)
    why = ((None if packs else microbatch_error(cfg.algorithm.global_batch_size, micro_batch=par.micro_batch_size,
                                                dp=dp, pp=dims.pp, vpp=dims.vpp))
           or sequence_error(seq, tp=dims.tp, cp=dims.cp, sp=dims.sp, pads=pads_sequences(cfg.algorithm.name))
           or mla_error(shape, tp=dims.tp, cp=dims.cp, sp=dims.sp, transformer_engine=transformer_engine)
           or packing_error(par.micro_batch_tokens, algorithm=cfg.algorithm.name, cp=dims.cp)
           or (cuda_graph_error(moe=shape.is_moe, mla=shape.is_mla, pp=par.rollout_pp or dims.pp,
                                staged_tp=cfg.cluster.has_gpus and par.backend == "gloo" and (par.rollout_tp or dims.tp) > 1)
               if cfg.generation.cuda_graphs else None))
    if why is not None:
        raise ConfigError(why)
    if cfg.algorithm.name == "grpo" and cfg.algorithm.rollout_size % dp:
        raise ConfigError(f"algorithm.prompts_per_step*group_size = {cfg.algorithm.rollout_size} is not divisible by "
                          f"the data-parallel size {dp}; make it a multiple of {dp}")
    if cfg.data.task is None and cfg.data.train_path is None:
        raise ConfigError("data.train_path and data.task are both null; give a JSONL file or a synthetic task")
    check_lengths(cfg, shape)
    if cfg.algorithm.router_replay and not shape.is_moe:
        raise ConfigError(f"algorithm.router_replay=true needs an MoE model and {shape.name} is dense; set it to false")
    check_runtime(cfg, dims, shape)
    check_limits(dataclasses.asdict(par), trainer_limits(shape, cfg.algorithm.name))
    return dp


GENERATING_ALGORITHMS = ("grpo", "ppo", "eval")
"""The algorithms that generate completions (generation.* applies)."""


def check_lengths(cfg: JobConfig, shape: ModelShape) -> None:
    """Raise ConfigError when a length key cannot fit the model's positions (max_position_embeddings): every
    sequence a job trains on or generates (a prompt and its completion, an episode's whole conversation) lies
    within them. The launch check and ``launch.py plan`` both run it."""
    positions = shape.max_position_embeddings
    where = f"{shape.name}'s {positions} positions (max_position_embeddings)"
    seq = cfg.model.seq_length or shape.seq_length
    if seq > positions:
        raise ConfigError(f"model.seq_length={seq} exceeds {where}; give at most {positions}")
    if cfg.data.max_length is not None and cfg.data.max_length > positions:
        raise ConfigError(f"data.max_length={cfg.data.max_length} exceeds {where}; give at most {positions}, or "
                          "null for model.seq_length")
    if cfg.algorithm.name not in GENERATING_ALGORITHMS:
        return
    if cfg.generation.max_new_tokens >= positions:  # a prompt holds at least one token
        raise ConfigError(f"generation.max_new_tokens={cfg.generation.max_new_tokens} leaves no room for a prompt in "
                          f"{where}; give at most {positions - 1} (the longest prompt plus max_new_tokens must fit)")
    if cfg.environment.name is not None and cfg.environment.max_episode_tokens > positions:
        raise ConfigError(f"environment.max_episode_tokens={cfg.environment.max_episode_tokens} exceeds {where}; "
                          f"give at most {positions}")


def check_runtime(cfg: JobConfig, dims: ParallelDims, shape: ModelShape) -> None:
    """The runtime.* kernels and overlaps against the resolved layout and the trainer."""
    rt, par = cfg.runtime, cfg.parallel
    if rt.tp_comm_overlap and cfg.algorithm.name != "pretrain":
        raise ConfigError(f"runtime.tp_comm_overlap=true needs every forward at one shape (TE's userbuffers), "
                          f"which algorithm.name={cfg.algorithm.name} does not have (only pretrain does); set it "
                          "false")
    if rt.tp_comm_overlap and not dims.sp:
        raise ConfigError("runtime.tp_comm_overlap=true needs parallel.sequence_parallel=true; set it")
    if par.recompute_num_layers is not None:
        most = max(dims.with_split(shape.num_layers).stage_layers(shape.num_layers))
        if par.recompute_num_layers > most:
            raise ConfigError(f"parallel.recompute_num_layers={par.recompute_num_layers} exceeds the {most} layers "
                              f"of the largest pipeline stage; give at most {most}, or null to recompute all")
