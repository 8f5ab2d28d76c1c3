"""The engine's rows: a ``Sequence`` (prompt, response so far, its KV blocks and log-probs) and a
``SequenceGroup`` (what the scheduler admits at once: the completions of one prompt, or one preempted row).

Torch-free. Test: ``.venv/bin/python -m pytest tests/test_paged_engine.py -q``
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(eq=False)
class Sequence:
    """One row of the engine: a completion of a prompt (a multi-turn row: the whole conversation after it)."""

    index: int
    """The row's slot in the block table (in a call without a feed, its place in the call's prompts)."""
    tokens: list
    """Prompt then response so far."""
    prompt_len: int
    max_len: int
    seed: int = 0
    """Its draws' seed: the call's, or its FedPrompt's."""
    request: int = 0
    """Its draws' counter (``position_draws``): its place in the call's prompts, or in its FedPrompt's order."""
    fed_prompt: Any = None
    """The ``FedPrompt`` it decodes (feed.py), in a session."""
    group: Optional[list] = None
    """A fed prompt's rows (its completions), reported together once all ended."""
    blocks: list = field(default_factory=list)
    """Its KV blocks, in order (the first ones shared with its group while it holds the group's prompt)."""
    cached: int = 0
    """Tokens whose K/V the cache holds; the rest are fed at its next step."""
    admitted: int = -1
    """Admission order: the newest row is preempted first."""
    policy_lp: list = field(default_factory=list)
    sampling_lp: list = field(default_factory=list)
    policy_mask: list = field(default_factory=list)
    """Per response token: 1 when the policy sampled it, 0 for a multi-turn reply's tokens (context)."""
    turn_start: int = 0
    """Where the current policy turn began (the prompt's end, then after each reply)."""
    finish: Optional[str] = None
    reply: Optional[Future] = None
    """Multi-turn: the environment's reply while it is being made; the row keeps its blocks and is neither fed
    nor sampled until it comes."""
    reply_due: int = 0
    """Multi-turn: the step at which ``reply`` joins the row (turns.py ``TurnHandover.reply_steps``)."""
    turn_finish: Optional[str] = None
    """How the turn awaiting its hand-over or ``reply`` ended ("stop" or "length"): the row's finish if the reply
    ends it."""

    @classmethod
    def of_prompt(cls, prompt, *, index: int, max_new_tokens: int, max_total_tokens: int, seed: int, request: int,
                  **more) -> "Sequence":
        """A row decoding ``prompt``: at most ``max_new_tokens`` after it and ``max_total_tokens`` in all."""
        length = len(prompt)
        return cls(index=index, tokens=list(prompt), prompt_len=length, turn_start=length, seed=seed, request=request,
                   max_len=min(length + max_new_tokens, max_total_tokens), **more)

    @property
    def uncached(self) -> int:
        """Tokens its next forward feeds."""
        return len(self.tokens) - self.cached

    @property
    def response(self) -> list:
        return self.tokens[self.prompt_len:]

    def append_sampled(self, token: int, policy_lp: float, sampling_lp: float) -> None:
        self.tokens.append(token)
        self.policy_lp.append(policy_lp)
        self.sampling_lp.append(sampling_lp)
        self.policy_mask.append(1)

    def append_reply(self, reply: list) -> None:
        """A multi-turn reply's tokens, as context (no log-probs, ``policy_mask`` 0); the next turn starts after."""
        if len(self.tokens) + len(reply) >= self.max_len:
            raise ValueError(f"a reply of {len(reply)} tokens leaves row {self.index} no room under its "
                             f"{self.max_len}-token limit: end the episode instead")
        self.tokens.extend(reply)
        self.policy_lp.extend([0.0] * len(reply))
        self.sampling_lp.extend([0.0] * len(reply))
        self.policy_mask.extend([0] * len(reply))
        self.turn_start, self.finish = len(self.tokens), None

    def stop_reason(self, stop_ids: set, stop_sequences: list, max_turn_tokens: Optional[int]) -> Optional[str]:
        """After a sampled token: "stop" (a stop token, or a stop sequence within this turn), "length" (the row's
        or the turn's limit), or None."""
        if self.tokens[-1] in stop_ids or any(
                len(self.tokens) - len(seq) >= self.turn_start and self.tokens[-len(seq):] == seq
                for seq in stop_sequences):
            return "stop"
        if len(self.tokens) >= self.max_len or (max_turn_tokens is not None
                                                and len(self.tokens) - self.turn_start >= max_turn_tokens):
            return "length"
        return None


@dataclass(eq=False)
class SequenceGroup:
    """What admission takes at once: the completions of one prompt (its prompt prefilled once by the first, the
    ``lead``), or one preempted row."""

    rows: list

    @property
    def lead(self) -> Sequence:
        return self.rows[0]

    def blocks_needed(self, block_tokens: int) -> int:
        """The lead's blocks, and a copy of its last, partial block per other member."""
        length = len(self.lead.tokens)
        return -(-length // block_tokens) + (len(self.rows) - 1) * (length % block_tokens != 0)


def group_sequences(rows: list, *, share_prefill: bool) -> list:
    """``rows`` as admission groups: rows with the same tokens together (``share_prefill``), else one each."""
    if not share_prefill:
        return [SequenceGroup(rows=[row]) for row in rows]
    groups: dict = {}
    for row in rows:
        groups.setdefault(tuple(row.tokens), []).append(row)
    return [SequenceGroup(rows=members) for members in groups.values()]


def split_groups(groups: list, parts: int) -> list:
    """``groups`` over ``parts`` lists, each to the part with the fewest rows so far (the first on ties)."""
    split: list = [[] for _ in range(parts)]
    sizes = [0] * parts
    for group in groups:
        i = sizes.index(min(sizes))
        split[i].append(group)
        sizes[i] += len(group.rows)
    return split
