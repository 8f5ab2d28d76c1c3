"""The rollout role of a split-placement job (``cluster.rollout_tasks``): the job's last processes run ``serve``
instead of a trainer, one generation session for the whole job (``megatron_rl.rollout.worker``'s ``OrderFeed``),
until the trainers stop.

    python launch.py --config configs/grpo_async_tiny.yaml      # 1 trainer + 1 rollout process on CPU

Test: ``.venv/bin/python -m pytest tests/test_async_grpo.py -q``
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.generation import generate
from megatron_rl.models.builder import build_model_chunks
from megatron_rl.rollout.channel import BRIDGE_BACKENDS, WORKER_WAIT_S, WeightBridge, WorkerChannel
from megatron_rl.rollout.multi_turn import Environments, WorkerEpisodes
from megatron_rl.rollout.placement import Placement
from megatron_rl.rollout.colocated import engine_config
from megatron_rl.rollout.worker import OrderFeed, TrainersStopped
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.spec.parallel import ParallelDims
from megatron_rl.trainers.common import job_model_options


def serve(cfg: JobConfig, shape: ModelShape, placement: Placement, *, dims: ParallelDims,
          resharded: bool = False) -> int:
    """Generate orders until the trainers stop; returns the exit code they gave. ``cfg``: the job's config as a
    worker runs it (parallel: ``rollout_parallel``), ``dims`` its sizes; ``resharded``: the trainers run another
    tp x pp (``reshards``)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    chunks = build_model_chunks(shape, job_model_options(cfg, shape, dims))
    for chunk in chunks:
        chunk.eval()
    weight_sync = cfg.algorithm.weight_sync
    bridge = None
    if weight_sync in BRIDGE_BACKENDS:
        bridge = WeightBridge.open(placement, backend=weight_sync, replicas=ps.get_data_parallel_world_size(),
                                   timeout_s=WORKER_WAIT_S)
    channel = WorkerChannel(placement.folder, placement.session, worker=f"rollout{placement.world.rank}",
                            weight_sync="resharded" if resharded else weight_sync, bridge=bridge)
    say = print if placement.world.rank == 0 else (lambda *_, **__: None)
    say(f"rollout worker: {placement.world.world_size} process(es) serving session {placement.session}", flush=True)
    config = engine_config(cfg.generation, tokenizer, vocab_size=shape.vocab_size)
    episodes = None
    if cfg.environment.name is not None:
        episodes = WorkerEpisodes(Environments(cfg.environment, hidden=[cfg.run.dir, cfg.checkpoint_dir]),
                                  ChatFormat.from_config(cfg.data, tokenizer), config, stop=cfg.generation.stop)
    feed = OrderFeed(channel, chunks, tokenizer=tokenizer, group=cfg.algorithm.group_size,
                     replica=ps.get_data_parallel_rank(), replicas=ps.get_data_parallel_world_size(),
                     sends=ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0,
                     episodes=episodes)
    try:
        with torch.no_grad():
            if episodes is None:
                generate(chunks, [], config, feed=feed)
            else:
                generate(chunks, [], episodes.config, feed=feed, settle_replies=episodes.settle)
    except TrainersStopped as stopped:
        # every rank stops at the same question; under PP a stage's last sends complete only while the others are
        # still there to take them, so none exits before all have left the session
        torch.distributed.barrier()
        say(f"rollout worker: {feed.orders} orders taken; the trainers stopped (exit code {stopped.code})", flush=True)
        return stopped.code
    finally:
        if episodes is not None:
            episodes.close()
    raise AssertionError("a fed generation session ends only through its feed")
