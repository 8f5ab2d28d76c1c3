"""What one RL step sampled, whichever source it came from."""

from __future__ import annotations

import dataclasses

from megatron_rl.rollout.batch import Rollout


@dataclasses.dataclass
class SampledBatch:
    """What one step sampled: every completion drawn (the reward metrics are theirs) and those trained on."""

    drawn: Rollout
    """Every completion generated this step, scored."""
    kept: Rollout
    """The completions trained on (with dynamic sampling, the groups with signal)."""
    draws: int
    """Rollout rounds it took."""
    sample_s: float
    """Seconds the trainers spent getting the completions: generating them (colocated), or waiting for the rollout
    workers' (split placement, whose own generation time comes with their samples)."""
    score_s: float
    """Seconds spent scoring them."""
