"""The trainer's ledger of rollout samples for split-placement GRPO: prompt ids issued to the rollout workers,
version-tagged samples coming back, and the staleness bound ``algorithm.max_staleness``.

A *sample* is one prompt's group of completions (a ``Rollout`` of ``group_size`` rows, or its ``rollout_rows``)
with the prompt's id and the policy version that generated it. Versions count trainer steps (GRPO steps, each one
or more optimizer steps): the trainer's weights after v steps are version v, and a sample of version g taken at
version v has staleness v - g. A prompt id is a position in the prompt stream (the trainer maps it to a record;
with ``PromptSampler``, epoch = id // len(dataset), position = id % len(dataset)).

- ``issue(n)``: prompt ids for the generators, first the ones to redo (dropped as stale, or in flight at a
  resume), then new ones. ``stale_policy="wait"`` holds the generators back (AReaL's rule): at most
  (max_staleness + 1) x batch_size prompts are outstanding (issued and not consumed), so samples rarely go
  stale; ``issue`` waits up to ``timeout_s`` for room, and the wait counts as ``generator_idle_s``.
  ``"drop"`` never holds them back beyond ``capacity``.
- ``put(sample)``: a generator's result; a sample of an id that is not outstanding (consumed already, or a
  duplicate from a worker that was generating across a resume) is refused and counted.
- ``take(n, version)``: the n oldest samples with staleness <= max_staleness, waiting (``trainer_idle_s``)
  until there are n; staler ones are dropped (``dropped_samples``) and their prompts issued again, so no prompt
  is lost.
- ``step_metrics()``: the ``ASYNC_METRICS`` of the samples taken since the last call.
- ``state_dict()`` / ``load_state_dict()``: the outstanding ids and the counters, saved with the checkpoint.
  Samples waiting in the queue are not saved: their prompts are issued again after a resume, so a resumed run
  loses no prompt and trains on none twice.

Thread-safe: a receiver thread may ``put`` while the training loop waits in ``take``.

Used by split-placement GRPO (``megatron_rl.rl.rollout_workers``): the trainer issues prompt ids as orders for
the rollout workers (``megatron_rl.rollout.channel``), ``put``s what they send back, ``take``s a step's worth at
staleness <= k with ``stale_policy="wait"``, steps with the off-policy-corrected loss
(``megatron_rl.algorithms.policy_loss``) and publishes weights v + 1.

Test: ``.venv/bin/python -m pytest tests/test_rollout_buffer.py -q``
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

ASYNC_METRICS = ("staleness_mean", "staleness_max", "dropped_samples", "queue_depth", "trainer_idle_s",
                 "generator_idle_s")
"""Per-step metrics of split-placement GRPO (metrics.jsonl names): staleness of the samples trained on (mean and
max, in versions), samples dropped as too stale since the last step, samples waiting in the queue, and seconds
the trainer waited for samples and the generators waited for room."""
STALE_POLICIES = ("drop", "wait")
STATE_FORMAT = 1


@dataclass
class Sample:
    """One prompt's completions, tagged with the prompt id and the policy version that generated them."""

    prompt_id: int
    version: int
    """Policy version (optimizer steps) of the weights that generated the payload."""
    payload: Any
    """The completions, e.g. a ``Rollout`` of one group or its ``rollout_rows``."""


class RolloutBuffer:
    """Outstanding prompt ids, the queue of generated samples, and the staleness bound (see the module)."""

    def __init__(self, *, max_staleness: int, batch_size: int, stale_policy: str = "drop",
                 capacity: Optional[int] = None) -> None:
        if max_staleness < 0 or batch_size < 1:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0 and batch_size={batch_size} >= 1")
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy={stale_policy!r}: use one of {STALE_POLICIES}")
        self.max_staleness, self.batch_size, self.stale_policy = max_staleness, batch_size, stale_policy
        self.capacity = (max_staleness + 1) * batch_size if stale_policy == "wait" else capacity
        """Most prompts outstanding at once (None: no bound)."""
        self._lock = threading.Condition()
        self._next_id = 0
        self._outstanding: set[int] = set()
        self._redo: collections.deque[int] = collections.deque()
        self._queue: list[Sample] = []
        self._queued_ids: set[int] = set()
        self.consumed = 0
        self.dropped_total = 0
        self.refused_total = 0
        self.staleness_histogram: collections.Counter[int] = collections.Counter()
        self._step = self._empty_step()

    @staticmethod
    def _empty_step() -> dict[str, Any]:
        return {"staleness": [], "dropped": 0, "trainer_idle_s": 0.0, "generator_idle_s": 0.0}

    # ------------------------------------------------------------------------------------ generator side
    def issue(self, n: int, *, timeout_s: float = 0.0) -> list[int]:
        """Up to ``n`` prompt ids to generate: ids to redo first, then new ones; fewer (maybe none) when the
        capacity is full after waiting ``timeout_s`` for room (the wait counts as generator idle time)."""
        start = time.perf_counter()
        with self._lock:
            self._lock.wait_for(lambda: self._room() > 0, timeout=timeout_s)
            self._step["generator_idle_s"] += time.perf_counter() - start
            budget = min(n, self._room())
            ids = [self._redo.popleft() for _ in range(min(budget, len(self._redo)))]
            while len(ids) < budget:
                ids.append(self._next_id)
                self._outstanding.add(self._next_id)
                self._next_id += 1
            return ids

    def _room(self) -> int:
        """New or redone prompts that may start now; redone ones are outstanding already but not in flight."""
        if self.capacity is None:
            return 1 << 62
        in_flight = len(self._outstanding) - len(self._redo)
        return max(0, self.capacity - in_flight)

    def put(self, sample: Sample) -> bool:
        """Queue a generated sample; False (counted as refused) when its prompt id is not outstanding or is
        queued already."""
        with self._lock:
            if sample.prompt_id not in self._outstanding or sample.prompt_id in self._queued_ids \
                    or sample.prompt_id in self._redo:
                self.refused_total += 1
                return False
            self._queue.append(sample)
            self._queued_ids.add(sample.prompt_id)
            self._lock.notify_all()
            return True

    # -------------------------------------------------------------------------------------- trainer side
    def take(self, n: int, current_version: int, *, timeout_s: Optional[float] = None) -> list[Sample]:
        """The ``n`` oldest samples at most ``max_staleness`` versions behind ``current_version``, waiting for
        them (trainer idle time); staler samples are dropped and their prompts issued again. TimeoutError
        after ``timeout_s`` seconds (None: wait for ever)."""
        if self.capacity is not None and n > self.capacity:
            raise ValueError(f"take({n}) can never be met: at most {self.capacity} prompts are outstanding")
        start = time.perf_counter()
        with self._lock:
            def enough() -> bool:
                self._drop_stale(current_version)
                return len(self._queue) >= n

            ready = self._lock.wait_for(enough, timeout=timeout_s)
            self._step["trainer_idle_s"] += time.perf_counter() - start
            if not ready:
                raise TimeoutError(f"rollout buffer: {len(self._queue)} of {n} samples within staleness "
                                   f"{self.max_staleness} of version {current_version} after {timeout_s} s")
            self._queue.sort(key=lambda s: (s.version, s.prompt_id))
            taken, self._queue = self._queue[:n], self._queue[n:]
            for sample in taken:
                self._queued_ids.discard(sample.prompt_id)
                self._outstanding.discard(sample.prompt_id)
                staleness = current_version - sample.version
                self._step["staleness"].append(staleness)
                self.staleness_histogram[staleness] += 1
            self.consumed += len(taken)
            self._lock.notify_all()  # room for the generators
            return taken

    def _drop_stale(self, current_version: int) -> None:
        kept = []
        for sample in self._queue:
            if sample.version > current_version:
                raise ValueError(f"sample of prompt {sample.prompt_id} has version {sample.version}, newer than "
                                 f"the trainer's {current_version}")
            if current_version - sample.version <= self.max_staleness:
                kept.append(sample)
                continue
            self._queued_ids.discard(sample.prompt_id)
            self._redo.append(sample.prompt_id)
            self._step["dropped"] += 1
            self.dropped_total += 1
        if len(kept) != len(self._queue):
            self._queue = kept
            self._lock.notify_all()

    @property
    def room(self) -> int:
        """Prompts ``issue`` would hand out now."""
        with self._lock:
            return self._room()

    @property
    def next_id(self) -> int:
        """The first prompt id never issued."""
        with self._lock:
            return self._next_id

    def outstanding_ids(self) -> set[int]:
        """Ids issued and not consumed (in flight, queued, or to be issued again)."""
        with self._lock:
            return set(self._outstanding)

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._queue)

    def step_metrics(self) -> dict[str, float]:
        """``ASYNC_METRICS`` since the previous call (staleness of the samples taken, drops and idle seconds),
        and the queue depth now; starts the next step's counts."""
        with self._lock:
            step, self._step = self._step, self._empty_step()
            staleness = step["staleness"]
            return {"staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
                    "staleness_max": max(staleness, default=0), "dropped_samples": step["dropped"],
                    "queue_depth": len(self._queue), "trainer_idle_s": step["trainer_idle_s"],
                    "generator_idle_s": step["generator_idle_s"]}

    # ---------------------------------------------------------------------------------------- resuming
    def state_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint: the ids issued and not consumed (queued samples included: they are
        generated again after a resume) and the counters."""
        with self._lock:
            return {"format": STATE_FORMAT, "max_staleness": self.max_staleness, "next_id": self._next_id,
                    "outstanding": sorted(self._outstanding), "consumed": self.consumed,
                    "dropped": self.dropped_total, "refused": self.refused_total,
                    "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: its outstanding ids are issued again first, in order; the queue starts empty."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"rollout buffer state format {state.get('format')!r}; this code reads {STATE_FORMAT}")
        with self._lock:
            self._next_id = int(state["next_id"])
            self._outstanding = {int(i) for i in state["outstanding"]}
            self._redo = collections.deque(sorted(self._outstanding))
            self._queue, self._queued_ids = [], set()
            self.consumed, self.dropped_total = int(state["consumed"]), int(state["dropped"])
            self.refused_total = int(state["refused"])
            self.staleness_histogram = collections.Counter(
                {int(k): int(v) for k, v in state["staleness_histogram"].items()})
