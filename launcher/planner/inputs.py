"""A job config's settings as the planner's inputs: the runtime (``runtime:`` section, parallel.distributed_optimizer)
and the rollout sizing of the RL trainers. Used by ``launcher.job.plan_job``; reads the config, imports no torch.

Check it: ``.venv/bin/python -m pytest tests/test_planner_memory_modes.py -q``.
"""

from __future__ import annotations

from typing import Any

from launcher.planner.costs import GrpoSizing, Runtime, SplitPlacement
from megatron_rl.spec.errors import ConfigError

RL_ALGORITHMS = ("grpo", "ppo", "eval")
"""algorithm.name values that generate rollouts (plan with a GrpoSizing)."""


def runtime_of(cfg: Any, shape: Any = None) -> Runtime:
    """The Runtime a job runs with: Transformer Engine where the config says (auto: on GPU jobs, off on CPU ones),
    its attention kernel (auto as RuntimeConfig.attention_kernel resolves it), TP overlap, DP overlap, gradient dtype,
    the distributed optimizer, collectives over TCP for parallel.backend=gloo on GPUs, and with model.lora (given the
    ``shape``) the adapters' share of the parameters. A CPU job (gloo too) is planned as the GPU type it names, nccl."""
    rt = cfg.runtime
    te = rt.uses_transformer_engine(gpus=cfg.cluster.has_gpus)
    attention = rt.attention_kernel
    lora = getattr(cfg.model, "lora", None)
    return Runtime(transformer_engine=te, flash_attention=attention == "flash", tp_comm_overlap=rt.tp_comm_overlap,
                   overlap_grad_reduce=rt.overlap_grad_reduce, distributed_optimizer=cfg.parallel.distributed_optimizer,
                   main_grad_bytes=2 if rt.grad_dtype == "bf16" else 4,
                   comm_backend="gloo" if cfg.parallel.backend == "gloo" and cfg.cluster.has_gpus else "nccl",
                   trainable_fraction=lora_trainable_fraction(shape, lora) if lora and shape is not None else 1.0)


def lora_trainable_fraction(shape: Any, lora: Any) -> float:
    """Trainable parameters over all parameters (frozen base plus adapters) for model.lora on ``shape``: rank x
    (in + out) per adapted linear, as megatron_rl/models/lora.py builds them (every routed expert's and the shared
    expert's fc1 and fc2 when named; MLA's query and key/value projections by their own names), plus the
    modules_to_save (vocab x hidden per untied embedding or output layer, once when tied; hidden for the final
    norm)."""
    h, d, r = shape.hidden_size, shape.kv_channels, lora.rank
    n, g, f = shape.num_attention_heads, shape.num_query_groups, shape.ffn_hidden_size
    attention = {"linear_qkv": 0 if shape.is_mla else h + (n + 2 * g) * d, "linear_proj": n * d + h}
    if shape.is_mla:
        q, kv, rope = shape.q_lora_rank, shape.kv_lora_rank, shape.qk_rope_head_dim
        q_heads = n * (shape.qk_nope_head_dim + rope)
        attention.update({"linear_q_proj": 0 if q else h + q_heads, "linear_q_down_proj": h + q if q else 0,
                          "linear_q_up_proj": q + q_heads if q else 0, "linear_kv_down_proj": h + kv + rope,
                          "linear_kv_up_proj": kv + n * (shape.qk_nope_head_dim + shape.v_head_dim)})
    gate = 2 if shape.gated_linear_unit else 1
    mlp = {"linear_fc1": h + f * gate, "linear_fc2": f + h}
    per_dense = sum(v for k, v in {**attention, **mlp}.items() if k in lora.targets)
    e, s = shape.moe_ffn_hidden_size or 0, shape.moe_shared_expert_intermediate_size or 0
    experts = {"experts.linear_fc1": shape.num_experts * (h + e * gate), "experts.linear_fc2": shape.num_experts * (e + h),
               "shared_experts.linear_fc1": (h + s * gate) if s else 0, "shared_experts.linear_fc2": (s + h) if s else 0}
    per_moe = sum(v for k, v in {**attention, **experts}.items() if k in lora.targets)
    adapters = r * (shape.num_dense_layers * per_dense + shape.num_moe_layers * per_moe)
    saved = set(getattr(lora, "modules_to_save", None) or ())  # trained in full beside the adapters
    vocab = shape.vocab_size * h
    full = (vocab if saved & {"embedding", "output_layer"} else 0) if shape.tie_embeddings else \
        vocab * len(saved & {"embedding", "output_layer"})
    full += h if "final_layernorm" in saved else 0
    return (adapters + full) / (shape.num_params() + adapters)


def split_placement(cfg: Any) -> SplitPlacement | None:
    """The job's split placement (cluster.rollout_tasks > 0, algorithm.max_staleness and weight_sync), or None when
    generation is colocated."""
    rollout_tasks = cfg.cluster.rollout_tasks
    if not rollout_tasks:
        return None
    return SplitPlacement(rollout_gpus=rollout_tasks, max_staleness=cfg.algorithm.max_staleness,
                          weight_sync=cfg.algorithm.weight_sync, rollout_tp=cfg.parallel.rollout_tp,
                          rollout_pp=cfg.parallel.rollout_pp)


def recomputes_old_logprobs(cfg: Any, shape: Any, runtime: Runtime) -> bool:
    """algorithm.recompute_old_logprobs with auto resolved as the GRPO trainer does (wants_recomputed_old_logprobs):
    on for bf16/fp16 parameters (model.dtype auto is bf16 on GPUs), Transformer Engine or an MoE model."""
    setting = cfg.algorithm.recompute_old_logprobs
    if setting != "auto":
        return bool(setting)
    dtype = cfg.model.dtype
    low_precision = dtype in ("bf16", "fp16") or (dtype == "auto" and cfg.cluster.gpus_per_node > 0)
    return low_precision or runtime.transformer_engine or shape.is_moe


def teacher_sizing(teacher: Any, student: Any) -> dict:
    """GrpoSizing's teacher fields of ``algorithm.teacher``: its parameters from its run's model (the config.yaml
    beside its checkpoint), or the student's where that is not on this machine (a cluster path, an import)."""
    if teacher is None:
        return {}
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.spec.run_files import run_config_of_checkpoint

    params = float(student.num_params())
    found = run_config_of_checkpoint(teacher.checkpoint)
    if found is not None:
        try:
            params = float(load_model_shape(load_config(str(found), []).model.name).num_params())
        except ConfigError:
            pass
    return {"teacher_params": params, "teacher_offloaded": teacher.offload}


def rollout_sizing(cfg: Any, shape: Any, runtime: Runtime, *, mean_response_length: int | None = None) -> GrpoSizing:
    """The GrpoSizing of an RL job: rollout size, response length (generation.max_new_tokens) and mean length
    (``mean_response_length``, else generation.mean_new_tokens), an environment's turns and reply tokens, group size, the engine's KV pool
    (generation.kv_memory_gib, kv_block_tokens, max_concurrent; picked by the planner on GPU jobs when null),
    reference model (kl_coef > 0), old log-prob recompute, epochs, colocated reward model,
    KV cache released for training and optimizer offload (generation.offload_optimizer; never with rollout tasks, where
    the trainer does not generate)."""
    algo, gen = cfg.algorithm, cfg.generation
    if mean_response_length is not None and not 1 <= mean_response_length <= gen.max_new_tokens:
        raise ConfigError(f"--mean-response-len {mean_response_length}: give a length from 1 to the longest response "
                          f"(generation.max_new_tokens={gen.max_new_tokens})")
    mean = mean_response_length if mean_response_length is not None else gen.mean_new_tokens
    env = cfg.environment
    engine = dict(max_response_length=gen.max_new_tokens, mean_response_length=mean,
                  generation_concurrency=gen.max_concurrent, kv_memory_gib=gen.kv_memory_gib,
                  kv_block_tokens=gen.kv_block_tokens, plans_kv_memory=cfg.cluster.has_gpus,
                  cuda_graphs=gen.cuda_graphs,
                  **(dict(turns=env.max_turns, reply_tokens=env.mean_reply_tokens, env_step_s=env.mean_step_s,
                          env_concurrent_steps=max(1, env.concurrent_steps))
                     if env.name is not None else {}))
    if algo.name == "eval":  # held-out batches of prompts_per_step prompts x eval.samples, no reference or training
        return GrpoSizing(rollout_batch_size=algo.prompts_per_step * cfg.eval.samples,
                          samples_per_prompt=cfg.eval.samples, reference_model=False, recompute_old_logprobs=False,
                          epochs=1, reward_model=False, **engine)
    return GrpoSizing(rollout_batch_size=algo.rollout_size, samples_per_prompt=algo.group_size, **engine,
                      reference_model=algo.kl_coef > 0 and getattr(cfg.model, "lora", None) is None,  # LoRA: the base
                      recompute_old_logprobs=recomputes_old_logprobs(cfg, shape, runtime), epochs=algo.epochs,
                      reward_model=bool(algo.reward_model), kv_cache_released_for_training=True,
                      **teacher_sizing(algo.teacher, shape),
                      optimizer_offloaded_for_generation=gen.offload_optimizer and not cfg.cluster.rollout_tasks,
                      micro_batch_tokens=cfg.parallel.micro_batch_tokens)
