"""Scoring a rollout: each completion's reward (the job's reward functions, an environment's episode rewards,
DAPO's overlong penalty) and its group-relative advantage."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.algorithms.advantages import group_advantages
from megatron_rl.rewards import overlong_penalty
from megatron_rl.rewards.job import reward_totals
from megatron_rl.rewards.registry import WeightedRewards
from megatron_rl.spec.config.schema import AlgorithmConfig


class Scorer:
    """``rewards`` (None: the environment's alone) and, for an ``episodic`` run, each episode's environment reward;
    ``max_new_tokens`` bounds the overlong penalty."""

    def __init__(self, algorithm: AlgorithmConfig, rewards: Optional[WeightedRewards], *, episodic: bool,
                 max_new_tokens: int) -> None:
        self.algo, self.rewards, self.episodic, self.max_new_tokens = algorithm, rewards, episodic, max_new_tokens

    def totals(self, rollout) -> tuple[list[float], dict[str, list[float]]]:
        """``reward_totals`` of the run's rewards and environments."""
        return reward_totals(rollout, rewards=self.rewards, episodic=self.episodic)

    def score(self, rollout) -> None:
        """Rewards (plus DAPO's overlong penalty when algorithm.overlong is set) and group advantages."""
        total, per_fn = self.totals(rollout)
        overlong = self.algo.overlong
        if overlong is not None:
            per_fn["overlong"] = overlong_penalty([len(r) for r in rollout.response_ids],
                                                  max_len=self.max_new_tokens,
                                                  buffer_len=overlong.buffer, penalty_factor=overlong.penalty)
            total = [t + p for t, p in zip(total, per_fn["overlong"])]
        rollout.rewards = torch.tensor(total, dtype=torch.float32)
        rollout.per_fn = per_fn
        rollout.advantages = group_advantages(rollout.rewards, self.algo.group_size,
                                              normalize_std=self.algo.advantage == "std")
