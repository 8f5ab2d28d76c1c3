"""Tools that environments give the policy: a calculator, and Python run in the sandbox.

The calculator evaluates arithmetic from the expression's syntax tree, in this process: numbers, + - * / // % **,
unary signs and parentheses, with bounded operands, so nothing it is given can run code, hang or exhaust memory. It
needs no sandbox, and a sandbox's process start (tens of milliseconds) would cost more than the decode of the turn.
``python_tool`` runs code in ``sandbox.run_python`` and returns its short observation.

Test: ``.venv/bin/python -m pytest tests/test_environments.py -q``
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Optional, Sequence

from megatron_rl.environments.sandbox import SandboxLimits, run_python

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e100
MAX_EXPONENT = 256

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; its message is the observation."""


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or (abs(left) > 1 and
                                             abs(right) * math.log10(abs(left)) > math.log10(MAX_MAGNITUDE))):
            raise CalculatorError("error: number too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("error: division by zero") from None
        except (OverflowError, ValueError):
            raise CalculatorError("error: number too large") from None
        if isinstance(value, complex):
            raise CalculatorError("error: not a real number")
        if abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("error: number too large")
        return value
    raise CalculatorError("error: only numbers, + - * / // % ** and parentheses")


def format_number(value: float | int) -> str:
    """An integer-valued result without a decimal point; others to 10 significant digits."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("error: not a finite number")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text, or the error's message ("error: ...")."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        return "error: empty expression"
    if len(text) > MAX_EXPRESSION_CHARS:
        return f"error: longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return "error: not an arithmetic expression"
    try:
        return format_number(_evaluate(tree))
    except CalculatorError as error:
        return str(error)


def python_tool(code: str, limits: Optional[SandboxLimits] = None, *, hide: Sequence[str] = (),
                max_chars: int = 1000) -> str:
    """Run ``code`` in the sandbox; what it printed (its end, at most ``max_chars``), and why it stopped if not ok."""
    return run_python(code, limits or SandboxLimits(), hide=hide).observation(max_chars) or "(no output)"
