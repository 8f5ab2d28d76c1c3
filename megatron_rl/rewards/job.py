"""A job's rewards: the reward functions of ``algorithm.rewards`` (``rm``: the trained reward model) and each
completion's total with an environment's episode rewards. The RL trainer and the evaluation trainer score with
these."""

from __future__ import annotations

from typing import Optional

from megatron_rl.rewards.registry import WeightedRewards, build_reward_fn
from megatron_rl.spec.config.schema import AlgorithmConfig, EnvironmentConfig, ModelConfig, ParallelConfig, RuntimeConfig
from megatron_rl.spec.errors import ConfigError


def job_rewards(algorithm: AlgorithmConfig, environment: EnvironmentConfig, *, model: ModelConfig,
                parallel: ParallelConfig, runtime: RuntimeConfig) -> Optional[WeightedRewards]:
    """``build_rewards``, or None for an environment's job without algorithm.rewards (its episodes' rewards are
    the environment's)."""
    if environment.name is not None and not algorithm.rewards:
        return None
    return build_rewards(algorithm, model=model, parallel=parallel, runtime=runtime)


def build_rewards(algorithm: AlgorithmConfig, *, model: ModelConfig, parallel: ParallelConfig,
                  runtime: RuntimeConfig) -> WeightedRewards:
    """WeightedRewards from algorithm.rewards ({name or dotted path: weight or {weight, options}}); `rm` is the
    trained reward model, run at the job's dtype, micro-batches and kernels."""
    fns, weights = {}, {}
    for name, weight in algorithm.reward_weights.items():
        if name == "rm":
            if not algorithm.reward_model:
                raise ConfigError("algorithm.rewards has `rm` but algorithm.reward_model is not set; give the RM "
                                  "checkpoint folder")
            from megatron_rl.models.builder import resolve_transformer_engine
            from megatron_rl.rewards.reward_model_scorer import RewardModelScorer

            fns[name] = RewardModelScorer(algorithm.reward_model, dtype=model.dtype,
                                          micro_batch_size=parallel.micro_batch_size,
                                          micro_batch_tokens=parallel.micro_batch_tokens,
                                          sequence_parallel=parallel.sequence_parallel,
                                          transformer_engine=resolve_transformer_engine(runtime.transformer_engine),
                                          attention=runtime.attention)
        else:
            fns[name] = build_reward_fn(name, algorithm.reward_options[name])
        weights[name] = float(weight)
    return WeightedRewards(fns=fns, weights=weights)


def reward_totals(rollout, *, rewards: Optional[WeightedRewards],
                  episodic: bool) -> tuple[list[float], dict[str, list[float]]]:
    """Each completion's reward and each function's share: ``rewards`` (algorithm.rewards, of an episode's last
    turn; None: none), plus, for ``episodic`` rollouts, each episode's reward from its environment."""
    total, per_fn = [0.0] * len(rollout.completions), {}
    if rewards is not None:
        total, per_fn = rewards.score(rollout.prompts, rollout.completions, rollout.answers)
    if episodic:
        per_fn["environment"] = list(rollout.env_rewards)
        total = [t + e for t, e in zip(total, rollout.env_rewards)]
    return total, per_fn
