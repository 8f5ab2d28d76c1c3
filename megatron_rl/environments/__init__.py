"""Environments for multi-turn RL: the interface, episode limits, tools, the sandbox and the built-in environments.

An environment is named like a custom reward: a built-in name (``calculator``, ``python_math``) or a dotted path
"package.module:Class" on PYTHONPATH on every node; its options are the class's keyword parameters, checked when
the job builds it, and it is built once per episode (``build_environment`` returns the factory). The room imports
no torch.

Test: ``.venv/bin/python -m pytest tests/test_environments.py tests/test_sandbox.py -q``
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from megatron_rl.environments.builtin import BUILTIN_ENVIRONMENTS, CalculatorEnv, PythonMathEnv
from megatron_rl.environments.episode import END_REASONS, Environment, Episode, EpisodeLimits, StepResult
from megatron_rl.rewards.registry import check_factory_options, load_dotted
from megatron_rl.spec.environments import check_environment
from megatron_rl.spec.errors import ConfigError


def build_environment(name: str, options: Optional[Mapping[str, Any]] = None) -> Callable[[], Environment]:
    """A factory of fresh environments named by ``name`` (built-in or dotted path) with ``options``; one is built
    here to check it, so a bad option or a class without reset/step/stop fails now, in one line."""
    options = dict(options or {})
    check_environment(name, options)
    cls = BUILTIN_ENVIRONMENTS[name] if name in BUILTIN_ENVIRONMENTS else load_dotted(name, what="environment")
    check_factory_options(cls, options, f"environment {name!r}")

    def make() -> Environment:
        return cls(**options)

    try:
        probe = make()
    except (TypeError, ValueError) as error:
        raise ConfigError(f"environment {name!r}: {error}") from None
    missing = [attr for attr in ("reset", "step") if not callable(getattr(probe, attr, None))]
    stop = getattr(probe, "stop", ())
    if missing or isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(f"environment {name!r}: needs reset(record) and step(text) methods and a `stop` tuple of "
                          f"non-empty strings ({'missing ' + ', '.join(missing) if missing else 'stop is ' + repr(stop)})")
    return make


__all__ = ["BUILTIN_ENVIRONMENTS", "CalculatorEnv", "END_REASONS", "Environment", "Episode", "EpisodeLimits",
           "PythonMathEnv", "StepResult", "build_environment"]
