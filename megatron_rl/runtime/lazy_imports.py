"""Modules Megatron imports at import time but uses only when a feature is on, loaded at their first use instead.

Every ``GPTModel`` import reaches ``megatron.core.inference.contexts.dynamic_context``, which runs ``import wandb``
for metrics this project never turns on there; importing wandb costs ~0.5 s of CPU per process, paid by every rank
of every job. ``defer()`` puts a stand-in module in ``sys.modules``: Megatron's import binds it, and the real module
is imported the first time anyone reads one of its attributes (as when ``logging.wandb`` starts a run,
megatron_rl/runtime/metrics.py, or a submodule is imported), then stands in ``sys.modules`` itself. The stand-in
answers ``__file__`` and ``__spec__`` without loading, because ``inspect.getmodule`` (which torch.library calls
while Megatron imports) reads every module's ``__file__``; ``importlib.util.LazyLoader`` loads on that read.
Call it before Megatron's first import, as ``cpu_compat.apply()`` is.

Test: ``.venv/bin/python -m pytest tests/test_logging.py -q`` (a real offline W&B run in a job that deferred it).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

DEFERRED = ("wandb",)
"""Modules loaded at their first use."""


class _Deferred(types.ModuleType):
    """A module not imported yet: any attribute it lacks imports the real one (module ``__getattr__``)."""

    def __getattr__(self, attr: str):
        return getattr(_load(self.__name__), attr)


def _load(name: str) -> types.ModuleType:
    if isinstance(sys.modules.get(name), _Deferred):
        del sys.modules[name]
    return importlib.import_module(name)


def defer(names: tuple[str, ...] = DEFERRED) -> None:
    """Make each of ``names`` that is installed and not imported yet a stand-in until its first use."""
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        stand_in = _Deferred(name)
        stand_in.__file__, stand_in.__spec__ = spec.origin, spec
        sys.modules[name] = stand_in


def is_deferred(name: str) -> bool:
    """Whether ``name`` is still a stand-in (not imported for real yet)."""
    return isinstance(sys.modules.get(name), _Deferred)
