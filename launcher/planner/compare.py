"""Layouts side by side: why the runner-up lost (the part of the step-time breakdown that decides it), and which
fitting layout is nearest to a layout the user kept that does not fit.

Both compare estimates the search already made (Estimate.breakdown_s, estimate.TIME_PARTS); nothing here models
time or memory. Check it: ``.venv/bin/python -m pytest tests/test_planner.py -q -k "runner_up or nearest"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from launcher.planner.estimate import Estimate, Layout
from megatron_rl.spec.config.schema import RECOMPUTE_MODES

CHANGE_COST = {"tp": 3, "cp": 3, "ep": 3, "etp": 3, "sequence_parallel": 3, "pp": 2, "vpp": 1, "micro_batch_size": 1,
               "recompute": 1, "recompute_num_layers": 1, "first_stage_layers": 1, "last_stage_layers": 1,
               "account_for_embedding": 1, "account_for_loss": 1, "pipeline_layout": 1}
"""How big a change of each kept layout key is, for the nearest fitting layout: more recompute, a smaller
micro-batch or another split first, then more pipeline stages, and only then another TP, CP, EP or SP."""
SIZE_KEYS = ("tp", "cp", "ep", "sequence_parallel")
"""The kept keys the nearest-layout search holds first (it frees them only when nothing fits with them)."""


@dataclass(frozen=True, kw_only=True)
class RunnerUp:
    """The best layout the plan did not choose, and what its step time differs in."""

    estimate: Estimate
    """Its estimate."""
    slower_by: float
    """(its step time - the chosen one's) / the chosen one's; negative when it is faster (then it was excluded)."""
    main_reason: str
    """The TIME_PARTS key that accounts for most of the gap: the largest increase when it is slower, the largest
    saving when it is faster."""
    deltas_s: dict[str, float]
    """Its breakdown_s minus the chosen layout's, by TIME_PARTS key."""
    excluded_by: dict[str, Any] = field(default_factory=dict)
    """The kept (given) layout keys it differs in, when those ruled it out; empty when it lost on time."""

    def to_dict(self) -> dict:
        """The JSON ``runner_up`` object."""
        return {"layout": self.estimate.layout.to_dict(), "step_time_s": round(self.estimate.step_time_s, 4),
                "slower_by": round(self.slower_by, 4), "main_reason": self.main_reason,
                "deltas_s": {k: round(v, 6) for k, v in self.deltas_s.items()}, "excluded_by": self.excluded_by}


def runner_up(chosen: Estimate, other: Estimate, kept: Mapping[str, Any] | None = None) -> RunnerUp:
    """``other`` against ``chosen``; ``kept``: the given keys, when they are what excluded ``other``."""
    deltas = {key: other.breakdown_s[key] - seconds for key, seconds in chosen.breakdown_s.items()}
    slower_by = other.step_time_s / chosen.step_time_s - 1
    pick = max if slower_by >= 0 else min
    excluded = {key: value for key, value in (kept or {}).items() if other.layout.value(key) != value}
    return RunnerUp(estimate=other, slower_by=slower_by, main_reason=pick(deltas, key=deltas.__getitem__),
                    deltas_s=deltas, excluded_by=excluded)


def change_cost(layout: Layout, kept: Mapping[str, Any]) -> tuple[int, float]:
    """How far ``layout`` is from the ``kept`` keys: (sum of CHANGE_COST over the keys it changes, total size of
    the changes: factors of two for sizes, steps for recompute, one for the rest)."""
    changed = [key for key, value in kept.items() if layout.value(key) != value]
    return (sum(CHANGE_COST.get(key, max(CHANGE_COST.values())) for key in changed),
            sum(_change_size(key, kept[key], layout.value(key)) for key in changed))


def _change_size(key: str, kept: Any, new: Any) -> float:
    if key == "recompute":
        return abs(RECOMPUTE_MODES.index(new) - RECOMPUTE_MODES.index(kept))
    if isinstance(kept, int) and not isinstance(kept, bool) and isinstance(new, int) and kept > 0 and new > 0:
        return abs(math.log2(new / kept))
    return 1.0


def nearest(fitting: Iterable[Estimate], kept: Mapping[str, Any]) -> Estimate | None:
    """The fitting estimate that changes the kept keys least (change_cost), the fastest of those."""
    return min(fitting, key=lambda e: (change_cost(e.layout, kept), e.step_time_s), default=None)
