r"""Reward functions by name or dotted path, and their weighted combination.

A reward function is any callable `fn(prompts: list[str], completions: list[str], answers: list[Any]) -> list[float]`
(one score per completion, batched). The registry maps a name to a FACTORY `factory(**options) -> reward fn`,
so a stateful scorer (a reward model holding weights) registers the same way as a stateless rule:

    register_reward("rm", lambda checkpoint: RewardModelScorer(checkpoint))
    fn = build_reward_fn("rm", {"checkpoint": "/ckpt/rm"})

Built in: math (`MathAnswerReward`: tolerance), math_verify (`MathVerifyReward`: tolerance, backend), format
(`FormatReward`: pattern, required_tags), exact (`ExactMatchReward`: case_sensitive). The options are the
factory's keyword parameters; a job gives them in the config, next to the weight:

    algorithm:
      rewards:
        math_verify: {weight: 1.0, tolerance: 1.0e-6}
        format: {weight: 0.2, pattern: '<think>.*?</think>\s*<answer>.*?</answer>'}
        mypkg.rewards:length_bonus: 0.1          # a plain weight: no options

Your own reward: a module on PYTHONPATH (on every node) with a function of the signature above, named by its
dotted path; with options, the path names a factory (a class or function) called as `factory(**options)`.

Test: `.venv/bin/python -m pytest tests/test_rewards.py -q`
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megatron_rl.rewards.verifiers import ExactMatchReward, FormatReward, MathAnswerReward, MathVerifyReward
from megatron_rl.spec.errors import ConfigError, did_you_mean

RewardFn = Callable[[list[str], list[str], list[Any]], list[float]]
RewardFactory = Callable[..., RewardFn]

_FACTORIES: dict[str, RewardFactory] = {}


def register_reward(name: str, factory: RewardFactory | None = None, *, replace: bool = False):
    """Register `factory(**options) -> reward fn` under name; usable as a decorator when factory is omitted."""

    def _register(fn_factory: RewardFactory) -> RewardFactory:
        if name in _FACTORIES and not replace and _FACTORIES[name] is not fn_factory:
            raise ValueError(f"reward {name!r} is already registered; pass replace=True to override it")
        _FACTORIES[name] = fn_factory
        return fn_factory

    return _register(factory) if factory is not None else _register


def registered_rewards() -> list[str]:
    return sorted(_FACTORIES)


register_reward("math", MathAnswerReward)
register_reward("math_verify", MathVerifyReward)
register_reward("format", FormatReward)
register_reward("exact", ExactMatchReward)


def _import_module(module_name: str, spec: str, what: str) -> Any | None:
    """The module, None when module_name itself (or a parent) does not exist; other import errors -> ConfigError."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            return None
        raise ConfigError(f"{what} {spec!r}: importing {module_name!r} failed: {error}") from None
    except Exception as error:  # the user's module raised while importing
        raise ConfigError(
            f"{what} {spec!r}: importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from None


def load_dotted(path: str, *, what: str) -> Any:
    """The callable named by "package.module:attr" or "package.module.attr" (attr may be dotted: "Class.method").

    Raises ConfigError naming ``what`` and the path when the module or attribute is missing or the object is not callable.
    """
    spec = path.strip()
    if not spec or spec.startswith((".", ":")) or spec.count(":") > 1:
        raise ConfigError(
            f"{what} {path!r}: write it as 'package.module:function' or 'package.module.function'"
        )
    if ":" in spec:
        module_name, attr_path = spec.split(":")
        module = _import_module(module_name, spec, what)
        if module is None:
            raise ConfigError(
                f"{what} {spec!r}: module {module_name!r} not found (check the path, and that its "
                "directory is on PYTHONPATH on every node)"
            )
    else:
        parts = spec.split(".")
        module = None
        for split in range(len(parts) - 1, 0, -1):
            module_name = ".".join(parts[:split])
            module = _import_module(module_name, spec, what)
            if module is not None:
                attr_path = ".".join(parts[split:])
                break
        if module is None:
            raise ConfigError(
                f"{what} {spec!r}: no importable module in it (check the path, and that its directory "
                "is on PYTHONPATH on every node)"
            )
    target: Any = module
    for attr in attr_path.split("."):
        if not attr or not hasattr(target, attr):
            raise ConfigError(f"{what} {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, attr)
    if not callable(target):
        raise ConfigError(f"{what} {spec!r}: {type(target).__name__} object is not callable")
    return target


def load_reward_fn(path: str) -> Any:
    """The reward function (or factory) named by "package.module:attr" or "package.module.attr"."""
    return load_dotted(path, what="reward function")


def check_factory_options(factory: Callable[..., Any], options: Mapping[str, Any], label: str) -> None:
    """ConfigError naming label when options are not the factory's keyword parameters (listing those)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    params = signature.parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        valid = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ConfigError(f"{label}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
                              f"{did_you_mean(unknown[0], valid)}; valid options: "
                              f"{', '.join(valid) or 'none (give just a weight)'}")
    try:
        signature.bind(**options)
    except TypeError as error:
        raise ConfigError(f"{label}: the options do not fit its factory ({error}); add them next to the weight") \
            from None


def _call_factory(factory: Callable[..., Any], options: Mapping[str, Any], label: str) -> Any:
    check_factory_options(factory, options, f"reward {label!r}")
    return factory(**options)


def build_reward_fn(spec: str | RewardFn, options: Mapping[str, Any] | None = None) -> RewardFn:
    """A ready reward fn from a registered name, a dotted path, or a callable passed through.

    Registered name -> factory(**options). Dotted path -> the loaded object; a class is instantiated with
    options, and a function is itself the reward fn unless options are given (then it is called as a factory).
    """
    options = dict(options or {})
    if callable(spec) and not isinstance(spec, str):
        if options:
            raise ConfigError(f"reward {spec!r}: options are given but the reward is already a callable")
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"reward {spec!r}: expected a name ({', '.join(registered_rewards())}) or a dotted path")
    if spec in _FACTORIES:
        return _call_factory(_FACTORIES[spec], options, spec)
    if "." not in spec and ":" not in spec:
        raise ConfigError(
            f"reward {spec!r} is not registered (known: {', '.join(registered_rewards())}); "
            "or give a dotted path 'package.module:function'"
        )
    target = load_reward_fn(spec)
    if inspect.isclass(target) or options:
        return _call_factory(target, options, spec)
    return target


COLLECTIVE_REWARDS = frozenset({"rm"})
"""Reward names whose fn runs collectives (the trained reward model, ``rewards/job.build_rewards``): one that
raised is not called again on a completion alone (the other ranks would not join)."""


def score_completions(
    reward_fns: Mapping[str, RewardFn],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[Any],
) -> dict[str, list[float]]:
    """Each named reward fn's scores for the batch (prompt-major: each prompt's completions in a row). A fn that
    raises, returns a wrong score count or a non-finite score -> ConfigError naming the fn, the completion and its
    prompt; one that raised is called again on each completion alone to find the one it fails on, and the error is
    raised from that exception (the job keeps its traceback in the rank's error log, ``megatron_rl/main.py``)."""
    scores: dict[str, list[float]] = {}
    for name, fn in reward_fns.items():
        try:
            raw = fn(list(prompts), list(completions), list(answers))
        except Exception as exc:
            index, exc = _first_failing(name, fn, prompts, completions, answers, exc)
            where = _completion(prompts, index) if index is not None else f"a batch of {len(completions)} completions"
            message = (str(exc).strip() or "(no message)").splitlines()[0]
            raise ConfigError(f"reward {name!r} raised {type(exc).__name__}: {message} on {where}; fix the reward "
                              "function (or drop it from algorithm.rewards)") from exc
        if not hasattr(raw, "__iter__"):
            raise ConfigError(f"reward {name!r} returned {type(raw).__name__}, not a list; a reward fn must return one "
                              "float per completion")
        values = []
        for index, value in enumerate(raw):
            try:
                values.append(float(value))
            except (TypeError, ValueError):
                raise ConfigError(f"reward {name!r} returned {value!r} for {_completion(prompts, index)}; a reward fn "
                                  "must return one float per completion") from None
        if len(values) != len(completions):
            raise ConfigError(
                f"reward {name!r} returned {len(values)} scores for {len(completions)} completions; "
                "a reward fn must return one float per completion"
            )
        bad = next((index for index, value in enumerate(values) if not math.isfinite(value)), None)
        if bad is not None:
            raise ConfigError(f"reward {name!r} returned {values[bad]} (not finite) for {_completion(prompts, bad)}; "
                              "a reward fn must return finite scores")
        scores[name] = values
    return scores


def _first_failing(name: str, fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
                   answers: Sequence[Any], exc: Exception) -> tuple[int | None, Exception]:
    """The first completion the fn raises on when given alone, and what it raised; (None, ``exc``) when none does
    (the batch as a whole failed) or the fn runs collectives."""
    if name in COLLECTIVE_REWARDS:
        return None, exc
    for index in range(len(completions)):
        try:
            fn([prompts[index]], [completions[index]], [answers[index]])
        except Exception as alone:
            return index, alone
    return None, exc


def _completion(prompts: Sequence[str], index: int) -> str:
    """Where completion ``index`` is: its index in the batch, its prompt's (the prompts of a prompt-major batch
    counted from 0) and the prompt's first words."""
    prompt = sum(1 for i in range(1, index + 1) if prompts[i] != prompts[i - 1])
    text = " ".join(str(prompts[index]).split())
    start = repr(text if len(text) <= 48 else text[:48] + "...")
    return f"completion {index} (prompt {prompt} of the batch: {start})"


def combine_rewards(per_fn_scores: Mapping[str, Sequence[float]], weights: Mapping[str, float]) -> list[float]:
    """Weighted sum over reward fns, per completion. Every scored fn needs a weight, and every weight a scored fn."""
    unknown = sorted(set(weights) - set(per_fn_scores))
    missing = sorted(set(per_fn_scores) - set(weights))
    if unknown or missing:
        raise ConfigError(
            f"reward weights {sorted(weights)} do not match reward fns {sorted(per_fn_scores)} "
            f"(no such fn: {unknown}, no weight: {missing})"
        )
    lengths = {len(scores) for scores in per_fn_scores.values()}
    if len(lengths) > 1:
        raise ValueError(f"reward fns scored different numbers of completions: {sorted(lengths)}")
    count = lengths.pop() if lengths else 0
    return [sum(weights[name] * per_fn_scores[name][i] for name in per_fn_scores) for i in range(count)]


@dataclasses.dataclass(kw_only=True)
class WeightedRewards:
    """Named reward fns with weights: `score(...)` gives the combined reward and each fn's scores."""

    fns: dict[str, RewardFn]
    """Reward fn per name (names appear in metrics as reward/<name>)."""
    weights: dict[str, float]
    """Weight per name; the combined reward is the weighted sum."""

    def __post_init__(self) -> None:
        if not self.fns:
            raise ConfigError("rewards: at least one reward fn is needed (e.g. name: math)")
        combine_rewards({name: [] for name in self.fns}, self.weights)

    @classmethod
    def from_specs(cls, specs: Mapping[str, Mapping[str, Any]]) -> WeightedRewards:
        """From {name: {"fn": registered name or dotted path (default: name), "weight": 1.0, "options": {...}}}."""
        fns, weights = {}, {}
        for name, spec in specs.items():
            unknown = sorted(set(spec) - {"fn", "weight", "options"})
            if unknown:
                raise ConfigError(f"rewards.{name}: unknown keys {unknown} (allowed: fn, weight, options)")
            fns[name] = build_reward_fn(spec.get("fn", name), spec.get("options"))
            weights[name] = float(spec.get("weight", 1.0))
        return cls(fns=fns, weights=weights)

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], dict[str, list[float]]]:
        per_fn = score_completions(self.fns, prompts, completions, answers)
        return combine_rewards(per_fn, self.weights), per_fn
