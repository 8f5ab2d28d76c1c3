"""The decode loop's rows: the token buffer and log-probs, stops, finished rows, and compaction of the KV cache.

``DecodeRows`` holds one ``generate`` call's per-row state; ``part(start, stop)`` is a contiguous share of it that
writes through to the whole (the pipelined decode of pipeline.py gives each of its parts one). A ``Feed`` is rows
that decode together: which of them are still fed, and the stop checks that end or compact it. ``record`` writes
one step's choice and ends the rows that stopped or reached their length; every rank of a replica records the
same choices, so every rank holds the same state and reaches the same decisions (when to compact, when to stop)
without talking.

Compaction: once at most 3/4 of the fed rows are still running (``worth_compacting``), the live rows' cache rows
move to the front of their slots (``compacted_rows``) and later steps feed only them. On a GPU the host looks at
the finished rows every ``STOP_CHECK_EVERY_GPU`` steps (each look is a device sync; rows that finished in
between just stop writing) and compacts to multiples of ``ROW_BUCKET_GPU`` rows, so decode steps come in few
shapes.

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_rl.generation.sampling import StepChoice


class Stops:
    """Stop tokens and multi-token stop sequences, checked on the token just written at position t."""

    def __init__(self, stop_token_ids: Sequence[int], stop_sequences: Sequence[Sequence[int]],
                 device: torch.device) -> None:
        self.token_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
        self.sequences = [torch.tensor(list(s), dtype=torch.long, device=device) for s in stop_sequences if len(s)]

    def hit(self, tokens: torch.Tensor, t: int, prompt_lens: torch.Tensor) -> Optional[torch.Tensor]:
        """[batch] bool: the response of a row ends at position t with a stop token or sequence."""
        hit = torch.isin(tokens[:, t], self.token_ids) if self.token_ids.numel() else None
        for seq in self.sequences:
            start = t - seq.numel() + 1
            if start < 0:
                continue
            match = (tokens[:, start:t + 1] == seq).all(dim=-1) & (prompt_lens <= start)
            hit = match if hit is None else hit | match
        return hit


@dataclass(frozen=True, kw_only=True)
class DecodeRows:
    """Per-row decode state, ``[rows, total positions]`` buffers; updated in place only."""

    tokens: torch.Tensor
    """Prompt then response tokens, ``pad_id`` after a row's end."""
    policy_lp: torch.Tensor
    sampling_lp: torch.Tensor
    prompt_lens: torch.Tensor
    end: torch.Tensor
    """Exclusive end position of each row's response."""
    done: torch.Tensor
    stopped: torch.Tensor
    """The row ended with a stop token or sequence (else at its length)."""
    stops: Stops

    @classmethod
    def new(cls, prompts: Sequence[Sequence[int]], *, total: int, max_new_tokens: int, pad_id: int,
            stops: Stops, device: torch.device) -> "DecodeRows":
        batch = len(prompts)
        tokens = torch.full((batch, total), pad_id, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
        prompt_lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        return cls(tokens=tokens, policy_lp=torch.zeros((batch, total), dtype=torch.float32, device=device),
                   sampling_lp=torch.zeros((batch, total), dtype=torch.float32, device=device),
                   prompt_lens=prompt_lens, end=prompt_lens + max_new_tokens,
                   done=torch.zeros(batch, dtype=torch.bool, device=device),
                   stopped=torch.zeros(batch, dtype=torch.bool, device=device), stops=stops)

    @property
    def size(self) -> int:
        return self.done.numel()

    def part(self, start: int, stop: int) -> "DecodeRows":
        """Rows ``start:stop``, sharing this state's tensors."""
        rows = slice(start, stop)
        return DecodeRows(tokens=self.tokens[rows], policy_lp=self.policy_lp[rows], sampling_lp=self.sampling_lp[rows],
                          prompt_lens=self.prompt_lens[rows], end=self.end[rows], done=self.done[rows],
                          stopped=self.stopped[rows], stops=self.stops)

    def record(self, choice: StepChoice, t: int) -> None:
        """Write the tokens chosen at position ``t`` (one per row; rows still in their prompt or finished keep
        theirs) and end the rows that stop there or reach their length."""
        writing = (self.prompt_lens <= t) & ~self.done
        self.tokens[:, t] = torch.where(writing, choice.tokens, self.tokens[:, t])
        self.policy_lp[:, t] = torch.where(writing, choice.policy_logprobs, 0.0)
        self.sampling_lp[:, t] = torch.where(writing, choice.sampling_logprobs, 0.0)
        hit = self.stops.hit(self.tokens, t, self.prompt_lens)
        if hit is not None:
            hit = hit & writing
            self.stopped.logical_or_(hit)
            self.end.copy_(torch.where(hit, t + 1, self.end))
        self.done.logical_or_(writing & (self.end <= t + 1))

    def responses(self) -> dict:
        """``GenerationOutput``'s per-row lists: tokens, logprobs, sampling_logprobs, lengths, finish_reasons."""
        ends, starts = self.end.tolist(), self.prompt_lens.tolist()
        cut = lambda tensor: [row[s:e] for row, s, e in zip(tensor.tolist(), starts, ends)]  # noqa: E731
        return dict(tokens=cut(self.tokens), logprobs=cut(self.policy_lp), sampling_logprobs=cut(self.sampling_lp),
                    lengths=[e - s for s, e in zip(starts, ends)],
                    finish_reasons=["stop" if f else "length" for f in self.stopped.tolist()])


def copy_cache_rows(context, expand: torch.Tensor, *, positions: int, offset: int = 0) -> None:
    """Cache slot ``offset + i`` of every layer (``[sequence, batch, ...]``) becomes a copy of slot
    ``offset + expand[i]``, over the first ``positions`` positions: a shared prefill fanned out to the rows that
    share it, or a part's live rows moved to the front of its slots."""
    batch = expand.numel()
    for memory in context.key_value_memory_dict.values():
        for tensor in memory:
            tensor[:positions, offset:offset + batch] = tensor[:positions, offset:].index_select(1, expand)


@dataclass(kw_only=True)
class Feed:
    """Rows that decode together in cache slots ``offset`` on (the whole batch at PP=1, a part of it under PP,
    pipeline.py): records each step's choice and, at the stop checks, ends when none runs or drops the finished
    ones from the feed (compaction)."""

    rows: DecodeRows
    offset: int = 0
    active: Optional[torch.Tensor] = None
    """The rows still fed (indices into ``rows``, in slot order) once finished ones were compacted away."""
    live: bool = True
    compactions: int = 0

    @property
    def fed_rows(self) -> int:
        return self.rows.size if self.active is None else self.active.numel()

    def fed(self) -> torch.Tensor:
        """Indices into ``rows`` of the rows fed, in slot order."""
        return torch.arange(self.rows.size, device=self.rows.done.device) if self.active is None else self.active

    def record(self, choice: StepChoice, t: int, *, check: bool, lockstep, compact: bool, context,
               total: int) -> None:
        """Record the fed rows' choice at position ``t``; at a stop check (``check``), end when no row runs
        (``lockstep.running``: the count every expert-parallel replica agrees on) or compact when
        ``worth_compacting``."""
        if self.active is not None:
            choice = choice.scattered(self.active, self.rows.size)
        self.rows.record(choice, t)
        if not check:
            return
        running = lockstep.running(self.rows.done)
        if running == 0:
            self.live = False
            return
        keep = min(self.fed_rows, row_bucket(running, self.rows.done.device))
        if compact and worth_compacting(self.fed_rows, keep, steps_left=total - 1 - t):
            self.active = compacted_rows(context, self.rows.done, self.active, keep, positions=t, offset=self.offset)
            self.compactions += 1


STOP_CHECK_EVERY_GPU = 8
"""Decode steps between the host's looks at the finished rows on a GPU (each look is a device sync)."""
ROW_BUCKET_GPU = 8
"""On a GPU the compacted batch is a multiple of this many rows, so decode steps come in few shapes."""


def stop_check_interval(device: torch.device) -> int:
    return STOP_CHECK_EVERY_GPU if device.type == "cuda" else 1


def row_bucket(running: int, device: torch.device) -> int:
    """Rows to keep feeding for ``running`` live ones: exact on the CPU, rounded up to ROW_BUCKET_GPU on a GPU."""
    if device.type != "cuda":
        return running
    return -(-running // ROW_BUCKET_GPU) * ROW_BUCKET_GPU


COMPACT_MIN_ROWS = 8
"""Fewer fed rows than this are never compacted: the saving is below the bookkeeping it adds to every step."""
COMPACT_MIN_STEPS_LEFT = 8
"""Nor with fewer decode steps left than this (the default job's 4-token responses never compact)."""


def worth_compacting(fed: int, keep: int, *, steps_left: int) -> bool:
    """Compact when at most 3/4 of the ``fed`` rows would be kept (and two or more can go), at least
    COMPACT_MIN_ROWS are fed and COMPACT_MIN_STEPS_LEFT steps remain: at most ~2.4 ln(batch) compactions, each a
    copy of the kept cache rows, against the dropped rows' share of every later step."""
    return (keep <= (3 * fed) // 4 and fed - keep >= 2 and fed >= COMPACT_MIN_ROWS
            and steps_left >= COMPACT_MIN_STEPS_LEFT)


def compacted_rows(context, done: torch.Tensor, active: Optional[torch.Tensor], running: int, *,
                   positions: int, offset: int = 0) -> torch.Tensor:
    """The rows to feed from now on: those of ``active`` (None: every row of ``done``) not ``done``, padded with
    finished ones up to ``running`` (an expert-parallel lockstep wants the busiest worker's row count on every
    worker; a GPU a bucketed row count). Their cache rows (slots ``offset`` on) move to the front, in that order,
    over the first ``positions`` positions."""
    batch = done.numel()
    current = torch.arange(batch, device=done.device) if active is None else active
    live = current[~done[current]]
    if live.numel() < running:
        live = torch.cat([live, current[done[current]][:running - live.numel()]])
    slot = torch.empty(batch, dtype=torch.long, device=done.device)
    slot[current] = torch.arange(current.numel(), device=done.device)
    copy_cache_rows(context, slot[live], positions=positions, offset=offset)
    return live
