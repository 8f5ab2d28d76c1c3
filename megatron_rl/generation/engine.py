"""Continuous batching on the paged KV cache: rows join as blocks free up, a GRPO group's prompt is prefilled once.

``generate_paged`` decodes every prompt of a ``generate`` call on the training model's own modules through
``PagedContext`` (paged.py). Each engine step is one forward of the rows' new tokens packed together: a row being
prefilled feeds its whole prompt (or, after an eviction, prompt and response so far), a decoding row its last
token; attention runs flash-attn's varlen kernel on mixed steps and its KV-cache kernel on decode-only steps (or
their torch reference, paged_attention.py). Every row then samples one token at its own position.

Memory. The pool has ``kv_memory_bytes`` of blocks (``generation.kv_memory_gib``; under PP every stage takes as
many blocks as the stage with the most layers gets, so all stages admit and evict the same rows), or, when that is
None, enough for every row at its longest (nothing is ever evicted). A row takes a block when its tokens reach it and returns
its blocks when it ends, and the next waiting prompt is admitted at once (no waves). A group of completions of the
same prompt is admitted together: its prompt is prefilled once, the full prompt blocks are shared (reference
counted) and only the last, partial block is copied per completion. When a decoding row needs a block and none is
free, the most recently admitted row is evicted (its blocks returned; it waits at the head of the queue and is
prefilled again, prompt and response so far, when blocks free up): a row is never cut short and the engine never
runs out of memory. ``max_concurrent`` stays as an optional cap on the rows decoding at once.

Sampling. Every row draws from ``position_draws(seed, request, position)`` (sampling.py), which depends neither on
the batch around it nor on admission order, evictions or pipeline parts; so the tokens do not depend on the
KV budget, and the TP ranks of a replica (which also share TP rank 0's choice) stay in step.

Sessions. With a ``Feed`` (the async rollout worker's orders) the call runs until the feed ends it: at every stop
question the feed hands in more prompts (``FedPrompt``: its completions' seed and draw counters, so they decode to
the tokens a call of the same prompts would give), which join the part fed the fewest rows while earlier rows
decode; each prompt's completions go to ``Feed.finished`` as soon as all have ended, and their slots are reused.

Stopping. With ``stop_requested``, the engine asks every ``STOP_POLL_STEPS`` steps, and a rank that has finished
keeps asking until no rank generates: the question is a collective over ranks whose rollouts end at different
steps. A yes raises ``GenerationStopped`` on every rank at the same question.

Pipeline parallelism. The rows decode in ``pipeline_microbatches`` parts (pp by default), each a ``_Part`` with its
own share of the KV budget, and successive steps overlap across the stages: a part's next step enters stage 0 as
soon as its tokens are chosen, while the later stages work on the other parts (``_pipelined``). Every stage replays each part's admissions, evictions and choices in the
same order, so every stage knows each forward's token count and its rows' blocks.

Multi-turn. With ``turn_ended`` (or a fed prompt's ``turns``) a row's turn ends at a stop or after
``max_turn_tokens``; the reply's tokens join the row as context, fed at its next step onto its own blocks. Every TP
and PP rank hands the same turns over in the same order, at the part's next ``prepare``, which every rank reaches at
the same point of its walk (under PP the last stage learns a choice a step before the others), so the caller makes
each environment call once per replica and shares its outcome over the replica's ranks (rollout/multi_turn.py
``model_parallel_share``). A reply may be a
``Future``: the row waits for it while the others decode, and a worker whose rows all wait blocks until one replies
(under an expert-parallel lockstep the other workers wait for it at the step's all-reduce); at tp or pp > 1 the
ranks agree at each step which replies came (``settle_replies``).

Decode graphs. With ``cuda_graphs`` a decode-only step (every fed row feeding one token) is padded to a row
bucket, with padding rows on the scratch block, and runs on fixed buffers, replayed from a CUDA graph on a GPU
(graphs.py); mixed steps run eagerly.

Layouts: any TP, PP, virtual PP, DP, CP and SP (SP and CP are switched off for the call, layout.py),
dense and MoE, with route recording (router replay). When the experts span rollout workers (ep > tp with several workers), the
workers step in lockstep: one all-reduce a step agrees on the most tokens any worker feeds and whether any still
generates; a worker with fewer tokens (or none left) adds padding rows that attend within a scratch block, so every
MoE forward exchanges equal token counts. Multi-latent attention caches the latent (paged_mla.py).

Test: ``.venv/bin/python -m pytest tests/test_paged_engine.py -q``
"""

from __future__ import annotations

from collections import deque
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from megatron_rl.generation.graphs import DecodeGraphs
from megatron_rl.generation.paged import BlockPool, PagedContext, attention_layers, megatron_paged_attention
from megatron_rl.generation.paged_attention import kernels as paged_kernels
from megatron_rl.generation.sampling import SamplingParams, StepChoice, choose_tokens, position_keys
from megatron_rl.runtime.distributed import collective_device
from megatron_rl.spec.parallel import cuda_graph_error

STOP_POLL_STEPS = 16
"""Engine steps between two stop questions (each is a collective): a stop is seen within this many decode steps."""

DEFAULT_BLOCK_TOKENS = 256
"""Tokens per KV block: flash-attn's paged kernels need a multiple of 256 (generation.kv_block_tokens)."""


class GenerationStopped(Exception):
    """``generate``'s ``stop_requested`` said yes: the rollout is abandoned (on every rank at the same question)."""


@dataclass(eq=False)
class _Row:
    index: int
    """The row's slot in the block tables (in a call without a feed, its place in the call's prompts)."""
    tokens: list
    """Prompt then response so far."""
    prompt_len: int
    max_len: int
    seed: int = 0
    """Its draws' seed: the call's, or its FedPrompt's."""
    request: int = 0
    """Its draws' counter (``position_draws``): its place in the call's prompts, or in its FedPrompt's order."""
    fed_prompt: Optional["FedPrompt"] = None
    group: Optional[list] = None
    """A fed prompt's rows (its completions), reported together once all ended."""
    blocks: list = field(default_factory=list)
    fed: int = 0
    """Tokens whose K/V the cache holds."""
    admitted: int = -1
    policy_lp: list = field(default_factory=list)
    sampling_lp: list = field(default_factory=list)
    policy_mask: list = field(default_factory=list)
    """Per response token: 1 when the policy sampled it, 0 for a multi-turn reply's tokens (context)."""
    turn_start: int = 0
    """Where the current policy turn began (the prompt's end, then after each reply)."""
    finish: Optional[str] = None
    reply: Optional[Future] = None
    """Multi-turn: the environment's reply while it is being made (``turn_ended`` returned a future); the row keeps
    its blocks and is neither fed nor sampled until it comes."""
    turn_finish: Optional[str] = None
    """How the turn awaiting its hand-over or ``reply`` ended ("stop" or "length"): the row's finish if the reply
    ends it."""


@dataclass(eq=False)
class _Unit:
    """What admission takes: completions of one prompt (prefilled once), or one evicted row."""

    rows: list

    def blocks_needed(self, block_tokens: int) -> int:
        lead = self.rows[0]
        fed_len = len(lead.tokens)
        partial = fed_len % block_tokens != 0
        return -(-fed_len // block_tokens) + (len(self.rows) - 1) * partial


def _padding_rows(tokens: int, block_tokens: int) -> list:
    """Rows of at most ``block_tokens`` padding tokens each (they attend within the scratch block), ``tokens`` in
    all: what a worker adds to a step so that every worker of an expert-parallel lockstep feeds as many."""
    return [block_tokens] * (tokens // block_tokens) + ([tokens % block_tokens] if tokens % block_tokens else [])


@dataclass(frozen=True, kw_only=True)
class PagedStats:
    """What the engine measured, for ``GenerationOutput``."""

    pool_bytes: int
    block_bytes: int
    block_tokens: int
    peak_blocks: int
    """The most blocks rows held at once."""
    peak_held_tokens: int
    """The K/V positions those blocks held at that moment (a block shared by a group counted once)."""
    evictions: int
    prefills: int
    """Rows whose forward fed more than one token (prompts, rows prefilled again after an eviction, replies)."""
    fed_tokens: int
    """Tokens fed to forwards (padding rows of a lockstep left out)."""
    steps: int
    """Forwards run (PP=1), or pipelined steps (PP > 1)."""
    kernels: str
    routes: Optional[list] = None
    """With ``record_routes``: per row, ``[positions, slots, topk]`` int16 on the CPU."""
    graph_steps: int = 0
    """Decode steps run on a decode graph's buffers (graphs.py; replayed from a CUDA graph on a GPU)."""


SettleReplies = Callable[[list, bool], None]
"""``settle_replies(futures, wait)``: the replies awaited (the waiting rows' futures, in one order on every rank of
the replica) made done on every rank or on none, so that all take the same ones at the same step; with ``wait``,
at least one. Needed for ``Future`` replies at tp or pp > 1 (rollout/multi_turn.py ``StepThreads.settle``)."""

TurnEnded = Callable[[int, list, str], "Optional[list] | Future"]
"""Multi-turn generation: ``turn_ended(row index, the turn's tokens, "stop" or "length")`` is called when a row's
turn ends, and returns the tokens to append (the environment's reply, rendered, ending where the policy goes on)
or None to end the row; or a ``concurrent.futures.Future`` of either, while the other rows go on decoding (the row
waits, holding its blocks; its tokens do not depend on when the reply comes: a row's draws are its own); at tp or
pp > 1 only with a ``SettleReplies``: the ranks of a replica must take each reply at the same step."""


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
    ``TurnEnded`` (the completion's place among ``completions`` instead of a row index). None: single turns."""


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
        evictions, prefills, forwards, fed, sampled)."""

    def finished(self, done: FinishedPrompt) -> None:
        """Every completion of ``done.prompt`` has ended (called on every rank)."""


def _stop_hit(row: _Row, stop_ids: set, stop_sequences: list) -> bool:
    if row.tokens[-1] in stop_ids:
        return True
    for seq in stop_sequences:
        if len(row.tokens) - len(seq) >= row.turn_start and row.tokens[-len(seq):] == seq:
            return True
    return False


class _Part:
    """Rows that decode on their own, with their own block pool and context: the whole batch at PP=1, one of
    ``pipeline_parts`` under PP. Every rank replays a part's events (admissions, evictions, choices) in the same
    order, so every rank holds the same rows and feeds the same tokens."""

    def __init__(self, units: list, *, layers: dict, num_blocks: int, block_tokens: int, dtype: torch.dtype,
                 device: torch.device, rows: int, longest: int, lockstep, max_concurrent: Optional[int],
                 counters: dict, recorder, stops: tuple, turn_ended: Optional[TurnEnded] = None,
                 max_turn_tokens: Optional[int] = None, replies_may_wait: bool = True,
                 settle_replies: Optional[SettleReplies] = None,
                 finished: Optional[Callable[[list], None]] = None, positions: Optional[int] = None,
                 cuda_graphs: bool = False) -> None:
        self.block_tokens, self.num_blocks, self.device, self.lockstep = block_tokens, num_blocks, device, lockstep
        padded = lockstep.enabled or cuda_graphs
        self.pool = BlockPool(layers, num_blocks=num_blocks + padded, block_tokens=block_tokens,
                              dtype=dtype, device=device)
        # padding rows (an expert-parallel lockstep's, a decode graph's bucket) write to a block of their own, one
        # past the budget
        self.scratch = self.pool.reserve() if padded else None
        self.context = PagedContext(self.pool, max_sequence_length=max(longest, positions or 0), device=device)
        self.table = torch.zeros((rows, -(-longest // block_tokens)), dtype=torch.int32)
        self.graphs = DecodeGraphs(rows=rows, width=self.table.size(1), device=device) if cuda_graphs else None
        self.graph_bucket: Optional[int] = None
        """The decode graph's bucket this step runs at (None: eagerly)."""
        self.waiting, self.running = deque(units), []
        self.max_concurrent, self.counters, self.recorder = max_concurrent, counters, recorder
        self.stop_ids, self.stop_seqs = stops
        self.turn_ended, self.max_turn_tokens, self.replies_may_wait = turn_ended, max_turn_tokens, replies_may_wait
        self.settle_replies = settle_replies
        self.finished = finished
        self.fed_count = 0
        """Rows a feed added (a count every pipeline stage agrees on when it adds more: rows end on the last stage
        a step before the others learn of it)."""
        self.peak_blocks, self.peak_held = 0, 0
        self.live, self.in_flight, self.awaiting = True, False, False
        self.fresh: list = []
        self.turns_ended: list = []
        """Rows whose turn ended at the last ``record``, handed over at the next ``prepare`` (under PP the last stage
        records a step before the others: handing over there too keeps every rank's environment calls, which
        a replica shares, at the same point of the walk)."""
        self.feeders: list = []
        self.sampled: list = []
        self.source: list = []

    def add(self, units: list) -> None:
        """Fed units join the queue (the table grows to their slots); a part that had run dry goes on."""
        slots = 1 + max(row.index for unit in units for row in unit.rows)
        width = max(-(-row.max_len // self.block_tokens) for unit in units for row in unit.rows)
        if slots > self.table.size(0) or width > self.table.size(1):
            grown = self.table.new_zeros((max(slots, 2 * self.table.size(0)), max(width, self.table.size(1))))
            grown[:self.table.size(0), :self.table.size(1)] = self.table
            self.table = grown
            if self.graphs is not None:  # their buffers have the table's width: captured again
                self.graphs.close()
                self.graphs = DecodeGraphs(rows=grown.size(0), width=grown.size(1), device=self.device)
        self.waiting.extend(units)
        self.fed_count += sum(len(unit.rows) for unit in units)
        self.live = True


    # ------------------------------------------------------------------ memory
    def _evict(self, victim: _Row) -> None:
        self.pool.release(victim.blocks)
        victim.blocks, victim.fed = [], 0
        self.running.remove(victim)
        self.waiting.appendleft(_Unit(rows=[victim]))
        self.counters["evictions"] += 1

    def _grow(self, row: _Row, length: int) -> None:
        """Blocks for ``length`` positions of ``row``, evicting the newest rows (``row`` too, if need be) while
        none is free."""
        while len(row.blocks) * self.block_tokens < length:
            block = self.pool.take()
            if block is None:
                victim = max(self.running, key=lambda r: r.admitted)
                self._evict(victim)
                if victim is row:
                    return
                continue
            self.table[row.index, len(row.blocks)] = block
            row.blocks.append(block)

    def _admit(self) -> list:
        fresh = []
        while self.waiting:
            unit = self.waiting[0]
            if (self.max_concurrent is not None and self.running
                    and len(self.running) + len(unit.rows) > self.max_concurrent):
                break
            need = unit.blocks_needed(self.block_tokens)
            if need > self.num_blocks:  # a group too large for the whole pool: admit its members apart
                self.waiting.popleft()
                self.waiting.extendleft(_Unit(rows=[row]) for row in reversed(unit.rows))
                continue
            watermark = len(self.running) // 16
            if len(self.pool.free) < need + (watermark if self.running else 0):
                break
            self.waiting.popleft()
            lead, members = unit.rows[0], unit.rows[1:]
            for row in unit.rows:
                row.admitted = self.counters["admitted"]
                self.counters["admitted"] += 1
                self.running.append(row)
            self._grow(lead, len(lead.tokens))
            if len(lead.tokens) % self.block_tokens:
                for row in members:
                    self._grow(row, self.block_tokens)  # the copy of the lead's partial block, taken now
            fresh.append(unit)
        return fresh

    # ------------------------------------------------------------------ a step
    def prepare(self) -> bool:
        """Give blocks to the rows that grow, admit waiting ones, and describe the next forward (``ids``,
        ``positions``, the context's step). False when nothing is left to feed (on any worker of a lockstep).
        Multi-turn: the turns that ended are handed over, and replies that came are taken, first; when only rows
        awaiting replies are left, it waits for one."""
        for row in self.turns_ended:
            self._next_turn(row)
        self.turns_ended = []
        wait = False
        while True:
            self._take_replies(wait)
            if not self._prepare_rows() and any(row.reply is not None for row in self.running):
                wait = True
                continue
            break
        return self._describe_step()

    def _prepare_rows(self) -> bool:
        """Grow, admit and pick this step's feeders (not the rows awaiting replies); whether any row is fed."""
        generating = bool(self.waiting or self.running)
        self.fresh, self.feeders = [], []
        if generating:
            for row in sorted(self.running, key=lambda r: r.admitted):
                if row in self.running and row.fed < len(row.tokens):
                    self._grow(row, len(row.tokens))
            self.fresh = self._admit()
            if not self.running:
                raise RuntimeError("the KV pool could not admit any row")  # excluded by the sizes checked
            pending = {id(row) for unit in self.fresh for row in unit.rows[1:]}
            self.feeders = [row for row in self.running if id(row) not in pending and row.fed < len(row.tokens)
                            and row.reply is None]
        return bool(self.feeders)

    def _describe_step(self) -> bool:
        generating = bool(self.waiting or self.running)
        q_lens = [len(row.tokens) - row.fed for row in self.feeders]
        most, anyone = self.lockstep.step_shape(sum(q_lens), generating)
        if not anyone:
            return False
        padding = _padding_rows(most - sum(q_lens), self.block_tokens)
        self.graph_bucket = None
        if self.graphs is not None and q_lens and not padding and max(q_lens) == 1:
            self.graph_bucket = self.graphs.bucket(len(q_lens))
            if self.graph_bucket is not None:
                padding = [1] * (self.graph_bucket - len(q_lens))  # one token each, on the scratch block
        self.q_lens = q_lens
        ids = torch.tensor([t for row in self.feeders for t in row.tokens[row.fed:]] + [0] * sum(padding),
                           dtype=torch.long, device=self.device)
        tables = self.table[[row.index for row in self.feeders]]
        if padding:
            tables = torch.cat([tables, torch.full((len(padding), self.table.size(1)), self.scratch,
                                                   dtype=self.table.dtype)])
        into = None if self.graph_bucket is None else self.graphs.inputs(self.graph_bucket)
        self.positions = self.context.set_step(q_lens=q_lens + padding,
                                               kv_lens=[len(row.tokens) for row in self.feeders] + padding,
                                               tables=tables.to(self.device), into=into)
        self.ids = ids if into is None else into["ids"].copy_(ids)
        # every fed row samples one token; a group's completions sample from its lead's logits
        self.sampled, self.source = [], []
        by_lead = {id(unit.rows[0]): unit.rows for unit in self.fresh}
        for i, row in enumerate(self.feeders):
            for member in by_lead.get(id(row), [row]):
                self.sampled.append(member)
                self.source.append(i)
        self.counters["forwards"] += 1
        self.counters["prefills"] += sum(q > 1 for q in q_lens)
        self.counters["fed"] += sum(q_lens)
        return True

    def forward(self, model) -> torch.Tensor:
        """The step's forward on the one-stage ``model``: the last tokens' logits ``[fed rows (+ padding rows),
        vocab]``, from the bucket's decode graph when the step has one."""
        def run() -> torch.Tensor:
            return model(self.ids.unsqueeze(0), self.positions.unsqueeze(0), None, inference_context=self.context,
                         runtime_gather_output=True)[0]

        if self.graph_bucket is None:
            return run()
        self.counters["graph_steps"] += 1
        return self.graphs.run(self.graph_bucket, run)

    def take_routes(self, chunk: Optional[int] = None) -> None:
        """After a forward (of chunk ``chunk`` only, under virtual pipeline stages): the fed tokens' experts."""
        if self.recorder is None:
            return
        # long even when empty: an expert-parallel lockstep's worker with nothing to feed steps on padding alone
        token_rows = torch.repeat_interleave(torch.tensor([row.index for row in self.feeders], dtype=torch.long,
                                                          device=self.device),
                                             torch.tensor(self.q_lens, device=self.device, dtype=torch.long))
        self.recorder.take_tokens(token_rows, self.positions[:token_rows.numel()], chunk=chunk)

    def choose(self, logits: torch.Tensor, *, params: SamplingParams, vocab_size: int) -> StepChoice:
        """The sampled rows' tokens from the last stage's logits ``[fed rows (+ padding rows), vocab]``."""
        keys = None
        if not params.greedy:  # the rows' position_draws, drawn inside the choice block by block
            keys = position_keys(torch.tensor([r.seed for r in self.sampled], device=self.device),
                                 torch.tensor([r.request for r in self.sampled], device=self.device),
                                 torch.tensor([len(r.tokens) for r in self.sampled], device=self.device))
        return choose_tokens(logits[self.source], vocab_size=vocab_size, params=params, race_keys=keys)

    def record(self, choice: Optional[StepChoice]) -> None:
        """After the forward: the fed rows' K/V are cached, a fresh group's completions take its prompt blocks;
        then the sampled rows take ``choice`` (None when none sampled) and the finished ones return their blocks."""
        pool, block_tokens = self.pool, self.block_tokens
        for row in self.feeders:
            row.fed = len(row.tokens)
        for unit in self.fresh:
            lead = unit.rows[0]
            full, partial = divmod(len(lead.tokens), block_tokens)
            for row in unit.rows[1:]:
                for j, block in enumerate(lead.blocks[:full]):
                    pool.share(block)
                    self.table[row.index, j] = block
                own = row.blocks
                row.blocks = lead.blocks[:full] + own
                if partial:
                    pool.copy(lead.blocks[full], own[0], partial)
                    self.table[row.index, full] = own[0]
                row.fed = len(lead.tokens)
            if self.recorder is not None:
                self.recorder.copy_prefix(lead.index, [row.index for row in unit.rows[1:]], len(lead.tokens))
        self.fresh = []
        if pool.taken > self.peak_blocks:
            shared = sum(r - 1 for r in pool.refs if r > 1) * block_tokens
            self.peak_blocks, self.peak_held = pool.taken, sum(row.fed for row in self.running) - shared
        if choice is None:
            return
        self.counters["sampled"] += len(self.sampled)
        for row, token, lp, slp in zip(self.sampled, choice.tokens.tolist(), choice.policy_logprobs.tolist(),
                                       choice.sampling_logprobs.tolist()):
            row.tokens.append(token)
            row.policy_lp.append(lp)
            row.sampling_lp.append(slp)
            row.policy_mask.append(1)
            if _stop_hit(row, self.stop_ids, self.stop_seqs):
                row.finish = "stop"
            elif len(row.tokens) >= row.max_len or (self.max_turn_tokens is not None
                                                    and len(row.tokens) - row.turn_start >= self.max_turn_tokens):
                row.finish = "length"
            if row.finish is not None and self._turns_of(row) is not None:
                row.turn_finish, row.finish = row.finish, None
                self.turns_ended.append(row)
            if row.finish is not None:
                self._end(row)

    def _end(self, row: _Row) -> None:
        self.pool.release(row.blocks)
        row.blocks = []
        self.running.remove(row)
        if row.group is not None and all(r.finish is not None for r in row.group):
            self.finished(row.group)

    def _take_replies(self, wait: bool = False) -> None:
        """Rows whose environment replied since the last step (``wait``: waiting for one first): the reply joins
        them, or they end. Under ``settle_replies`` the replica's ranks agree which replies came."""
        waiting = [row for row in self.running if row.reply is not None]
        if not waiting:
            return
        if self.settle_replies is not None:
            self.settle_replies([row.reply for row in waiting], wait)
        elif wait:
            futures.wait([row.reply for row in waiting], return_when=futures.FIRST_COMPLETED)
        for row in waiting:
            if row.reply.done():
                reply, row.reply = row.reply.result(), None
                self._reply_came(row, reply)

    def _next_turn(self, row: _Row) -> None:
        """Multi-turn: the environment's reply joins the row as context (fed at the next step onto the row's own
        blocks, no prefill of the conversation again), and the row goes on; or the row ends. A reply still being
        made leaves the row waiting for it (``_take_replies``)."""
        fed = row.fed_prompt
        place = row.index if fed is None or fed.turns is None else row.request - fed.first_request
        reply = self._turns_of(row)(place, row.tokens[row.turn_start:], row.turn_finish)
        if isinstance(reply, Future):
            if not self.replies_may_wait:
                raise NotImplementedError("a multi-turn reply made while rows decode (a Future) at tp or pp > 1 "
                                          "needs settle_replies: the ranks of a replica must take each reply at the "
                                          "same step")
            row.reply = reply
            return
        self._reply_came(row, reply)

    def _reply_came(self, row: _Row, reply: Optional[list]) -> None:
        """The reply joins the row, which goes on; None (or nothing) ends it as its turn ended."""
        row.finish = row.turn_finish
        self._append_reply(row, reply)
        if row.finish is not None:
            self._end(row)

    def _turns_of(self, row: _Row) -> Optional[Callable]:
        """Who takes the row's ended turns: its fed prompt's ``turns``, else the call's ``turn_ended``."""
        if row.fed_prompt is not None and row.fed_prompt.turns is not None:
            return row.fed_prompt.turns
        return self.turn_ended

    def _append_reply(self, row: _Row, reply: Optional[list]) -> None:
        if not reply:
            return
        if len(row.tokens) + len(reply) >= row.max_len:
            raise ValueError(f"a reply of {len(reply)} tokens leaves row {row.index} no room under its "
                             f"{row.max_len}-token limit: end the episode instead")
        row.tokens.extend(reply)
        row.policy_lp.extend([0.0] * len(reply))
        row.sampling_lp.extend([0.0] * len(reply))
        row.policy_mask.extend([0] * len(reply))
        row.turn_start, row.finish = len(row.tokens), None


def _split_units(units: list, parts: int) -> list:
    """Units over ``parts`` lists, each to the part with the fewest rows so far (the first on ties)."""
    split: list = [[] for _ in range(parts)]
    sizes = [0] * parts
    for unit in units:
        i = sizes.index(min(sizes))
        split[i].append(unit)
        sizes[i] += len(unit.rows)
    return split


def generate_paged(chunks: list, prompts: Sequence[Sequence[int]], *, vocab_size: int, max_new_tokens: int,
                   params: SamplingParams, stop_ids: Sequence[int], stop_sequences: Sequence[Sequence[int]],
                   seed: int, chain, device: torch.device, lockstep,
                   kv_memory_bytes: Optional[int] = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                   max_concurrent: Optional[int] = None, share_prompts: bool = True, record_routes: bool = False,
                   stop_requested: Optional[Callable[[bool], tuple]] = None,
                   turn_ended: Optional[TurnEnded] = None, max_turn_tokens: Optional[int] = None,
                   max_total_tokens: Optional[int] = None, feed: Optional[Feed] = None,
                   settle_replies: Optional[SettleReplies] = None, cuda_graphs: bool = False
                   ) -> tuple[list, PagedStats]:
    """Decode ``prompts``; returns (rows in prompt order, stats). See the module docstring. ``chain`` (a
    pipeline.py ``StageChain``) runs forwards across pipeline stages and hands TP rank 0's choice to every rank;
    ``stop_requested(generating) -> (stop, anyone generating)`` is the stop question (a collective).
    ``record_routes``: each row's expert routes go to ``PagedStats.routes`` (``[positions, slots, topk]`` per row,
    the positions a training forward feeds). ``lockstep`` (layout.py ``Lockstep``): when the experts span rollout
    workers, every worker runs the same forwards with the same token count (``_padding_rows``) until no worker
    generates. Under PP the rows decode in ``chain.microbatches`` parts, each with 1/parts of the KV budget.
    Multi-turn (``turn_ended``, any layout; a ``Future`` reply at tp = pp = 1, or with ``settle_replies``): a turn
    ends at a stop or after ``max_turn_tokens``; the reply's tokens are context (``policy_mask`` 0); a row never
    passes ``max_total_tokens`` (prompt, turns and replies).
    With a ``feed`` the call is a session that ends only when the feed raises ``GenerationStopped``: the feed's
    prompts join between steps while earlier rows decode, each prompt's completions are handed to
    ``feed.finished`` as soon as all have ended, and their slots are used again. Without ``kv_memory_bytes`` the
    first prompts' rows at their longest size the pool; every later row must fit it whole. No route recording or
    expert-parallel lockstep in a session; its prompts may bring their own turns (``FedPrompt.turns``).
    ``cuda_graphs``: decode-only steps run padded to a row bucket on fixed buffers, replayed from CUDA graphs on a
    GPU (graphs.py); refused where a graph cannot replay them (``cuda_graph_error``)."""
    if block_tokens < 1:
        raise ValueError(f"generation.kv_block_tokens must be >= 1, got {block_tokens}")
    layers = attention_layers(chunks)
    if not layers:
        raise NotImplementedError("generation needs self-attention layers in the model chunks")
    dtype = chunks[0].config.params_dtype
    if cuda_graphs:
        why = cuda_graph_error(moe=bool(chunks[0].config.num_moe_experts),
                               mla=any(layer.latent for layer in layers.values()), pp=chain.pp_size,
                               staged_tp=device.type == "cuda" and chain.tp_size > 1
                               and torch.distributed.get_backend(chain.tp_group) == "gloo")
        if why is not None:
            raise NotImplementedError(why)
    block_bytes = BlockPool.block_bytes(layers, block_tokens=block_tokens, dtype=dtype)
    if feed is not None and (record_routes or turn_ended is not None or lockstep.enabled):
        raise NotImplementedError("a fed session records no routes and runs no expert-parallel lockstep; its "
                                  "prompts bring their own turns (FedPrompt.turns)")
    cap = max_total_tokens or 1 << 62
    rows = [_Row(index=i, tokens=list(p), prompt_len=len(p), max_len=min(len(p) + max_new_tokens, cap),
                 turn_start=len(p), seed=seed, request=i) for i, p in enumerate(prompts)]
    blocks_of = lambda length: -(-length // block_tokens)  # noqa: E731

    def units_of(rows: list) -> list:
        if not share_prompts:
            return [_Unit(rows=[row]) for row in rows]
        groups: dict = {}
        for row in rows:
            groups.setdefault(tuple(row.tokens), []).append(row)
        return [_Unit(rows=members) for members in groups.values()]

    counters = {"admitted": 0, "evictions": 0, "prefills": 0, "forwards": 0, "fed": 0, "sampled": 0,
                "graph_steps": 0}
    free_slots: list = []

    def fed_rows(fed: list) -> list:
        """The rows of a feed's prompts, in free slots; one list per prompt."""
        groups = []
        for prompt in fed:
            group: list = []
            for j in range(prompt.completions):
                slot = free_slots.pop() if free_slots else len(rows)
                if slot == len(rows):
                    rows.append(None)
                row = _Row(index=slot, tokens=list(prompt.tokens), prompt_len=len(prompt.tokens),
                           max_len=min(len(prompt.tokens) + max_new_tokens, cap), turn_start=len(prompt.tokens),
                           seed=prompt.seed, request=prompt.first_request + j, fed_prompt=prompt, group=group)
                rows[slot] = row
                group.append(row)
            groups.append(group)
        return groups

    def finished(group: list) -> None:
        feed.finished(FinishedPrompt(prompt=group[0].fed_prompt, responses=[r.tokens[r.prompt_len:] for r in group],
                                     logprobs=[r.policy_lp for r in group], finish_reasons=[r.finish for r in group],
                                     policy_masks=[r.policy_mask for r in group]))
        free_slots.extend(row.index for row in group)

    def admit(fed: list) -> None:
        """A feed's prompts join the part that was fed the fewest rows; each row must fit the part's whole pool."""
        for group in fed_rows(fed):
            if blocks_of(group[0].max_len) > min(budgets):
                raise ValueError(f"generation.kv_memory_gib holds {min(budgets)} KV blocks of {block_tokens} tokens; a "
                                 f"completion of {group[0].max_len} tokens needs {blocks_of(group[0].max_len)}: "
                                 f"raise generation.kv_memory_gib")
            for unit in units_of(group):
                min(parts, key=lambda part: part.fed_count).add([unit])

    if feed is None:
        units = units_of(rows)
        longest = max(row.max_len for row in rows)
    else:  # a session: its first prompts give the KV budget, as a call's would
        if rows:
            raise ValueError("a fed session takes its prompts from the feed, not from prompts")
        first: list = []
        while not first:  # a replica may get no prompt of an order
            first = feed.more(False, counters)
        units = [unit for group in fed_rows(first) for unit in units_of(group)]
        longest = max(row.max_len for row in rows)
    # under PP the rows decode in parts; an expert-parallel lockstep wants as many parts on every worker
    count = 1 if chain.pp_size == 1 else chain.microbatches if lockstep.enabled \
        else max(1, min(chain.microbatches, len(units)))
    split = _split_units(units, count)
    if kv_memory_bytes is None:  # a session's first prompts give its budget, as a call's would
        budgets = [max(sum(blocks_of(row.max_len) for unit in part for row in unit.rows),
                       blocks_of(longest) if feed is not None else 0) for part in split]
    else:
        blocks = int(kv_memory_bytes // count // block_bytes)
        if chain.pp_size > 1:  # stages with fewer layers get as many blocks as the fullest: they admit the same rows
            fewest = torch.full((1,), blocks, dtype=torch.long, device=collective_device(chain.pp_group))
            torch.distributed.all_reduce(fewest, op=torch.distributed.ReduceOp.MIN, group=chain.pp_group)
            blocks = int(fewest.item())
        budgets = [blocks] * count
        if budgets[0] < blocks_of(longest):
            raise ValueError(f"generation.kv_memory_gib={kv_memory_bytes / 2**30:.4g} holds {budgets[0]} KV blocks of "
                             f"{block_tokens} tokens" + (f" per pipeline part ({count})" if count > 1 else "") +
                             f"; one completion of {longest} tokens needs {blocks_of(longest)}: "
                             f"raise generation.kv_memory_gib")
    recorder = None
    if record_routes:
        from megatron_rl.models.router_replay import RouteRecorder

        recorder = RouteRecorder(chunks, batch=len(rows), total=longest, device=device)
    stops = (set(stop_ids), [list(s) for s in stop_sequences if len(s)])
    parts = [_Part(units_of_part, layers=layers, num_blocks=budget, block_tokens=block_tokens, dtype=dtype,
                   device=device, rows=len(rows), longest=longest, lockstep=lockstep, max_concurrent=max_concurrent,
                   counters=counters, recorder=recorder, stops=stops, turn_ended=turn_ended,
                   max_turn_tokens=max_turn_tokens, settle_replies=settle_replies,
                   replies_may_wait=(chain.pp_size == 1 and chain.tp_size == 1) or settle_replies is not None,
                   finished=None if feed is None else finished,
                   positions=max_total_tokens if feed is not None else None, cuda_graphs=cuda_graphs)
             for units_of_part, budget in zip(split, budgets)]
    kernels = paged_kernels(device, dtype)
    choose = dict(params=params, vocab_size=vocab_size)
    steps = 0

    def poll(steps: int) -> None:
        """After engine step ``steps``: the stop question, and a feed's next prompts, every STOP_POLL_STEPS steps."""
        if steps % STOP_POLL_STEPS:
            return
        if stop_requested is not None and stop_requested(True)[0]:
            raise GenerationStopped(f"stopped after {steps} engine steps")
        if feed is not None:
            admit(feed.more(True, counters))

    def dry() -> bool:
        """Nothing left to feed: True to go on (a feed's next prompts admitted), False when the call is done."""
        if feed is None:
            return False
        admit(feed.more(False, counters))
        return True

    was_training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        # no_grad, not inference_mode: a module's state first made here (Transformer Engine's lazily made
        # buffers) would be an inference tensor, which the next training step may not update in place
        with torch.no_grad(), megatron_paged_attention(chunks, kernels):
            if chain.pp_size == 1:
                part = parts[0]
                while True:
                    if not part.prepare():
                        if dry():  # a feed's prompts came: admitted at the next prepare
                            continue
                        break
                    logits = part.forward(chunks[0])
                    part.take_routes()
                    part.record(chain.share(part.choose(logits, **choose), len(part.sampled))
                                if part.sampled else None)
                    steps += 1
                    poll(steps)
            else:
                steps = _pipelined(chain, parts, choose=choose, poll=poll, dry=dry)
        while stop_requested is not None:
            stop, anyone = stop_requested(False)
            if stop:
                raise GenerationStopped(f"stopped after {steps} engine steps (this worker had finished)")
            if not anyone:
                break
        routes = None if recorder is None else recorder.rows([len(row.tokens) - 1 for row in rows])
    finally:
        if recorder is not None:
            recorder.close()
        for part in parts:
            if part.graphs is not None:
                part.graphs.close()
            part.pool.caches.clear()
        for chunk, flag in zip(chunks, was_training):
            chunk.train(flag)
    stats = PagedStats(pool_bytes=sum(budgets) * block_bytes, block_bytes=block_bytes, block_tokens=block_tokens,
                       peak_blocks=sum(part.peak_blocks for part in parts),
                       peak_held_tokens=sum(part.peak_held for part in parts), evictions=counters["evictions"],
                       prefills=counters["prefills"], fed_tokens=counters["fed"], steps=counters["forwards"] if count == 1 else steps,
                       kernels=kernels.name, routes=routes, graph_steps=counters["graph_steps"])
    return rows, stats


def _pipelined(chain, parts: list, *, choose: dict, poll: Callable[[int], None], dry: Callable[[], bool]) -> int:
    """Steps of ``parts`` decoding on their own across the pipeline stages, successive steps overlapping
    (pipeline.py ``StageChain``): every rank walks (step, virtual stage, part); a part's step enters stage 0's first
    virtual stage once its previous choice is known there (the last stage sends each choice to every
    stage). Returns the steps run."""
    virtual = len(chain.chunks)
    steps, sends = 0, []
    try:
        while True:
            earlier, sends = sends, []
            fed_any = False
            for v in range(virtual):
                for part in parts:
                    if v == 0:
                        if part.awaiting:
                            part.record(chain.receive_choice(len(part.sampled)))
                            part.awaiting = False
                        part.in_flight = part.live and part.prepare()
                        part.live = part.in_flight
                    if not part.in_flight:
                        continue
                    fed_any = True
                    logits = chain.chunk_forward(v, part.ids.unsqueeze(0), part.positions.unsqueeze(0), sends,
                                                 context=part.context)
                    part.take_routes(chunk=v)
                    if v < virtual - 1:
                        continue
                    if not part.sampled:
                        part.record(None)
                    elif chain.is_last_stage:
                        part.record(chain.send_choice(part.choose(logits, **choose), sends))
                    else:
                        part.awaiting = True
            for handle, _ in earlier:  # received by now: every rank has moved past the previous step
                handle.wait()
            if not fed_any:
                if dry():
                    continue
                return steps
            steps += 1
            try:
                poll(steps)
            except GenerationStopped:
                # the last stage's choices of this step are on their way to the others: taken (and dropped) here,
                # its sends complete, and no stale choice waits on a channel for a later call
                for part in parts:
                    if part.awaiting:
                        chain.receive_choice(len(part.sampled))
                        part.awaiting = False
                raise
    finally:
        for handle, _ in sends:
            handle.wait()
