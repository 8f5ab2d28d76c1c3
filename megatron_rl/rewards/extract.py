r"""Answer extraction for rule-based verifiers: `\boxed{}` contents, `<answer>` tags, numbers in text.

Numbers: optional minus sign, thousands commas ("1,234"), decimals ("2.5", ".5"), fractions ("3/4", "\frac{3}{4}").
Arabic-script numerals read as the same numbers (`ascii_numerals`): Arabic-Indic (٠-٩) and Extended Arabic-Indic
(۰-۹) digits, the Arabic decimal (٫) and thousands (٬) separators, with bidirectional marks dropped.
Values are returned as float; comparisons use `numbers_match` (relative 1e-9 by default), so "0.75", "3/4" and
"\frac{3}{4}" agree, while "0.3333" and "1/3" do not.

Test: `.venv/bin/python -m pytest tests/test_rewards.py -q`
"""

from __future__ import annotations

import math
import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ASCII_NUMERALS = str.maketrans({
    **{chr(0x0660 + d): str(d) for d in range(10)},  # Arabic-Indic digits
    **{chr(0x06F0 + d): str(d) for d in range(10)},  # Extended Arabic-Indic (Persian, Urdu) digits
    "\u066b": ".", "\u066c": ",",  # Arabic decimal and thousands separators
    "\u200e": None, "\u200f": None, "\u061c": None,  # left-to-right, right-to-left and Arabic letter marks
})
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
# A number must not continue a word or another number ("x2", "1.2.3"); a minus right after a digit is an operator.
_NUMBER_RE = re.compile(rf"(?<![\w.])(?P<sign>-)?(?P<num>{_UNSIGNED})(?:/(?P<den>{_UNSIGNED}))?")
_FRAC_RE = re.compile(r"^(?P<sign>-)?\\[dt]?frac\{(?P<num>[^{}]+)\}\{(?P<den>[^{}]+)\}$")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def ascii_numerals(text: str) -> str:
    """text with Arabic-script numerals written in ASCII: "٣٫٥" -> "3.5", "١٬٢٣٤" -> "1,234", "۴۲" -> "42"."""
    return text.translate(_ASCII_NUMERALS)


def _scan_braced(text: str, open_index: int) -> str | None:
    """Contents of the brace group opening at text[open_index] == '{', or None when unbalanced."""
    depth = 0
    for index in range(open_index, len(text)):
        char = text[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : index]
    return None


def extract_boxed(text: str) -> str | None:
    r"""Contents of the last complete `\boxed{...}` (or `\fbox{...}`, or `\boxed 5`) in text, nested braces kept.

    Returns None when there is none; an unbalanced (truncated) last box falls back to an earlier complete one.
    """
    starts = sorted(
        (match.start(), match.end()) for cmd in _BOX_COMMANDS for match in re.finditer(re.escape(cmd), text)
    )
    for _, end in reversed(starts):
        rest = text[end:]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            content = _scan_braced(text, end + (len(rest) - len(stripped)))
            if content is not None:
                return content.strip()
        elif rest[:1] == " ":
            token = re.match(r"\s*([^\s$]+)", rest)
            if token:
                return token.group(1)
    return None


def extract_tag(text: str, tag: str) -> str | None:
    """Contents of the last `<tag>...</tag>` pair in text, or None."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def _to_float(unsigned: str) -> float:
    return float(unsigned.replace(",", ""))


def _match_value(match: re.Match[str]) -> float | None:
    value = _to_float(match.group("num"))
    if match.group("den") is not None:
        denominator = _to_float(match.group("den"))
        if denominator == 0:
            return None
        value /= denominator
    return -value if match.group("sign") else value


def extract_last_number(text: str) -> float | None:
    """The last number written in text ("-1,234.5", "3/4" -> 0.75), or None when there is none."""
    for match in reversed(list(_NUMBER_RE.finditer(text))):
        value = _match_value(match)
        if value is not None:
            return value
    return None


def _strip_latex(text: str) -> str:
    text = _TEXT_RE.sub(r"\1", text)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$"):
        text = text.replace(token, "")
    return text.strip()


def parse_number(text: str) -> float | None:
    r"""text as a whole read as a number ("1,234", "-3/4", "\frac{1}{2}", "$5$", "12."), or None if it is not one."""
    cleaned = _strip_latex(text).replace(" ", "").rstrip(".")
    frac = _FRAC_RE.match(cleaned)
    if frac:
        numerator, denominator = parse_number(frac.group("num")), parse_number(frac.group("den"))
        if numerator is None or not denominator:
            return None
        value = numerator / denominator
        return -value if frac.group("sign") else value
    match = _NUMBER_RE.fullmatch(cleaned)
    return _match_value(match) if match else None


def normalize_answer_text(text: str) -> str:
    """Canonical form for exact string comparison: LaTeX wrappers and spaces removed, lower case, no final '.'."""
    return re.sub(r"\s+", "", _strip_latex(text)).rstrip(".").lower()


MATH_TOLERANCE = 1e-9
"""Default relative tolerance of numeric answer comparisons (the `tolerance` option of the math rewards)."""


def numbers_match(a: float, b: float, rel_tol: float = MATH_TOLERANCE) -> bool:
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-12)


def reference_answer_text(answer: object) -> str:
    r"""The reference answer as text: GSM8K's "... #### 72" -> "72", a `\boxed{}` reference -> its contents; its
    numerals in ASCII."""
    text = ascii_numerals(str(answer))
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = extract_boxed(text)
    return boxed if boxed is not None else text.strip()
