r"""Rule-based verifiers: math answer match, format checks, exact match, DAPO overlong shaping.

Per-sample functions (`math_answer_reward`, `math_verify_reward`, `format_reward`) score one completion; the
classes wrap them in the batched reward-function signature `fn(prompts, completions, answers) -> list[float]`.

Math answers have two checkers behind one interface (`MathVerifyReward`, registry name "math_verify"): Hugging
Face's math-verify (`pip install 'megatron-rl[math]'`: symbolic equality, so "(x+1)^2" equals "x^2+2x+1") when
it is installed, else the built-in one (`math_answer_reward`: exact text or numeric equality).

Test: `.venv/bin/python -m pytest tests/test_rewards.py -q`
"""

from __future__ import annotations

import cmath
import re
from collections.abc import Sequence
from typing import Any

from megatron_rl.rewards.extract import (
    MATH_TOLERANCE,
    ascii_numerals,
    extract_boxed,
    extract_last_number,
    extract_tag,
    normalize_answer_text,
    numbers_match,
    parse_number,
    reference_answer_text,
)
from megatron_rl.spec.errors import ConfigError


def _reference_number(answer: Any, reference_text: str) -> float | None:
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return float(answer)
    return parse_number(reference_text)


def _candidate_matches(candidate: str, reference_text: str, reference_number: float | None,
                       tolerance: float) -> bool:
    if normalize_answer_text(candidate) == normalize_answer_text(reference_text):
        return True
    if reference_number is None:
        return False
    value = parse_number(candidate)
    if value is None:
        value = extract_last_number(candidate)
    return value is not None and numbers_match(value, reference_number, tolerance)


def _final_answer(completion: str) -> str | None:
    candidate = extract_boxed(completion)
    return candidate if candidate is not None else extract_tag(completion, "answer")


def math_answer_reward(completion: str, answer: Any, *, tolerance: float = MATH_TOLERANCE) -> float:
    r"""1.0 when the completion's final answer equals the reference, else 0.0.

    The final answer is the last `\boxed{}`; without one, the last `<answer>...</answer>`; without either, the
    last number in the completion (numeric references) or the whole completion (non-numeric references).
    Equal means equal after `normalize_answer_text`, or numerically equal within the relative `tolerance`
    (1,234 == 1234.0, 3/4 == 0.75). The reference may be a number, a string, a GSM8K "... #### 72" solution or
    a `\boxed{}` string. Arabic-script numerals count as the same numbers ("٣٫٥" == 3.5).
    """
    completion = ascii_numerals(completion)
    reference_text = reference_answer_text(answer)
    reference_number = _reference_number(answer, reference_text)
    candidate = _final_answer(completion)
    if candidate is not None:
        return 1.0 if _candidate_matches(candidate, reference_text, reference_number, tolerance) else 0.0
    if reference_number is not None:
        value = extract_last_number(completion)
        return 1.0 if value is not None and numbers_match(value, reference_number, tolerance) else 0.0
    return 1.0 if normalize_answer_text(completion) == normalize_answer_text(reference_text) else 0.0


def math_verify_reward(completion: str, answer: Any, *, tolerance: float = MATH_TOLERANCE) -> float:
    r"""`math_answer_reward` with math-verify's equivalence (needs the math-verify package).

    The final answer is found as in `math_answer_reward`; without a box or an answer tag, math-verify extracts
    it from the completion. Equal means equal after `normalize_answer_text`; else two numbers must agree within
    the relative `tolerance`, and other expressions (sets, equations, symbolic forms) must be equal for
    `math_verify.verify`.
    """
    import math_verify

    completion = ascii_numerals(completion)
    reference_text = reference_answer_text(answer)
    candidate = _final_answer(completion)
    final = completion if candidate is None else candidate
    if normalize_answer_text(final) == normalize_answer_text(reference_text):
        return 1.0
    gold = math_verify.parse(f"${reference_text}$")
    predicted = math_verify.parse(completion if candidate is None else f"${candidate}$")
    if not gold or not predicted:
        return 0.0
    if getattr(gold[0], "is_number", False) and getattr(predicted[0], "is_number", False):
        try:
            return 1.0 if cmath.isclose(complex(gold[0]), complex(predicted[0]), rel_tol=tolerance,
                                        abs_tol=1e-12) else 0.0
        except TypeError:  # a number sympy cannot evaluate (zoo, nan): leave it to verify
            pass
    return 1.0 if math_verify.verify(gold, predicted) else 0.0


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

    pattern: a regex the whole stripped completion must match (re.fullmatch; DOTALL for a string), e.g.
    r"<think>.*?</think>\s*<answer>.*?</answer>". required_tags: each `<tag>...</tag>` appears exactly once,
    in the given order. Both may be given (both must hold). With neither, the completion must hold a `\boxed{}`.
    """
    if pattern is None and not required_tags:
        return 1.0 if extract_boxed(completion) is not None else 0.0
    if isinstance(pattern, str):
        pattern = re.compile(pattern, flags=re.DOTALL)
    if pattern is not None and pattern.fullmatch(completion.strip()) is None:
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


def _check_tolerance(name: str, tolerance: float) -> None:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ConfigError(f"reward {name!r}: tolerance={tolerance!r} must be a relative tolerance in [0, 1), "
                          "e.g. 1e-6")


class MathAnswerReward:
    """Batched `math_answer_reward` (registry name "math")."""

    def __init__(self, *, tolerance: float = MATH_TOLERANCE) -> None:
        _check_tolerance("math", tolerance)
        self.tolerance = tolerance

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> list[float]:
        _check_batch(prompts, completions, answers)
        return [math_answer_reward(completion, answer, tolerance=self.tolerance)
                for completion, answer in zip(completions, answers)]


MATH_BACKENDS = ("auto", "math_verify", "builtin")


def math_verify_installed() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


class MathVerifyReward:
    """Batched math answer check (registry name "math_verify"): `math_verify_reward` when math-verify is
    installed, `math_answer_reward` otherwise. backend: auto, math_verify (fail without the package) or
    builtin (never use it); `self.backend` says which one scores."""

    def __init__(self, *, tolerance: float = MATH_TOLERANCE, backend: str = "auto") -> None:
        _check_tolerance("math_verify", tolerance)
        if backend not in MATH_BACKENDS:
            raise ConfigError(f"reward 'math_verify': backend={backend!r} is not one of {', '.join(MATH_BACKENDS)}")
        installed = backend != "builtin" and math_verify_installed()
        if backend == "math_verify" and not installed:
            raise ConfigError("reward 'math_verify': backend=math_verify needs the math-verify package: "
                              "pip install 'megatron-rl[math]' (or backend=auto to fall back to the built-in one)")
        self.backend = "math_verify" if installed else "builtin"
        self.tolerance = tolerance
        self._score = math_verify_reward if installed else math_answer_reward

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> list[float]:
        _check_batch(prompts, completions, answers)
        return [self._score(completion, answer, tolerance=self.tolerance)
                for completion, answer in zip(completions, answers)]


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
