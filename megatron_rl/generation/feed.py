"""A session's prompts: a ``Feed`` (the async rollout worker's orders) hands ``FedPrompt``s to a running engine,
which decodes them while earlier rows still decode and hands back each prompt's completions
(``FinishedPrompt``) as soon as all have ended; ``FeedSlots`` gives their rows block-table slots and reuses them.

Torch-free. Test: ``.venv/bin/python -m pytest tests/test_generation.py -q -k session``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from megatron_rl.generation.sequence import Sequence


@dataclass(frozen=True, kw_only=True)
class FedPrompt:
    """A prompt a ``Feed`` hands a running session: ``completions`` rows of it are decoded."""

    tokens: tuple
    completions: int
    seed: int
    """Its draws' seed (every completion's)."""
    first_request: int
    """Its first completion's draws counter; the others follow. With the seed, this makes a completion's tokens
    those a call of the same prompts would give it (``generate``'s row ``first_request + j``)."""
    tag: Any = None
    """The feed's own label, handed back with the completions."""
    turns: Optional[Callable[[int, list, str], Any]] = None
    """Multi-turn: ``turns(completion, the turn's tokens, "stop" or "length")`` when a completion's turn ends, as
    turns.py ``TurnEnded`` (the completion's place among ``completions`` instead of a row index). None: single
    turns."""


@dataclass(frozen=True, kw_only=True)
class FinishedPrompt:
    """The completions of one FedPrompt, all ended (``Feed.finished``)."""

    prompt: FedPrompt
    responses: list
    logprobs: list
    """Per completion, the policy log-prob of each response token (the weights that chose it)."""
    finish_reasons: list
    policy_masks: list
    """Per completion, per response token: 1 when the policy sampled it, 0 for a multi-turn reply's tokens."""


class Feed(Protocol):
    """What keeps a session decoding across calls' worth of prompts (the async rollout worker's orders): rows join
    as the feed hands them in, while the rows before them still decode, and leave as they end."""

    def more(self, generating: bool, counters: dict) -> list:
        """FedPrompts to admit now: asked every STOP_POLL_STEPS engine steps while rows decode (``generating``) and
        whenever none is left (then it may wait for work). A collective over the session's ranks: every rank gets
        the same list. Raises ``GenerationStopped`` to end the session. ``counters``: the engine's (admitted,
        evictions, prefills, forwards, fed, sampled, graph_steps)."""

    def finished(self, done: FinishedPrompt) -> None:
        """Every completion of ``done.prompt`` has ended (called on every rank)."""


class FeedSlots:
    """The rows of a session: a fed prompt's completions take free slots of ``rows`` (the block table's rows),
    and give them back once all have ended and gone to ``feed.finished``."""

    def __init__(self, feed: Feed, rows: list, *, max_new_tokens: int, max_total_tokens: int) -> None:
        self.feed, self.rows = feed, rows
        self.max_new_tokens, self.max_total_tokens = max_new_tokens, max_total_tokens
        self.free: list = []

    def rows_of(self, prompts: list) -> list:
        """Per prompt, its completions' rows, in free slots."""
        groups = []
        for prompt in prompts:
            group: list = []
            for j in range(prompt.completions):
                slot = self.free.pop() if self.free else len(self.rows)
                if slot == len(self.rows):
                    self.rows.append(None)
                row = Sequence.of_prompt(prompt.tokens, index=slot, max_new_tokens=self.max_new_tokens,
                                         max_total_tokens=self.max_total_tokens, seed=prompt.seed,
                                         request=prompt.first_request + j, fed_prompt=prompt, group=group)
                self.rows[slot] = row
                group.append(row)
            groups.append(group)
        return groups

    def finished(self, group: list) -> None:
        """Every row of ``group`` (one fed prompt's) has ended: handed to the feed, and their slots freed."""
        self.feed.finished(FinishedPrompt(prompt=group[0].fed_prompt, responses=[r.response for r in group],
                                          logprobs=[r.policy_lp for r in group],
                                          finish_reasons=[r.finish for r in group],
                                          policy_masks=[r.policy_mask for r in group]))
        self.free.extend(row.index for row in group)
