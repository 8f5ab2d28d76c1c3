"""The scheduler: the waiting and running sequences, and which of them the next forward feeds.

``schedule()`` first gives the running rows the blocks their uncached tokens need (oldest first), then admits
waiting groups while blocks are free (a group's prompt prefilled once by its lead, its full blocks shared at
admission), and returns the step: the rows fed (a running row's uncached tokens: its last sampled token, a
multi-turn reply, or its whole context after a preemption) and the groups admitted. When a row needs a block and
none is free, ``preempt()`` evicts the newest row: it returns its blocks and waits at the head of the queue, to be
prefilled again (prompt and response so far) when blocks free up. A row is never cut short, and the pool never
runs out.

Torch-free but for the block table. Test: ``.venv/bin/python -m pytest tests/test_generation.py -q -k evict``
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from megatron_rl.generation.block_manager import BlockManager
from megatron_rl.generation.sequence import Sequence, SequenceGroup

WATERMARK_ROWS = 16
"""Admission keeps one free block per this many running rows, so that rows about to need a block do not evict
the group just admitted."""


@dataclass(frozen=True)
class ScheduledStep:
    """One forward's rows: ``fed`` (each feeds its uncached tokens), ``admitted`` (groups whose lead is fed for
    the first time; the other members sample from the lead's logits)."""

    fed: list
    admitted: list


class Scheduler:
    """Waiting groups and running rows of one engine part, over its ``BlockManager``."""

    def __init__(self, groups: list, *, blocks: BlockManager, budget: int, max_concurrent: Optional[int],
                 counters: dict, finished_group: Optional[Callable[[list], None]] = None) -> None:
        self.blocks, self.budget, self.max_concurrent, self.counters = blocks, budget, max_concurrent, counters
        self.waiting: deque = deque(groups)
        self.running: list = []
        self.finished_group = finished_group
        """A session's report of a fed prompt whose rows have all ended (feed.py ``FeedSlots.finished``)."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, groups: list) -> None:
        self.waiting.extend(groups)

    def schedule(self, ready: Callable[[Sequence], bool]) -> ScheduledStep:
        """Allocate, admit, and pick the rows fed next: running rows with uncached tokens that are ``ready``
        (not awaiting a multi-turn reply), admitted groups' leads among them."""
        if not self.has_work:
            return ScheduledStep(fed=[], admitted=[])
        block_tokens = self.blocks.block_tokens
        for row in list(self.running):  # in admission order; a preempted row holds no blocks
            if row.blocks and len(row.blocks) * block_tokens < len(row.tokens):
                self._allocate(row, len(row.tokens))
        admitted = self._admit()
        if not self.running:
            raise RuntimeError("the KV pool could not admit any row")  # excluded by the sizes checked
        pending = {id(row) for group in admitted for row in group.rows[1:]}
        fed = [row for row in self.running if row.cached < len(row.tokens) and ready(row)
               and (not pending or id(row) not in pending)]
        return ScheduledStep(fed=fed, admitted=admitted)

    def preempt(self, victim: Sequence) -> None:
        """Evict ``victim``: its blocks return to the pool and it waits at the head of the queue."""
        self.blocks.free(victim)
        victim.cached = 0
        self.running.remove(victim)
        self.waiting.appendleft(SequenceGroup(rows=[victim]))
        self.counters["evictions"] += 1

    def finish(self, row: Sequence) -> None:
        """``row`` ended: its blocks return; a session's fed prompt is reported once all its rows ended."""
        self.blocks.free(row)
        self.running.remove(row)
        if row.group is not None and all(r.finish is not None for r in row.group):
            self.finished_group(row.group)

    def _allocate(self, row: Sequence, length: int) -> None:
        """Blocks for ``length`` positions of ``row``, preempting the newest rows (``row`` too, if need be)."""
        while not self.blocks.allocate(row, length):
            victim = self.running[-1]  # the newest: rows join ``running`` in admission order
            self.preempt(victim)
            if victim is row:
                return

    def _admit(self) -> list:
        admitted = []
        while self.waiting:
            group = self.waiting[0]
            if (self.max_concurrent is not None and self.running
                    and len(self.running) + len(group.rows) > self.max_concurrent):
                break
            need = group.blocks_needed(self.blocks.block_tokens)
            if need > self.budget:  # a group too large for the whole pool: its members are admitted apart
                self.waiting.popleft()
                self.waiting.extendleft(SequenceGroup(rows=[row]) for row in reversed(group.rows))
                continue
            if self.blocks.free_blocks < need + (len(self.running) // WATERMARK_ROWS if self.running else 0):
                break
            self.waiting.popleft()
            for row in group.rows:
                row.admitted = self.counters["admitted"]
                self.counters["admitted"] += 1
                self.running.append(row)
            self._allocate(group.lead, len(group.lead.tokens))
            self.blocks.share_prompt(group.lead, group.rows[1:])
            admitted.append(group)
        return admitted
