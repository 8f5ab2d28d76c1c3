"""A split-placement rollout worker (``cluster.rollout_tasks``): the job's last processes run this instead of a
trainer. It holds a copy of the policy at the training layout's tp x pp, or at parallel.rollout_tp x rollout_pp
(then each version arrives as a distributed checkpoint that Megatron reshards as it loads), cp = ep = 1,
data-parallel over the rollout processes, and loops: take the next order of prompts, load the newest weights the
trainers published, sample ``group_size`` completions per prompt, send them back tagged with the weights' version.

    python launch.py --config configs/grpo_async_tiny.yaml      # 1 trainer + 1 rollout process on CPU

It scores nothing (the trainers do, beside their reward models) and writes no checkpoint: what a resumed run
needs is the trainers' (``megatron_rl.rollout.buffer`` state). It exits with the code the trainers' stop file
gives (0, or REQUEUE_EXIT_CODE after a preemption, so the job is requeued whole); stop signals are the
trainers' to act on, so it ignores them and keeps serving until that file comes.

Test: ``.venv/bin/python -m pytest tests/test_async_grpo.py -q``
"""

from __future__ import annotations

import dataclasses
import time

import torch

from megatron_rl.rollout.buffer import Sample
from megatron_rl.rollout.channel import BRIDGE_DEVICES, WORKER_WAIT_S, WeightBridge, WorkerChannel
from megatron_rl.rollout.placement import Placement
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.model_shape import ModelShape


def rollout_config(cfg: JobConfig, shape: ModelShape) -> JobConfig:
    """The job config as a rollout worker runs it: tp x pp of parallel.rollout_tp / rollout_pp (default: the
    training layout's, with its pipeline split; another pp gets its own split), without context or expert
    parallelism; its data-parallel size is what the rollout processes allow."""
    from megatron_rl.spec.parallel import SPLIT_KEYS, ParallelDims

    par = cfg.parallel
    tp, pp = par.rollout_tp or par.tp, par.rollout_pp or par.pp
    parallel = dataclasses.replace(par, tp=tp, cp=1, ep=1, etp=None, sequence_parallel=par.sequence_parallel and tp > 1,
                                   rollout_tp=None, rollout_pp=None)
    if pp != par.pp:
        parallel = dataclasses.replace(parallel, pp=pp, vpp=None, **{key: None for key in SPLIT_KEYS[:2]},
                                       account_for_embedding=False, account_for_loss=False)
        dims = ParallelDims(world_size=tp * pp, tp=tp, pp=pp).with_split(shape.num_layers)
        parallel = dataclasses.replace(parallel, first_stage_layers=dims.first_stage_layers,
                                       last_stage_layers=dims.last_stage_layers)
    return dataclasses.replace(cfg, parallel=parallel)


def reshards(cfg: JobConfig) -> bool:
    """Whether the rollout replicas run at another tp x pp than the trainers (the weights then travel as a
    distributed checkpoint, which Megatron loads at any layout)."""
    par = cfg.parallel
    return (par.rollout_tp or par.tp, par.rollout_pp or par.pp) != (par.tp, par.pp)


def serve(cfg: JobConfig, shape: ModelShape, placement: Placement, *, resharded: bool = False) -> int:
    """Generate orders until the trainers stop; returns the exit code they gave. ``cfg``: the rollout_config;
    ``resharded``: the trainers run another tp x pp (``reshards`` of the job's config)."""
    from megatron_rl.data.prompts import PromptRecord
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.builder import build_model_chunks
    from megatron_rl.rollout.sampling import sample_rollout
    from megatron_rl.runtime.training import model_options

    tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    chunks = build_model_chunks(shape, model_options(cfg, shape))
    for chunk in chunks:
        chunk.eval()
    weight_sync = cfg.algorithm.weight_sync
    bridge = None
    if weight_sync in BRIDGE_DEVICES:
        from megatron.core import parallel_state as ps

        bridge = WeightBridge.open(placement, backend=weight_sync, replicas=ps.get_data_parallel_world_size(),
                                   timeout_s=WORKER_WAIT_S)
    channel = WorkerChannel(placement.folder, placement.session, worker=f"rollout{placement.world.rank}",
                            weight_sync="resharded" if resharded else weight_sync, bridge=bridge)
    timeout_s = WORKER_WAIT_S
    say = print if placement.world.rank == 0 else (lambda *_, **__: None)
    say(f"rollout worker: {placement.world.world_size} process(es) serving session {placement.session}", flush=True)
    orders = 0
    while True:
        order = channel.next_order(timeout_s=timeout_s)
        if isinstance(order, int):
            say(f"rollout worker: {orders} orders generated; the trainers stopped (exit code {order})", flush=True)
            return order
        version, sync = channel.load_newest(chunks, timeout_s=timeout_s)
        prompts = [PromptRecord(prompt=p["prompt"], answer=None, metadata={}, source=p["source"],
                                prompt_ids=None if p["prompt_ids"] is None else tuple(p["prompt_ids"]))
                   for p in order.prompts]
        began = time.perf_counter()
        with torch.no_grad():
            rollout = sample_rollout(chunks, prompts, cfg=cfg, shape=shape, tokenizer=tokenizer,
                                     group=cfg.algorithm.group_size, seed=order.seed, record_routes=False,
                                     seq_multiple=1)
        generate_s = time.perf_counter() - began
        group = cfg.algorithm.group_size
        samples = [Sample(prompt_id=prompt_id, version=version,
                          payload={"response_ids": rollout.response_ids[i * group:(i + 1) * group],
                                   "logprobs": rollout.logprobs[i * group:(i + 1) * group],
                                   "truncated": rollout.truncated[i * group:(i + 1) * group]})
                   for i, prompt_id in enumerate(order.prompt_ids)]
        channel.send(samples, {"generate_s": generate_s, "generated_tokens": float(sum(map(len, rollout.response_ids))),
                               "weight_load_s": sync["weight_sync_s"], "weight_load_bytes": sync["weight_sync_bytes"],
                               "orders": 1.0})
        orders += 1
