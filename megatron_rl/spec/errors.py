"""User-facing errors: raised for bad input, printed as one line by the CLI, exit code 2."""

from __future__ import annotations

import difflib
from typing import Iterable


class ConfigError(Exception):
    """Bad user input (config key, value, file, layout). The message names the key or file and the fix."""

    exit_code = 2


def did_you_mean(word: str, options: Iterable[str], *, cutoff: float = 0.6, prefix: str = "") -> str:
    """`` (did you mean 'PREFIX<closest option>'?)`` for an error message, or "" when no option is close."""
    close = difflib.get_close_matches(word, sorted(options), n=1, cutoff=cutoff)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def as_yaml(value) -> str:
    """A config value as written in YAML or a key=value override: true, null, 8."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
