"""Rewards for GRPO: rule-based verifiers, a registry of reward fns by name or dotted path, weighted combination.

Reward fn signature (batched): `fn(prompts: list[str], completions: list[str], answers: list[Any]) -> list[float]`:
one finite float per completion; `answers` holds each prompt's reference answer (the dataset's answer field, any
JSON value), repeated for each completion of its group. Options from the config go to the reward's factory (see
`megatron_rl.rewards.registry`).

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
    MathVerifyReward,
    format_reward,
    math_answer_reward,
    math_verify_installed,
    math_verify_reward,
    overlong_penalty,
)

__all__ = [
    "ExactMatchReward",
    "FormatReward",
    "MathAnswerReward",
    "MathVerifyReward",
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
    "math_verify_installed",
    "math_verify_reward",
    "normalize_answer_text",
    "numbers_match",
    "overlong_penalty",
    "parse_number",
    "reference_answer_text",
    "register_reward",
    "registered_rewards",
    "score_completions",
]
