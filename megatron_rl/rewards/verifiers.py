r"""Rule-based verifiers: math answer match, format checks, exact match, DAPO overlong shaping.

Per-sample functions (`math_answer_reward`, `format_reward`) score one completion; the classes wrap them in
the batched reward-function signature `fn(prompts, completions, answers) -> list[float]`.

Test: `.venv/bin/python -m pytest tests/test_rewards.py -q`
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from launcher.errors import ConfigError
from megatron_rl.rewards.extract import (
    extract_boxed,
    extract_last_number,
    extract_tag,
    normalize_answer_text,
    numbers_match,
    parse_number,
    reference_answer_text,
)


def _reference_number(answer: Any, reference_text: str) -> float | None:
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return float(answer)
    return parse_number(reference_text)


def _candidate_matches(candidate: str, reference_text: str, reference_number: float | None) -> bool:
    if normalize_answer_text(candidate) == normalize_answer_text(reference_text):
        return True
    if reference_number is None:
        return False
    value = parse_number(candidate)
    if value is None:
        value = extract_last_number(candidate)
    return value is not None and numbers_match(value, reference_number)


def math_answer_reward(completion: str, answer: Any) -> float:
    r"""1.0 when the completion's final answer equals the reference, else 0.0.

    The final answer is the last `\boxed{}`; without one, the last `<answer>...</answer>`; without either, the
    last number in the completion (numeric references) or the whole completion (non-numeric references).
    Equal means equal after `normalize_answer_text`, or numerically equal (1,234 == 1234.0, 3/4 == 0.75).
    The reference may be a number, a string, a GSM8K "... #### 72" solution or a `\boxed{}` string.
    """
    reference_text = reference_answer_text(answer)
    reference_number = _reference_number(answer, reference_text)
    candidate = extract_boxed(completion)
    if candidate is None:
        candidate = extract_tag(completion, "answer")
    if candidate is not None:
        return 1.0 if _candidate_matches(candidate, reference_text, reference_number) else 0.0
    if reference_number is not None:
        value = extract_last_number(completion)
        return 1.0 if value is not None and numbers_match(value, reference_number) else 0.0
    return 1.0 if normalize_answer_text(completion) == normalize_answer_text(reference_text) else 0.0


def _tags_in_order(completion: str, tags: Sequence[str]) -> bool:
    position = 0
    for tag in tags:
        opening, closing = f"<{tag}>", f"</{tag}>"
        if completion.count(opening) != 1 or completion.count(closing) != 1:
            return False
        start = completion.find(opening)
        end = completion.find(closing)
        if start < position or end < start:
            return False
        position = end + len(closing)
    return True


def format_reward(
    completion: str,
    *,
    pattern: str | re.Pattern[str] | None = None,
    required_tags: Sequence[str] | None = None,
) -> float:
    r"""1.0 when the completion has the required shape, else 0.0.

    pattern: a regex the whole stripped completion must match (re.fullmatch, DOTALL), e.g.
    r"<think>.*?</think>\s*<answer>.*?</answer>". required_tags: each `<tag>...</tag>` appears exactly once,
    in the given order. Both may be given (both must hold). With neither, the completion must hold a `\boxed{}`.
    """
    if pattern is None and not required_tags:
        return 1.0 if extract_boxed(completion) is not None else 0.0
    if pattern is not None and re.fullmatch(pattern, completion.strip(), flags=re.DOTALL) is None:
        return 0.0
    if required_tags and not _tags_in_order(completion, required_tags):
        return 0.0
    return 1.0


def _check_batch(prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> None:
    if not len(prompts) == len(completions) == len(answers):
        raise ValueError(
            f"reward batch lengths differ: {len(prompts)} prompts, {len(completions)} completions, "
            f"{len(answers)} answers"
        )


class MathAnswerReward:
    """Batched `math_answer_reward` (registry name "math")."""

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> list[float]:
        _check_batch(prompts, completions, answers)
        return [math_answer_reward(completion, answer) for completion, answer in zip(completions, answers)]


class FormatReward:
    """Batched `format_reward` with a fixed pattern / tag list (registry name "format")."""

    def __init__(self, *, pattern: str | None = None, required_tags: Sequence[str] | None = None) -> None:
        try:
            self.pattern = re.compile(pattern, flags=re.DOTALL) if pattern is not None else None
        except re.error as error:
            raise ConfigError(f"reward 'format': options.pattern {pattern!r} is not a valid regex ({error})") from None
        if isinstance(required_tags, str):
            required_tags = [required_tags]
        self.required_tags = tuple(required_tags or ())

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> list[float]:
        _check_batch(prompts, completions, answers)
        return [
            format_reward(completion, pattern=self.pattern, required_tags=self.required_tags)
            for completion in completions
        ]


class ExactMatchReward:
    """1.0 when the stripped completion equals the stripped reference answer (registry name "exact")."""

    def __init__(self, *, case_sensitive: bool = True) -> None:
        self.case_sensitive = case_sensitive

    def _canon(self, text: Any) -> str:
        text = str(text).strip()
        return text if self.case_sensitive else text.lower()

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> list[float]:
        _check_batch(prompts, completions, answers)
        return [1.0 if self._canon(c) == self._canon(a) else 0.0 for c, a in zip(completions, answers)]


def overlong_penalty(
    response_lengths: Sequence[int], *, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> list[float]:
    """DAPO soft overlong punishment per response, in [-penalty_factor, 0], to add to the reward.

    0 up to max_len - buffer_len tokens, then falling linearly to -penalty_factor at max_len; -penalty_factor beyond.
    """
    if not 0 < buffer_len <= max_len:
        raise ConfigError(f"overlong shaping: buffer_len={buffer_len} must be in (0, max_len={max_len}]")
    start = max_len - buffer_len
    penalties = []
    for length in response_lengths:
        if length <= start:
            penalties.append(0.0)
        elif length <= max_len:
            penalties.append((start - length) / buffer_len * penalty_factor)
        else:
            penalties.append(-penalty_factor)
    return penalties
