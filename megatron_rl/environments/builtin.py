r"""The built-in environments: arithmetic with a calculator tool, and math with a Python tool.

``calculator``: the prompt asks for a value the policy cannot work out by itself (a product of two numbers, say);
it may write ``<calc>EXPRESSION</calc>`` (the turn stops there), the environment replies with the value as a
``tool`` message, and the policy's next turn is its answer. Reward 1 when the answer's last number equals the
record's answer, else 0; info counts the tool calls.

``python_math``: a math problem; the policy may write ``<python>CODE</python>``, which runs in the sandbox (standard
library only) and whose output comes back as a ``tool`` message; the final ``\boxed{}`` answer is scored by
``math_verify`` (symbolic with math-verify installed).

Test: ``.venv/bin/python -m pytest tests/test_environments.py -q``
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from megatron_rl.environments.episode import Messages, StepResult
from megatron_rl.environments.sandbox import SandboxLimits
from megatron_rl.environments.tools import calculate, python_tool
from megatron_rl.rewards.extract import extract_last_number, numbers_match, parse_number, reference_answer_text
from megatron_rl.rewards.verifiers import math_verify_reward


class ToolEnv:
    """A task with one tool: a turn that ends in ``<tag>BODY</tag>`` calls it (at most ``max_calls`` times) and the
    result comes back as a ``tool`` message; any other turn is the final answer, scored by ``score``."""

    tag = ""

    def __init__(self, *, max_calls: int) -> None:
        if max_calls < 1:
            raise ValueError(f"{type(self).__name__} max_calls must be at least 1, got {max_calls}")
        self.max_calls = max_calls
        self.calls = 0
        self.answer: Any = None

    @property
    def stop(self) -> tuple[str, ...]:
        return (f"</{self.tag}>",)

    def reset(self, record: Mapping[str, Any]) -> Messages:
        self.calls = 0
        self.answer = record.get("answer")
        prompt = record["prompt"]
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def step(self, assistant_text: str) -> StepResult:
        match = re.search(rf"<{self.tag}>(.*)</{self.tag}>\s*$", assistant_text, flags=re.DOTALL)
        if match is not None and self.calls < self.max_calls:
            self.calls += 1
            return StepResult([{"role": "tool", "content": self.run_tool(match.group(1))}], 0.0, False,
                              {"tool_calls": self.calls})
        return StepResult(None, self.score(assistant_text), True, {"tool_calls": self.calls})

    def run_tool(self, body: str) -> str:
        raise NotImplementedError

    def score(self, text: str) -> float:
        raise NotImplementedError


class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator: ``<calc>12*34</calc>`` -> a tool message ``408``; then the answer, scored 1
    when its last number equals the record's answer."""

    def __init__(self, *, tag: str = "calc", max_calls: int = 2) -> None:
        if not re.fullmatch(r"[A-Za-z_]\w*", tag):
            raise ValueError(f"calculator tag {tag!r}: letters, digits and _ only")
        super().__init__(max_calls=max_calls)
        self.tag = tag

    def run_tool(self, body: str) -> str:
        return calculate(body)

    def score(self, text: str) -> float:
        reference = reference_answer_text(self.answer)
        expected = parse_number(reference)
        value = extract_last_number(text)
        if expected is None or value is None:
            return float(text.strip() == reference.strip())
        return float(numbers_match(value, expected))


class PythonMathEnv(ToolEnv):
    r"""Math with a Python tool: ``<python>print(2**10)</python>`` -> a tool message with the output; the final
    ``\boxed{}`` answer is scored by math_verify."""

    tag = "python"

    def __init__(self, *, max_calls: int = 4, wall_s: float = 10.0, cpu_s: int = 5, memory_mib: int = 1024,
                 output_chars: int = 1000) -> None:
        super().__init__(max_calls=max_calls)
        self.limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mib=memory_mib)
        self.output_chars = output_chars

    def run_tool(self, body: str) -> str:
        return python_tool(body, self.limits, max_chars=self.output_chars)

    def score(self, text: str) -> float:
        return math_verify_reward(text, self.answer)


BUILTIN_ENVIRONMENTS = {"calculator": CalculatorEnv, "python_math": PythonMathEnv}
