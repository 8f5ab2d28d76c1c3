"""A calculator environment that writes a line to a ledger file at every reset and step: the side effects the
episode journal must not repeat when a run resumes between turns (tests/test_multi_turn.py). Named in a config as
``environment.name=counting_env:CountingCalculator`` with ``tests/`` on PYTHONPATH."""

from __future__ import annotations

import json

from megatron_rl.environments import CalculatorEnv


class CountingCalculator(CalculatorEnv):
    def __init__(self, *, ledger: str, tag: str = "calc", max_calls: int = 2) -> None:
        super().__init__(tag=tag, max_calls=max_calls)
        self.ledger = ledger

    def reset(self, record):
        self._write("reset", record["prompt"])
        return super().reset(record)

    def step(self, assistant_text):
        self._write("step", assistant_text)
        return super().step(assistant_text)

    def _write(self, kind: str, text) -> None:
        with open(self.ledger, "a", encoding="utf-8") as ledger:
            ledger.write(json.dumps([kind, text, self.calls]) + "\n")
