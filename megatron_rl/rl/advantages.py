"""GRPO's advantage strategy: each completion's reward against its group's (``algorithms.advantages``), set when
the rollout is scored; no value model. PPO's is ``critic.Critic``; both answer the calls below."""

from __future__ import annotations

import contextlib
from typing import Callable

from megatron_rl.algorithms.policy_loss import GRPOLossConfig
from megatron_rl.models.reward_model import build_reward_model_chunks
from megatron_rl.rl.critic import Critic


class GroupAdvantages:
    """Group-relative advantages (GRPO, Dr. GRPO, DAPO, CISPO, distillation): nothing to add to the loop."""

    def policy_loss(self, config: GRPOLossConfig) -> GRPOLossConfig:
        """The policy loss's settings: the algorithm's."""
        return config

    def extra_state(self) -> dict:
        return {}

    def after_resume(self, extra: dict) -> None:
        """Nothing to start."""

    def generating(self) -> contextlib.AbstractContextManager:
        """No model of its own to park while the policy generates."""
        return contextlib.nullcontext()

    def training(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def add_rewards(self, rollout, minibatches: list) -> None:
        """The micro-batches carry their rows' advantages already (``collate_rollout``)."""

    def advantages(self, minibatches: list) -> dict[str, float]:
        """Set at scoring; no metrics of their own."""
        return {}

    def trains_policy(self, step: int) -> bool:
        return True

    def update(self, totals: dict[str, list[float]], epoch: int, batches: list) -> None:
        """No value model to step."""

    def step_metrics(self, train: dict) -> dict:
        return {}


def advantage_strategy(run, make_engine: Callable):
    """``run``'s strategy (``run``: an ``RLRun``): PPO's ``Critic``, whose engine ``make_engine(build_chunks=,
    lr=)`` builds at the policy's layout, or ``GroupAdvantages``."""
    if run.algo.name != "ppo":
        return GroupAdvantages()
    return Critic(run, make_engine(build_chunks=build_reward_model_chunks, lr=run.algo.critic_lr))
