"""The built-in environment names and their options: what a config may write under ``environment:``.

The environments live in the job (``megatron_rl/environments/``); a config naming a built-in is checked against
this table before anything starts, a dotted path when the job builds it. ``tests/test_environments.py`` binds
each entry to its class's keyword parameters.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_rl.spec.errors import ConfigError, did_you_mean
from megatron_rl.spec.rewards import check_option_names

BUILTIN_ENVIRONMENT_OPTIONS: dict[str, tuple[str, ...]] = {
    "calculator": ("tag", "max_calls"),
    "python_math": ("max_calls", "wall_s", "cpu_s", "memory_mib", "output_chars"),
}
"""Each built-in environment's options (all optional keywords of its class)."""


def check_environment(name: str, options: Mapping[str, Any]) -> None:
    """A built-in name's options, or the shape of a dotted path; ConfigError in one line otherwise."""
    if name in BUILTIN_ENVIRONMENT_OPTIONS:
        check_option_names(options, BUILTIN_ENVIRONMENT_OPTIONS[name], label=f"environment.options of {name!r}")
    elif "." not in name and ":" not in name:
        raise ConfigError(f"environment.name={name!r} is not built in ({', '.join(BUILTIN_ENVIRONMENT_OPTIONS)})"
                          f"{did_you_mean(name, BUILTIN_ENVIRONMENT_OPTIONS)}; or give a dotted path "
                          "'package.module:Class'")
