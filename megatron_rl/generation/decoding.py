"""Colocated generation: decode with the training model's own modules and Megatron's static KV cache.

``generate(models, prompts, vocab_size=..., max_new_tokens=...)`` runs on the very ``GPTModel`` objects the
trainer optimises (DDP wrappers are looked through): no weight copy, no second engine.

Layout. Sequences are left-aligned in one ``[batch, longest prompt + max_new_tokens]`` buffer, at the same
positions as in the training forward of ``prompt + response`` (right padding, positions from 0). The batch's
shortest prompt is prefilled in one forward; every later step feeds one token per row. A row still inside its
own prompt is fed its prompt token (teacher forcing, as Megatron's ``TextGenerationController`` does), so no
attention mask is ever needed: prefill is plainly causal and decode attends to the whole cache. Left padding
would instead need a padding mask, which Transformer Engine's causal / no-mask kernels ignore during
inference, so it would be silently wrong on GPUs. The price is one decode step per token of prompt-length
spread; ``generate`` is fastest on batches of similar prompt lengths (GRPO groups share a prompt).

Shared prefill. Rows whose prefilled prefix is the same (a GRPO group's ``group_size`` completions of one prompt,
or prompts that start alike) are prefilled once: the prefill forward runs the distinct prefixes only, and every
layer's cache rows and the last logits are then copied to the rows that share them (``copy_cache_rows``), so
the sampled distribution and the random stream are those of prefilling every row (``share_prefill=False``).
On the default job it cuts generation time by 30% (15.3 -> 10.5 ms a step) with the same 300 rewards.

Cache. ``megatron.core.inference.contexts.StaticInferenceContext`` sized ``[batch, longest sequence]``; it is
released (and the release checked) before ``generate`` returns, so training never runs next to a cache.
Finished rows stop growing (their tokens stay ``pad_id``); decoding stops when every row has finished.
``max_concurrent`` caps the rows (and so the cache) by generating the prompts in consecutive waves.

Compaction. Once at most 3/4 of the fed rows are still running, the finished ones leave the decode batch: the
live rows' cache rows move to the front and later steps feed only them (rows.py). Every row's random draws are
made for the whole batch and indexed (``StepDraws``), so tokens, log-probs and finish reasons are those of the
static batch. On a GPU the host looks at the finished rows every few steps and compacts to bucketed row counts.

Why not Megatron's dynamic engine. ``DynamicInferenceContext`` (paged KV cache, requests joining and leaving,
CUDA graphs per batch bucket) is what continuous batching wants, but it allocates on ``torch.cuda`` at
construction and its attention needs the flash-decode kernels, so it cannot run, or be tested, on the CPU path
that CI runs; its ``TextGenerationController`` and static engine decode a fixed batch, as this loop did before
compaction. This module keeps Megatron's static context and the training modules (no weight copy) and adds the
compaction, shared prefill and pipelined decode itself. CUDA-graph capture of the decode step is not done: the
lean step's shapes are static per row bucket, but capturing it needs a device to verify it on.

Parallelism.
* TP: logits are gathered over the vocabulary (``runtime_gather_output``), every TP rank draws with the same
  generator, and the chosen tokens are also broadcast from TP rank 0 so that the ranks cannot drift apart.
* PP (and virtual PP): the prefill goes through the stages in ``pipeline_microbatches`` parts (pipeline.py
  ``StageChain.forward``); the decode steps then run in that many parts decoding on their own
  (``pipelined_decode``), so successive steps overlap: part m's step t + 1 enters stage 0 while the later stages
  still work on the other parts' step t. The last stage picks the tokens and sends them (with their log-probs)
  to every stage. The default is pp parts; bench/pipeline_decode.py measures them against the stages in turn.
* DP: each data-parallel rank generates for the prompts it is given; no collective crosses DP ranks, except
  for MoE models at ep > 1 (below).
* SP and CP: switched off for the call (layout.py ``whole_sequences``): a decode step has one token per row,
  and CP ranks hold full weights, so each CP rank decodes whole sequences of its own prompts, like a DP rank
  (``data_parallel_seed`` gives each its own sampling stream).
* EP: an MoE forward exchanges tokens between the ranks that share experts, which span DP replicas (and CP
  ranks) when ep > tp. Those replicas agree on the prefill length and the buffer width, and decode until every
  replica's rows are done (layout.py ``Lockstep``; under PP per part); rows that finished early just stop
  growing.

Speed. Decoding runs under ``torch.inference_mode``. Megatron keeps a few tensors made during a forward
(rotary tables in an ``lru_cache``, the attention scratch buffer); inference tensors left there would break
the next backward pass (e.g. Transformer Engine's fused RoPE saves the cached table), so those caches are
emptied on the way out. While generating, the local spec's core attention runs as one SDPA call and decode
steps rotate only the new token's query and key (Megatron's flash-decode hook), see attention.py;
``fast_attention=False`` keeps Megatron's path unchanged. After the prefill, decode steps of dense local-spec
models at PP=1 (any TP) skip the modules altogether: ``LeanDecoder`` (lean_decode.py) computes the same maths
from the same parameters and cache, without the per-module Python overhead (``fast_decode=False``, or
``fast_attention=False``, keeps the module path; ``GenerationOutput.decode_path`` says which ran). Dropout is
off (modules in eval mode, restored afterwards).

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q``
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from megatron_rl.generation.attention import BATCH_MAJOR_MIN_NEW_TOKENS, RopeOnceDecode, sdpa_core_attention
from megatron_rl.generation.engine import DEFAULT_BLOCK_TOKENS, GenerationStopped, generate_paged, paged_unsupported
from megatron_rl.generation.layout import Lockstep, whole_sequences
from megatron_rl.generation.lean_decode import LeanDecoder, lean_decode_unsupported
from megatron_rl.generation.pipeline import StageChain, pipelined_decode
from megatron_rl.generation.rows import DecodeRows, Feed, Stops, copy_cache_rows, stop_check_interval
from megatron_rl.generation.sampling import SamplingParams, StepChoice, StepDraws, choose_tokens, draw_seed
from megatron_rl.models import unwrap


@dataclass(frozen=True, kw_only=True)
class GenerationOutput:
    """Responses of one ``generate`` call, in prompt order; identical on every TP/PP rank."""

    tokens: list[list[int]]
    """Response token ids per prompt (prompt excluded; a final stop token or stop sequence included)."""
    logprobs: list[list[float]]
    """Per response token: log-prob under the policy at temperature 1 (raw logits, padded vocabulary),
    the same quantity as the training forward's ``-cross_entropy``."""
    sampling_logprobs: list[list[float]]
    """Per response token: log-prob under the distribution it was drawn from (temperature/top-k/top-p);
    0.0 for greedy decoding."""
    lengths: list[int]
    """Response lengths (len of each ``tokens`` row)."""
    finish_reasons: list[str]
    """"stop" (eos, stop token or stop sequence generated) or "length" (max_new_tokens reached)."""
    forward_passes: int
    """Model forwards run (1 prefill + decode steps)."""
    prefill_rows: int
    """Rows the prefill forward ran: fewer than the prompts when rows shared their prefix (``share_prefill``)."""
    compactions: int
    """Times finished rows were dropped from the decode batch (``compact``)."""
    kv_cache_bytes: int
    """Bytes the KV cache held on this rank; released before ``generate`` returned."""
    decode_attention: str
    """Attention path used: "megatron" (unchanged modules) or "+"-joined fast paths: "sdpa", "rope-once",
    "batch-major" (the cache layout, attention.py)."""
    decode_path: str
    """How decode steps ran: "lean" (``LeanDecoder`` on the parameters) or "modules" (``GPTModel.forward``)."""
    engine: str = "static"
    """Which engine ran: "paged" (engine.py: block pool, continuous admission) or "static" (this module)."""
    kv_block_tokens: int = 0
    """Paged engine: tokens per KV block."""
    kv_peak_blocks: int = 0
    """Paged engine: the most KV blocks rows held at once."""
    kv_peak_held_tokens: int = 0
    """Paged engine: the K/V positions those blocks held then (blocks shared by a group counted once)."""
    evictions: int = 0
    """Paged engine: rows evicted for want of blocks (and prefilled again later)."""
    routes: Optional[list[torch.Tensor]] = None
    """With ``record_routes``: per prompt, the experts every MoE layer of this rank's chunks routed each position
    of prompt + response to, but the last (the positions a training forward feeds), as ``[positions, slots,
    topk]`` int16 on the CPU (megatron_rl/models/router_replay.py)."""


def data_parallel_seed(seed: int) -> int:
    """A sampling seed distinct per rollout worker (data-parallel rank, and context-parallel rank: each CP rank
    generates its own sequences) and equal across the TP/PP ranks of one worker."""
    from megatron.core import parallel_state

    return seed + parallel_state.get_data_parallel_rank(with_context_parallel=True)


def model_chunks(models) -> list:
    """The ``GPTModel`` chunks of ``models`` (one model, a DDP wrapper, an Engine's chunk list)."""
    if isinstance(models, (list, tuple)):
        return [unwrap(m) for m in models]
    return [unwrap(models)]


def check_generation_layout(chunks: list) -> None:
    """Raise ``NotImplementedError`` for model settings generation does not handle (every parallel layout
    the trainers build is handled: SP and CP are switched off for the call, EP decodes in lockstep)."""
    config = chunks[0].config
    if getattr(config, "flash_decode", False):
        raise NotImplementedError("generation switches config.flash_decode itself for its decode steps; build the "
                                  "model with flash_decode=False")


class _KVCache:
    """A ``StaticInferenceContext`` whose tensors are dropped, and checked to be freed, on exit."""

    def __init__(self, batch: int, max_sequence_length: int) -> None:
        from megatron.core.inference.contexts import StaticInferenceContext

        self.context = StaticInferenceContext(batch, max_sequence_length)
        self.nbytes = 0

    def __enter__(self):
        return self.context

    def __exit__(self, *exc) -> None:
        memory = self.context.key_value_memory_dict
        refs = [weakref.ref(t) for pair in memory.values() for t in pair]
        self.nbytes = sum(t.numel() * t.element_size() for pair in memory.values() for t in pair)
        memory.clear()
        self.context = None
        if exc[0] is None and any(ref() is not None for ref in refs):
            raise RuntimeError("the KV cache is still referenced after generation; it would stay allocated "
                               "during training")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def drop_inference_tensors_from_megatron_caches(chunks: list) -> None:
    """Forget tensors Megatron cached during an inference-mode forward, so training recomputes them."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for chunk in chunks:
        getattr(chunk, "rotary_pos_emb_cache", {}).clear()
    RotaryEmbedding.forward.cache_clear()
    try:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
        YarnRotaryEmbedding.forward.cache_clear()
    except (ImportError, AttributeError):
        pass
    scratch = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    for name, tensor in list(getattr(scratch, "buffer", {}).items()):
        if isinstance(tensor, torch.Tensor) and tensor.is_inference():
            del scratch.buffer[name]


def shared_prefill_rows(prefix: torch.Tensor,
                        lockstep: Lockstep) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(rows to prefill, for every row the index of its source among them) when rows of ``prefix`` [batch,
    prefill length] repeat, else (None, None). Under an expert-parallel lockstep every worker prefills the same
    number of rows (the most any worker needs; the extra ones repeat its first), since the token exchange of an
    MoE forward wants equal shapes."""
    unique, expand = torch.unique(prefix, dim=0, return_inverse=True)
    first = torch.full((unique.size(0),), prefix.size(0), dtype=torch.long, device=prefix.device)
    first.scatter_reduce_(0, expand, torch.arange(prefix.size(0), device=prefix.device), reduce="amin")
    count = lockstep.max_over_workers(first.numel())
    if count == prefix.size(0):
        return None, None
    sources = torch.cat([first, first[:1].expand(count - first.numel())])
    return sources, expand


def _joined(waves: list[GenerationOutput]) -> GenerationOutput:
    """One output of consecutive waves of prompts, in prompt order."""
    rows = lambda name: [row for wave in waves for row in getattr(wave, name)]  # noqa: E731
    return GenerationOutput(
        tokens=rows("tokens"), logprobs=rows("logprobs"), sampling_logprobs=rows("sampling_logprobs"),
        lengths=rows("lengths"), finish_reasons=rows("finish_reasons"),
        forward_passes=sum(w.forward_passes for w in waves), kv_cache_bytes=max(w.kv_cache_bytes for w in waves),
        prefill_rows=sum(w.prefill_rows for w in waves), compactions=sum(w.compactions for w in waves),
        decode_attention=waves[0].decode_attention, decode_path=waves[0].decode_path,
        routes=None if waves[0].routes is None else rows("routes"))


def generate(models, prompts: Sequence[Sequence[int]], *, vocab_size: int, max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_id: Optional[int] = None,
             stop_token_ids: Sequence[int] = (), stop_sequences: Sequence[Sequence[int]] = (),
             seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
             pad_id: int = 0, fast_attention: bool = True, fast_decode: bool = True,
             record_routes: bool = False, share_prefill: bool = True, compact: bool = True,
             max_concurrent: Optional[int] = None, pipeline_microbatches: Optional[int] = None,
             batch_major_cache: Optional[bool] = None, first_row: int = 0,
             engine: Optional[str] = None, kv_memory_gib: Optional[float] = None,
             kv_block_tokens: int = DEFAULT_BLOCK_TOKENS,
             stop_requested: Optional[Callable[[bool], tuple]] = None) -> GenerationOutput:
    """Generate a response for every prompt with the KV cache; see the module docstring for the layout.

    ``vocab_size`` is the real (unpadded) vocabulary: ids at or above it are never generated. A response ends
    after ``eos_id``, any of ``stop_token_ids`` or any of ``stop_sequences`` (kept in the response), or after
    ``max_new_tokens``. Sampling draws from ``generator`` or, if None, a fresh one seeded with ``seed`` (0
    when None); pass the same seed on every TP/PP rank of a replica (``data_parallel_seed`` makes one).
    ``fast_attention=False`` keeps Megatron's attention path unchanged (see attention.py) and implies
    ``fast_decode=False``; ``fast_decode=False`` runs every decode step through the modules instead of
    ``LeanDecoder`` (which is also skipped, silently, for layouts it does not reproduce: PP > 1, MoE, TE, ...).
    ``record_routes``: also return each sequence's expert routes (``GenerationOutput.routes``; an MoE model
    built with router replay). ``share_prefill``: rows whose prefilled prefix is the same (a GRPO group's
    completions of one prompt) are prefilled once and the cache rows copied (``shared_prefill_rows``); False
    prefills every row. ``compact``: drop finished rows from the decode batch (``worth_compacting``); False
    feeds every row until the last one finishes. ``max_concurrent`` (generation.max_concurrent): decode at most
    this many prompts at once, in consecutive waves, so the KV cache holds that many rows (the planner counts
    the same cap); ``stop_requested`` is asked before every wave after the first (every rank asks at the same
    points, so it may be a collective) and a yes raises ``GenerationStopped``. ``pipeline_microbatches`` (default
    pp): under PP, the parts the rows decode in, each on its own, so that the stages work at once (pipeline.py);
    1 runs the stages one after another. ``batch_major_cache``: the KV cache layout of the layers attending by
    SDPA (attention.py); None: batch-major for decodes of ``BATCH_MAJOR_MIN_NEW_TOKENS`` or more new tokens.
    Returns on every rank of the model-parallel group.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. a BOS token)")
    chunks = model_chunks(models)
    check_generation_layout(chunks)
    device = next(chunks[0].parameters()).device
    lockstep = Lockstep(chunks, device)
    batch = len(prompts)
    shortest, longest = lockstep.shape(batch, min(len(p) for p in prompts), max(len(p) for p in prompts))
    total = longest + max_new_tokens
    max_positions = getattr(chunks[0], "max_sequence_length", None)
    if max_positions is not None and total > max_positions:
        raise ValueError(f"longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                         f"model's max_position_embeddings ({max_positions})")
    if any(t >= vocab_size or t < 0 for p in prompts for t in p):
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    seed = draw_seed(seed, generator)
    if engine not in (None, "paged", "static"):
        raise ValueError(f"engine must be 'paged' or 'static', got {engine!r}")
    unsupported = paged_unsupported(chunks, record_routes=record_routes, lockstep=lockstep)
    if engine == "paged" and unsupported is not None:
        raise NotImplementedError(f"the paged engine does not run {unsupported} yet; use engine='static'")
    if engine is None and unsupported is None or engine == "paged":
        return _generate_paged(chunks, prompts, vocab_size=vocab_size, max_new_tokens=max_new_tokens, params=params,
                               stop_ids=([eos_id] if eos_id is not None else []) + list(stop_token_ids),
                               stop_sequences=stop_sequences, seed=seed, device=device,
                               kv_memory_gib=kv_memory_gib, kv_block_tokens=kv_block_tokens,
                               max_concurrent=max_concurrent, share_prompts=share_prefill,
                               stop_requested=stop_requested)
    output = _generate_static(models, prompts, vocab_size=vocab_size, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
                              stop_token_ids=stop_token_ids, stop_sequences=stop_sequences, seed=seed,
                              pad_id=pad_id, fast_attention=fast_attention, fast_decode=fast_decode,
                              record_routes=record_routes, share_prefill=share_prefill, compact=compact,
                              max_concurrent=max_concurrent, pipeline_microbatches=pipeline_microbatches,
                              batch_major_cache=batch_major_cache, first_row=first_row,
                              stop_requested=stop_requested)
    _finish_stop_questions(stop_requested)
    return output


def _finish_stop_questions(stop_requested: Optional[Callable[[bool], tuple]]) -> None:
    """Keep answering the stop question (a collective) until no rank generates; raise on a stop."""
    while stop_requested is not None:
        stop, anyone = stop_requested(False)
        if stop:
            raise GenerationStopped("stopped after this worker's rollout ended")
        if not anyone:
            return


def _generate_paged(chunks: list, prompts, *, kv_memory_gib: Optional[float], kv_block_tokens: int,
                    device: torch.device, **kwargs) -> GenerationOutput:
    chain = StageChain(chunks, None, device=device)
    with whole_sequences(chunks):
        try:
            rows, stats = generate_paged(chunks, prompts, block_tokens=kv_block_tokens, device=device,
                                         kv_memory_bytes=None if kv_memory_gib is None else int(kv_memory_gib * 2**30),
                                         share=chain.share, **kwargs)
        finally:
            drop_inference_tensors_from_megatron_caches(chunks)
    return GenerationOutput(
        tokens=[row.tokens[row.prompt_len:] for row in rows], logprobs=[row.policy_lp for row in rows],
        sampling_logprobs=[row.sampling_lp for row in rows], lengths=[len(row.tokens) - row.prompt_len for row in rows],
        finish_reasons=[row.finish for row in rows], forward_passes=stats.steps, prefill_rows=stats.prefills,
        compactions=0, kv_cache_bytes=stats.pool_bytes, decode_attention=f"paged-{stats.kernels}",
        decode_path="modules", engine="paged", kv_block_tokens=stats.block_tokens, kv_peak_blocks=stats.peak_blocks,
        kv_peak_held_tokens=stats.peak_held_tokens, evictions=stats.evictions)


def _generate_static(models, prompts: Sequence[Sequence[int]], *, vocab_size: int, max_new_tokens: int,
                     temperature: float, top_k: int, top_p: float, eos_id: Optional[int],
                     stop_token_ids: Sequence[int], stop_sequences: Sequence[Sequence[int]], seed: int, pad_id: int,
                     fast_attention: bool, fast_decode: bool, record_routes: bool, share_prefill: bool,
                     compact: bool, max_concurrent: Optional[int], pipeline_microbatches: Optional[int],
                     batch_major_cache: Optional[bool], first_row: int,
                     stop_requested: Optional[Callable[[bool], tuple]]) -> GenerationOutput:
    """The static engine: one ``[rows, longest prompt + max_new_tokens]`` cache (module docstring)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    chunks = model_chunks(models)
    device = next(chunks[0].parameters()).device
    lockstep = Lockstep(chunks, device)
    batch = len(prompts)
    shortest, longest = lockstep.shape(batch, min(len(p) for p in prompts), max(len(p) for p in prompts))
    total = longest + max_new_tokens
    if max_concurrent is not None and len(prompts) > max_concurrent:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        waves = []
        for i in range(0, len(prompts), max_concurrent):
            if waves and stop_requested is not None and stop_requested(True)[0]:
                raise GenerationStopped(f"stopped after {len(waves)} of {-(-len(prompts) // max_concurrent)} waves")
            waves.append(_generate_static(models, prompts[i:i + max_concurrent], vocab_size=vocab_size,
                                  max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                  eos_id=eos_id, stop_token_ids=stop_token_ids, stop_sequences=stop_sequences,
                                  seed=seed, first_row=first_row + i, pad_id=pad_id, fast_attention=fast_attention,
                                  fast_decode=fast_decode, record_routes=record_routes, share_prefill=share_prefill,
                                  compact=compact, pipeline_microbatches=pipeline_microbatches,
                                  batch_major_cache=batch_major_cache, max_concurrent=None, stop_requested=None))
        return _joined(waves)

    rows = DecodeRows.new(prompts, total=total, max_new_tokens=max_new_tokens, pad_id=pad_id, device=device,
                          stops=Stops(([eos_id] if eos_id is not None else []) + list(stop_token_ids), stop_sequences,
                                      device))
    tokens = rows.tokens
    positions = torch.arange(total, device=device).unsqueeze(0).expand(batch, -1)

    was_training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    cache = _KVCache(batch, total)
    if batch_major_cache is None:
        batch_major_cache = max_new_tokens >= BATCH_MAJOR_MIN_NEW_TOKENS
    if record_routes:
        from megatron_rl.models.router_replay import RouteRecorder
    recorder = RouteRecorder(chunks, batch=batch, total=total, device=device) if record_routes else None
    sources, expand = shared_prefill_rows(tokens[:, :shortest], lockstep) if share_prefill else (None, None)
    forwards, compactions = 0, 0
    check_every = stop_check_interval(device)
    lean, used_lean = None, False
    draws = None if params.greedy else StepDraws(seed, batch=batch, vocab_size=vocab_size, device=device,
                                                 first_row=first_row)

    def choose(logits: torch.Tensor, batch_rows: Optional[torch.Tensor], t: int) -> StepChoice:
        return choose_tokens(logits, vocab_size=vocab_size, params=params,
                             race=None if draws is None else draws.at(t, batch_rows))

    try:
        fast = chunks if fast_attention else []
        with whole_sequences(chunks), torch.inference_mode(), \
                sdpa_core_attention(fast, batch_major_cache=batch_major_cache) as (swapped, batch_major), \
                cache as context, RopeOnceDecode(fast, context) as rope_once:
            chain = StageChain(chunks, context, device=device, microbatches=pipeline_microbatches)
            fed_from = 0
            feed = Feed(rows=rows)
            for t in range(shortest, total):
                fed = slice(None) if feed.active is None else feed.active
                if lean is not None:
                    logits = lean.step(tokens[fed, t - 1], t - 1)
                elif forwards == 0 and sources is not None:
                    logits = chain.forward(tokens[sources, :t], positions[sources, :t])
                    copy_cache_rows(context, expand, positions=t)
                    logits = None if logits is None else logits[expand]
                else:
                    logits = chain.forward(tokens[fed, fed_from:t], positions[fed, fed_from:t])
                if recorder is not None:
                    recorder.take(fed_from, t, sources=expand if forwards == 0 else None, rows=feed.active)
                context.sequence_len_offset += t - fed_from
                if forwards == 0:
                    context.enable_decode_mode()
                    rope_once.begin()
                    if fast_decode and rope_once.enabled and lean_decode_unsupported(chunks) is None:
                        lean = LeanDecoder(chunks[0], context, batch=batch)
                        used_lean = True
                forwards += 1
                fed_from = t
                local = None if logits is None else choose(logits, feed.active, t)
                # between checks finished rows stop writing; the host learns of them at the next check
                feed.record(chain.share(local, feed.fed_rows), t, lockstep=lockstep, compact=compact,
                            context=context, total=total,
                            check=chain.pp_size == 1 and (t + 1 - shortest) % check_every == 0)
                compactions = feed.compactions
                if chain.pp_size > 1:
                    steps, compactions = pipelined_decode(chain, rows, first=t, total=total, choose=choose,
                                                          compact=compact, check_every=check_every,
                                                          lockstep=lockstep, recorder=recorder)
                    forwards += steps
                    break
                if not feed.live:
                    break
    finally:
        lean = None
        if recorder is not None:
            recorder.close()
        drop_inference_tensors_from_megatron_caches(chunks)
        for chunk, flag in zip(chunks, was_training):
            chunk.train(flag)

    return GenerationOutput(
        **rows.responses(), forward_passes=forwards, kv_cache_bytes=cache.nbytes,
        prefill_rows=batch if sources is None else int(sources.numel()), compactions=compactions,
        decode_attention="+".join(name for name, used in (("sdpa", swapped > 0), ("rope-once", rope_once.enabled),
                                                          ("batch-major", batch_major > 0)) if used) or "megatron",
        decode_path="lean" if used_lean else "modules",
        routes=None if recorder is None else recorder.rows([e - 1 for e in rows.end.tolist()]))
