"""Continuous batching on the paged KV cache: rows join as blocks free up, a GRPO group's prompt is prefilled once.

``generate_paged`` decodes every prompt of a ``generate`` call on the training model's own modules through
``PagedContext`` (paged.py). Each engine step is one forward of the rows' new tokens packed together: a row being
prefilled feeds its whole prompt (or, after an eviction, prompt and response so far), a decoding row its last
token; attention runs flash-attn's varlen kernel on mixed steps and its KV-cache kernel on decode-only steps (or
their torch reference, paged_attention.py). Every row then samples one token at its own position.

Memory. The pool has ``kv_memory_bytes`` of blocks (``generation.kv_memory_gib``), or, when that is None, enough
for every row at its longest (nothing is ever evicted). A row takes a block when its tokens reach it and returns
its blocks when it ends, and the next waiting prompt is admitted at once (no waves). A group of completions of the
same prompt is admitted together: its prompt is prefilled once, the full prompt blocks are shared (reference
counted) and only the last, partial block is copied per completion. When a decoding row needs a block and none is
free, the most recently admitted row is evicted (its blocks returned; it waits at the head of the queue and is
prefilled again, prompt and response so far, when blocks free up): a row is never cut short and the engine never
runs out of memory. ``max_concurrent`` stays as an optional cap on the rows decoding at once.

Sampling. Every row draws from ``position_draws(seed, request, position)`` (sampling.py), which depends neither on
the batch around it nor on admission order or evictions; so the tokens equal the static engine's (decoding.py)
at the same seed, and the TP ranks of a replica (which also share TP rank 0's choice) stay in step.

Stopping. With ``stop_requested``, the engine asks every ``STOP_POLL_STEPS`` steps, and a rank that has finished
keeps asking until no rank generates: the question is a collective over ranks whose rollouts end at different
steps. A yes raises ``GenerationStopped`` on every rank at the same question.

Layouts: PP=1 (any TP, DP, CP and SP, which are switched off for the call as in the static engine), dense and MoE
without an expert-parallel lockstep. PP > 1, expert-parallel lockstep, MLA and route recording run the static
engine (``paged_unsupported`` says why).

Test: ``.venv/bin/python -m pytest tests/test_paged_engine.py -q``
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from megatron_rl.generation.paged import BlockPool, PagedContext, attention_layers, megatron_paged_attention
from megatron_rl.generation.paged_attention import kernels as paged_kernels
from megatron_rl.generation.sampling import SamplingParams, StepChoice, choose_tokens, position_draws

STOP_POLL_STEPS = 16
"""Engine steps between two stop questions (each is a collective): a stop is seen within this many decode steps."""

DEFAULT_BLOCK_TOKENS = 256
"""Tokens per KV block: flash-attn's paged kernels need a multiple of 256 (generation.kv_block_tokens)."""


class GenerationStopped(Exception):
    """``generate``'s ``stop_requested`` said yes: the rollout is abandoned (on every rank at the same question)."""


@dataclass(eq=False)
class _Row:
    index: int
    """The request's place in the call's prompts (its output slot and its draws' counter)."""
    tokens: list
    """Prompt then response so far."""
    prompt_len: int
    max_len: int
    blocks: list = field(default_factory=list)
    fed: int = 0
    """Tokens whose K/V the cache holds."""
    admitted: int = -1
    policy_lp: list = field(default_factory=list)
    sampling_lp: list = field(default_factory=list)
    finish: Optional[str] = None


@dataclass(eq=False)
class _Unit:
    """What admission takes: completions of one prompt (prefilled once), or one evicted row."""

    rows: list

    def blocks_needed(self, block_tokens: int) -> int:
        lead = self.rows[0]
        fed_len = len(lead.tokens)
        partial = fed_len % block_tokens != 0
        return -(-fed_len // block_tokens) + (len(self.rows) - 1) * partial


def paged_unsupported(chunks: list, *, record_routes: bool, lockstep) -> Optional[str]:
    """Why the paged engine cannot run this call (None: it can); the static engine runs it then."""
    from megatron.core import parallel_state as ps

    config = chunks[0].config
    if len(chunks) != 1 or ps.get_pipeline_model_parallel_world_size() != 1:
        return "pipeline parallelism (PP or virtual PP > 1)"
    if getattr(config, "multi_latent_attention", False):
        return "multi-latent attention"
    if lockstep.enabled:
        return "expert parallelism across rollout workers (lockstep)"
    if record_routes:
        return "router replay recording"
    if not attention_layers(chunks):
        return "no self-attention layer"
    return None


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
    """Rows whose forward fed more than one token (prompts, and rows prefilled again after an eviction)."""
    steps: int
    """Forwards run."""
    kernels: str


def _stop_hit(row: _Row, stop_ids: set, stop_sequences: list) -> bool:
    if row.tokens[-1] in stop_ids:
        return True
    for seq in stop_sequences:
        if len(row.tokens) - len(seq) >= row.prompt_len and row.tokens[-len(seq):] == seq:
            return True
    return False


def generate_paged(chunks: list, prompts: Sequence[Sequence[int]], *, vocab_size: int, max_new_tokens: int,
                   params: SamplingParams, stop_ids: Sequence[int], stop_sequences: Sequence[Sequence[int]],
                   seed: int, share: Callable[[Optional[StepChoice], int], StepChoice], device: torch.device,
                   kv_memory_bytes: Optional[int] = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                   max_concurrent: Optional[int] = None, share_prompts: bool = True,
                   stop_requested: Optional[Callable[[bool], tuple]] = None) -> tuple[list, PagedStats]:
    """Decode ``prompts``; returns (rows in prompt order, stats). See the module docstring. ``share(choice,
    rows)`` hands TP rank 0's choice to every TP rank; ``stop_requested(generating) -> (stop, anyone
    generating)`` is the stop question (a collective)."""
    if block_tokens < 1:
        raise ValueError(f"generation.kv_block_tokens must be >= 1, got {block_tokens}")
    layers = attention_layers(chunks)
    dtype = chunks[0].config.params_dtype
    block_bytes = BlockPool.block_bytes(layers, block_tokens=block_tokens, dtype=dtype)
    rows = [_Row(index=i, tokens=list(p), prompt_len=len(p), max_len=len(p) + max_new_tokens)
            for i, p in enumerate(prompts)]
    blocks_of = lambda length: -(-length // block_tokens)  # noqa: E731
    longest = max(row.max_len for row in rows)
    if kv_memory_bytes is None:
        num_blocks = sum(blocks_of(row.max_len) for row in rows)
    else:
        num_blocks = int(kv_memory_bytes // block_bytes)
        if num_blocks < blocks_of(longest):
            raise ValueError(f"generation.kv_memory_gib={kv_memory_bytes / 2**30:.4g} holds {num_blocks} KV blocks of "
                             f"{block_tokens} tokens; one completion of {longest} tokens needs {blocks_of(longest)}: "
                             f"raise generation.kv_memory_gib")
    if share_prompts:
        groups: dict = {}
        for row in rows:
            groups.setdefault(tuple(row.tokens), []).append(row)
        waiting = deque(_Unit(rows=members) for members in groups.values())
    else:
        waiting = deque(_Unit(rows=[row]) for row in rows)
    pool = BlockPool(layers, num_blocks=num_blocks, block_tokens=block_tokens, dtype=dtype, device=device)
    context = PagedContext(pool, max_sequence_length=longest, device=device)
    kernels = paged_kernels(device)
    table = torch.zeros((len(rows), blocks_of(longest)), dtype=torch.int32)
    running: list = []
    stop_ids_set = set(stop_ids)
    stop_seqs = [list(s) for s in stop_sequences if len(s)]
    counters = {"admitted": 0, "evictions": 0, "prefills": 0, "peak_blocks": 0, "peak_held": 0, "steps": 0}

    def evict(victim: _Row) -> None:
        pool.release(victim.blocks)
        victim.blocks, victim.fed = [], 0
        running.remove(victim)
        waiting.appendleft(_Unit(rows=[victim]))
        counters["evictions"] += 1

    def grow(row: _Row, length: int) -> bool:
        """Blocks for ``length`` positions of ``row``, evicting the newest rows when none is free; False when
        ``row`` itself had to go."""
        while len(row.blocks) * block_tokens < length:
            block = pool.take()
            if block is None:
                victim = max(running, key=lambda r: r.admitted)
                evict(victim)
                if victim is row:
                    return False
                continue
            table[row.index, len(row.blocks)] = block
            row.blocks.append(block)
        return True

    def admit() -> list:
        fresh = []
        while waiting:
            unit = waiting[0]
            if max_concurrent is not None and running and len(running) + len(unit.rows) > max_concurrent:
                break
            need = unit.blocks_needed(block_tokens)
            if need > pool.num_blocks:  # a group too large for the whole pool: admit its members apart
                waiting.popleft()
                waiting.extendleft(_Unit(rows=[row]) for row in reversed(unit.rows))
                continue
            watermark = len(running) // 16
            if len(pool.free) < need + (watermark if running else 0):
                break
            waiting.popleft()
            lead, members = unit.rows[0], unit.rows[1:]
            for row in unit.rows:
                row.admitted = counters["admitted"]
                counters["admitted"] += 1
                running.append(row)
            grow(lead, len(lead.tokens))
            if len(lead.tokens) % block_tokens:
                for row in members:
                    grow(row, block_tokens)  # the copy of the lead's partial block, taken now
            fresh.append(unit)
        return fresh

    def held_tokens() -> int:
        shared = sum(r - 1 for r in pool.refs if r > 1) * block_tokens
        return sum(row.fed for row in running) - shared

    was_training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        with torch.inference_mode(), megatron_paged_attention(chunks, kernels):
            while waiting or running:
                for row in sorted(running, key=lambda r: r.admitted):
                    if row in running and row.fed < len(row.tokens):
                        grow(row, len(row.tokens))
                fresh = admit()
                if not running:
                    raise RuntimeError("the KV pool could not admit any row")  # excluded by the sizes above
                pending = {id(row) for unit in fresh for row in unit.rows[1:]}
                feeders = [row for row in running if id(row) not in pending and row.fed < len(row.tokens)]
                q_lens = [len(row.tokens) - row.fed for row in feeders]
                kv_lens = [len(row.tokens) for row in feeders]
                ids = torch.tensor([t for row in feeders for t in row.tokens[row.fed:]], dtype=torch.long,
                                   device=device)
                positions = context.set_step(q_lens=q_lens, kv_lens=kv_lens,
                                             tables=table[[row.index for row in feeders]].to(device))
                logits = chunks[0](ids.unsqueeze(0), positions.unsqueeze(0), None, inference_context=context,
                                   runtime_gather_output=True)[0]
                counters["steps"] += 1
                counters["prefills"] += sum(q > 1 for q in q_lens)
                for row in feeders:
                    row.fed = len(row.tokens)
                for unit in fresh:
                    lead = unit.rows[0]
                    full, partial = divmod(len(lead.tokens), block_tokens)
                    for row in unit.rows[1:]:
                        for j, block in enumerate(lead.blocks[:full]):
                            pool.share(block)
                            table[row.index, j] = block
                        own = row.blocks
                        row.blocks = lead.blocks[:full] + own
                        if partial:
                            pool.copy(lead.blocks[full], own[0], partial)
                            table[row.index, full] = own[0]
                        row.fed = len(lead.tokens)
                taken = pool.taken
                if taken > counters["peak_blocks"]:
                    counters["peak_blocks"], counters["peak_held"] = taken, held_tokens()
                # every fed row samples one token; a group's completions sample from its lead's logits
                sampled, source = [], []
                by_lead = {id(unit.rows[0]): unit.rows for unit in fresh}
                for i, row in enumerate(feeders):
                    for member in by_lead.get(id(row), [row]):
                        sampled.append(member)
                        source.append(i)
                race = None
                if not params.greedy:
                    race = position_draws(seed, torch.tensor([r.index for r in sampled], device=device),
                                          torch.tensor([len(r.tokens) for r in sampled], device=device), vocab_size)
                local = None if logits is None else choose_tokens(logits[source], vocab_size=vocab_size,
                                                                  params=params, race=race)
                choice = share(local, len(sampled))
                tokens = choice.tokens.tolist()
                policy = choice.policy_logprobs.tolist()
                sampling = choice.sampling_logprobs.tolist()
                for row, token, lp, slp in zip(sampled, tokens, policy, sampling):
                    row.tokens.append(token)
                    row.policy_lp.append(lp)
                    row.sampling_lp.append(slp)
                    if _stop_hit(row, stop_ids_set, stop_seqs):
                        row.finish = "stop"
                    elif len(row.tokens) >= row.max_len:
                        row.finish = "length"
                    if row.finish is not None:
                        pool.release(row.blocks)
                        row.blocks = []
                        running.remove(row)
                if stop_requested is not None and counters["steps"] % STOP_POLL_STEPS == 0:
                    if stop_requested(True)[0]:
                        raise GenerationStopped(f"stopped after {counters['steps']} engine steps")
        while stop_requested is not None:
            stop, anyone = stop_requested(False)
            if stop:
                raise GenerationStopped(f"stopped after {counters['steps']} engine steps (this worker had finished)")
            if not anyone:
                break
    finally:
        pool.caches.clear()
        for chunk, flag in zip(chunks, was_training):
            chunk.train(flag)
    stats = PagedStats(pool_bytes=num_blocks * block_bytes, block_bytes=block_bytes, block_tokens=block_tokens,
                       peak_blocks=counters["peak_blocks"], peak_held_tokens=counters["peak_held"],
                       evictions=counters["evictions"], prefills=counters["prefills"], steps=counters["steps"],
                       kernels=kernels.name)
    return rows, stats
