"""Completions sampled from the policy's own weights, in the training processes: plain completions
(``rollout.colocated.sample_rollout``) or, with an environment, episodes (``rollout.multi_turn``). The colocated
source samples its steps with it, and every run its evaluations."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

from megatron_rl.data.chat import ChatFormat
from megatron_rl.rollout.batch import Rollout
from megatron_rl.rollout.multi_turn import Environments
from megatron_rl.rollout.colocated import engine_config, sample_rollout
from megatron_rl.runtime.phases import generation_phase
from megatron_rl.runtime.training import Engine
from megatron_rl.spec.config.schema import GenerationConfig


class PolicyRollouts:
    """Rollouts of ``engine``'s policy with the ``generation`` section's settings, ``chat``'s prompt format and
    ``environments`` (None: plain completions). ``parked``: what else to park while generating (PPO's critic)."""

    def __init__(self, engine: Engine, generation: GenerationConfig, *, tokenizer, vocab_size: int,
                 chat: ChatFormat, environments: Optional[Environments],
                 parked: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        self.engine, self.generation, self.tokenizer, self.chat = engine, generation, tokenizer, chat
        self.environments, self.parked = environments, parked
        self.config = engine_config(generation, tokenizer, vocab_size=vocab_size)
        """The engine settings of every rollout (``record_routes`` set per call)."""

    def __call__(self, prompts: list, *, group: int, seed: int, record_routes: bool, stop_requested=None,
                 step: Optional[int] = None, draw: int = 0) -> Rollout:
        """``group`` completions per prompt; each rollout worker (data-parallel x context-parallel rank) samples its
        share, then all see all. ``record_routes``: keep the experts each token was routed to, for the training
        forwards to replay. ``stop_requested``: see ``sample_rollout``. ``step``, ``draw``: a training rollout
        with environments, whose episode journal it keeps."""
        config = dataclasses.replace(self.config, record_routes=record_routes)
        options = dict(group=group, seed=seed, seq_multiple=self.engine.sequence_multiple,
                       stop_requested=stop_requested)
        with self.parked(), generation_phase(self.engine, offload_optimizer=self.generation.offload_optimizer):
            if self.environments is not None:
                return self.environments.sample(self.engine.chunks, prompts, config=config, chat=self.chat,
                                                stop=self.generation.stop, step=step, draw=draw, **options)
            return sample_rollout(self.engine.chunks, prompts, config=config, tokenizer=self.tokenizer, **options)
