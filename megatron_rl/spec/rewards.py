"""The built-in reward names and their options: what a config may write under ``algorithm.rewards``.

The scorers live in the job (``megatron_rl/rewards/``); a config is checked against this table before anything
starts. Other names (a dotted path, or a name the job's own imports register) are checked when the job builds them.
``tests/test_rewards.py`` binds each entry to its scorer's keyword parameters.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_rl.spec.errors import ConfigError, did_you_mean

BUILTIN_REWARD_OPTIONS: dict[str, tuple[str, ...]] = {
    "math": ("tolerance",),
    "math_verify": ("tolerance", "backend"),
    "format": ("pattern", "required_tags"),
    "exact": ("case_sensitive",),
}
"""Each built-in reward's options (all optional keywords of its scorer)."""


def check_reward_options(name: str, options: Mapping[str, Any], *, label: str) -> None:
    """For a built-in name: ConfigError naming label and listing the valid options when one is unknown."""
    valid = BUILTIN_REWARD_OPTIONS.get(name)
    if valid is not None:
        check_option_names(options, valid, label=label)


def check_option_names(options: Mapping[str, Any], valid: tuple[str, ...], *, label: str) -> None:
    """ConfigError naming label and listing ``valid`` when an option is not one of them."""
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"{label}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
                          f"{did_you_mean(unknown[0], valid)}; valid options: {', '.join(valid)}")
