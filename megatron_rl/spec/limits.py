"""What the trainers cannot run yet, in one table: the planner holds these ``parallel:`` values fixed (and
``launch.py plan`` says why), and ``check_layout`` refuses any other value with the same reason.

    limits = trainer_limits(shape, "grpo")    # {"cp": (1, "the trainers do not split ..."), ...}
    check_limits({"cp": 2}, limits)           # ConfigError: parallel.cp=2: the trainers do not split ...

When a trainer learns a layout, delete its entry from ``TRAINER_LIMITS``; nothing else refers to it.
Test: ``.venv/bin/python -m pytest tests/test_plan_launch.py -q -k limit``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from megatron_rl.spec.config.schema import ALGORITHMS
from megatron_rl.spec.errors import ConfigError, as_yaml
from megatron_rl.spec.model_shape import ModelShape


@dataclass(frozen=True, kw_only=True)
class TrainerLimit:
    """One ``parallel.<key>`` that the trainers run at one value only, so far."""

    key: str
    """The ``parallel:`` key (also the planner's layout name)."""
    value: Any
    """The only value the trainers run (None: leave the key unset)."""
    reason: str
    """Why, for the error message and the plan."""
    moe_only: bool = False
    """Applies to MoE models only."""
    algorithms: tuple[str, ...] = ALGORITHMS
    """The trainers (algorithm.name) it applies to."""


TRAINER_LIMITS: tuple[TrainerLimit, ...] = (
    TrainerLimit(key="cp", value=1, algorithms=("rm",),
                 reason="the reward model reads its reward at each sequence's last token, which context "
                        "parallelism would put on another rank"),
    TrainerLimit(key="cp", value=1, algorithms=("ppo",),
                 reason="PPO's critic (a value head at every position) does not support context parallelism yet"),
)


JOB_LIMITS: dict[str, tuple[Any, str]] = {}
"""Other config keys (``section.key``) the trainers run at one value only, so far: ``check_job_limits`` refuses
any other value. Delete an entry when a trainer supports the key."""


def check_job_limits(cfg: Any) -> None:
    """Raise ConfigError (one line: the key, the reason, the fix) for the first JOB_LIMITS key of the job config
    ``cfg`` set to another value."""
    for dotted, (only, reason) in JOB_LIMITS.items():
        section, key = dotted.split(".")
        given = getattr(getattr(cfg, section), key)
        if given != only:
            raise ConfigError(f"{dotted}={as_yaml(given)}: {reason}; set {dotted}={as_yaml(only)}")


def trainer_limits(shape: ModelShape, algorithm: str) -> dict[str, tuple[Any, str]]:
    """``{parallel key: (the only value the trainers run, why)}`` for this model and algorithm.name."""
    return {limit.key: (limit.value, limit.reason) for limit in TRAINER_LIMITS
            if algorithm in limit.algorithms and (shape.is_moe or not limit.moe_only)}


def check_limits(values: Mapping[str, Any], limits: Mapping[str, tuple[Any, str]]) -> None:
    """Raise ConfigError (one line: the key, the reason, the fix) for the first value in ``values``
    (``parallel:`` key -> value) that a limit refuses."""
    for key, (value, reason) in limits.items():
        if key in values and values[key] != value:
            given, only = as_yaml(values[key]), as_yaml(value)
            raise ConfigError(f"parallel.{key}={given}: {reason}; set parallel.{key}={only}")
