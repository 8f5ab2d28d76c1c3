"""Rewards for GRPO: rule-based verifiers, a registry of reward fns by name or dotted path, weighted combination.

Reward fn signature (batched): `fn(prompts: list[str], completions: list[str], answers: list[Any]) -> list[float]`.

Test: `.venv/bin/python -m pytest tests/test_rewards.py -q`
"""

from megatron_rl.rewards.extract import (
    extract_boxed,
    extract_last_number,
    extract_tag,
    normalize_answer_text,
    numbers_match,
    parse_number,
    reference_answer_text,
)
from megatron_rl.rewards.registry import (
    RewardFn,
    WeightedRewards,
    build_reward_fn,
    combine_rewards,
    load_reward_fn,
    register_reward,
    registered_rewards,
    score_completions,
)
from megatron_rl.rewards.verifiers import (
    ExactMatchReward,
    FormatReward,
    MathAnswerReward,
    format_reward,
    math_answer_reward,
    overlong_penalty,
)

__all__ = [
    "ExactMatchReward",
    "FormatReward",
    "MathAnswerReward",
    "RewardFn",
    "WeightedRewards",
    "build_reward_fn",
    "combine_rewards",
    "extract_boxed",
    "extract_last_number",
    "extract_tag",
    "format_reward",
    "load_reward_fn",
    "math_answer_reward",
    "normalize_answer_text",
    "numbers_match",
    "overlong_penalty",
    "parse_number",
    "reference_answer_text",
    "register_reward",
    "registered_rewards",
    "score_completions",
]
