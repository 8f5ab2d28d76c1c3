"""Checks that need the model shape or the world size: run before anything starts or queues."""

from __future__ import annotations

from launcher.config.schema import JobConfig
from launcher.errors import ConfigError
from launcher.model_shape import ModelShape


def check_layout(cfg: JobConfig, shape: ModelShape) -> int:
    """Raise ConfigError naming the key and the fix when the layout cannot run; return the data-parallel size."""
    par, world = cfg.parallel, cfg.cluster.world_size
    world_keys = "cluster.nodes*cluster.tasks_per_node"
    if shape.num_attention_heads % par.tp:
        raise ConfigError(f"parallel.tp={par.tp} does not divide the {shape.num_attention_heads} attention heads of "
                          f"{shape.name}; use a tp that divides {shape.num_attention_heads}")
    if shape.num_query_groups % par.tp:
        raise ConfigError(f"parallel.tp={par.tp} does not divide the {shape.num_query_groups} query groups (KV heads) "
                          f"of {shape.name}; use a tp that divides {shape.num_query_groups}")
    stages = par.pp * (par.vpp or 1)
    if shape.num_layers % stages:
        what = f"parallel.pp*vpp={stages}" if (par.vpp or 1) > 1 else f"parallel.pp={par.pp}"
        raise ConfigError(f"{what} does not divide the {shape.num_layers} layers of {shape.name}; "
                          f"use a pipeline size that divides {shape.num_layers}")
    if par.ep > 1 and not shape.is_moe:
        raise ConfigError(f"parallel.ep={par.ep} but {shape.name} has no experts; set parallel.ep=1")
    if shape.is_moe and shape.num_experts % par.ep:
        raise ConfigError(f"parallel.ep={par.ep} does not divide the {shape.num_experts} experts of {shape.name}")
    if shape.is_moe and par.tp > 1 and not par.sequence_parallel:
        raise ConfigError("MoE models with parallel.tp > 1 need parallel.sequence_parallel=true (Megatron requires it)")
    dense = par.tp * par.pp * par.cp
    if world % dense:
        raise ConfigError(f"parallel.tp*pp*cp = {par.tp}*{par.pp}*{par.cp} = {dense} does not divide the world size "
                          f"{world} ({world_keys}); change the sizes or the number of processes")
    expert = par.pp * par.ep  # experts are not tensor-parallel when ep > 1 (expert_tensor_parallel_size=1)
    if par.ep > 1 and world % expert:
        raise ConfigError(f"parallel.pp*ep = {par.pp}*{par.ep} = {expert} does not divide the world size "
                          f"{world} ({world_keys}); change the sizes or the number of processes")
    dp = world // dense
    gbs, mbs = cfg.algorithm.global_batch_size, par.micro_batch_size
    if gbs % (mbs * dp):
        raise ConfigError(f"algorithm.global_batch_size={gbs} is not divisible by parallel.micro_batch_size*dp = "
                          f"{mbs}*{dp}; make it a multiple of {mbs * dp}")
    if cfg.algorithm.name == "grpo" and cfg.algorithm.rollout_size % dp:
        raise ConfigError(f"algorithm.prompts_per_step*group_size = {cfg.algorithm.rollout_size} is not divisible by "
                          f"the data-parallel size {dp}; make it a multiple of {dp}")
    if cfg.data.task is None and cfg.data.train_path is None:
        raise ConfigError("data.train_path and data.task are both null; give a JSONL file or a synthetic task")
    seq = cfg.model.seq_length or shape.seq_length
    if seq > shape.max_position_embeddings:
        raise ConfigError(f"model.seq_length={seq} exceeds {shape.name}'s max_position_embeddings "
                          f"{shape.max_position_embeddings}")
    if par.cp > 1:
        raise ConfigError(f"parallel.cp={par.cp}: the trainers do not split sequences over context-parallel ranks "
                          "yet; set parallel.cp=1 (the planner still models cp for sizing)")
    if cfg.algorithm.name == "grpo" and (par.sequence_parallel or par.ep > 1):
        raise ConfigError("GRPO's colocated generation does not run with parallel.sequence_parallel=true or "
                          "parallel.ep > 1 yet; set them to false / 1")
    if shape.is_moe and par.tp > 1:
        raise ConfigError(f"{shape.name} is an MoE model: the trainers build MoE layers at parallel.tp=1 only so far "
                          "(use parallel.ep for the experts); conversion supports MoE at any tp")
    return dp
