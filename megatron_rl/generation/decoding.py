"""Colocated generation: ``generate`` on the training model's own modules.

``generate(models, prompts, EngineConfig(vocab_size=..., max_new_tokens=...))`` runs on the very ``GPTModel``
objects the trainer optimises (DDP wrappers are looked through): no weight copy. It decodes on the paged engine
(engine.py and its rooms: a pool of KV blocks, continuous admission, a GRPO group's prompt prefilled once) and
returns the responses with both kinds of log-probs.

Positions. A sequence's tokens sit at the positions of the training forward of ``prompt + response`` (positions
from 0, no padding inside a row), so generation's log-probs equal the training forward's.

Parallelism.
* TP: logits are gathered over the vocabulary (``runtime_gather_output``), and the chosen tokens come from TP
  rank 0 (pipeline.py ``StageChain.share``), so the ranks cannot drift apart.
* PP (and virtual PP): the rows decode in ``pipeline_microbatches`` parts (pp by default), whose successive steps
  overlap across the stages (engine.py ``Engine._run_pipelined``).
* DP: each data-parallel rank generates for the prompts it is given; no collective crosses DP ranks, except
  for MoE models at ep > 1 (below).
* SP and CP: switched off for the call (layout.py ``whole_sequences``); CP ranks hold full weights, so each CP rank
  decodes whole sequences of its own prompts, like a DP rank (``data_parallel_seed`` gives each its own stream).
* EP: when the experts span rollout workers, the workers step in lockstep (layout.py ``Lockstep``).

Phase hygiene. Decoding runs under ``torch.no_grad`` with the modules in eval mode (restored after), not under
``torch.inference_mode``: the training modules keep state made during a forward (Megatron's rotary tables in an
``lru_cache`` and its attention scratch buffer, Transformer Engine's lazily made buffers), and an inference
tensor kept there would break the next training step ("Inplace update to inference tensor outside
InferenceMode"; tests/dist/gen_check.py ``LazyBuffer``). Megatron's rotary tables are emptied on the way out.

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q``
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from megatron_rl.generation.config import EngineConfig
from megatron_rl.generation.engine import Engine, EngineHooks, GenerationStopped
from megatron_rl.generation.feed import Feed
from megatron_rl.generation.layout import Lockstep, whole_sequences
from megatron_rl.generation.pipeline import StageChain
from megatron_rl.generation.sampling import draw_seed
from megatron_rl.generation.turns import SettleReplies, TurnEnded
from megatron_rl.models import unwrap

__all__ = ["EngineConfig", "GenerationOutput", "GenerationStopped", "data_parallel_seed", "generate"]


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
    policy_mask: list[list[int]]
    """Per response token: 1 when the policy sampled it, 0 for a multi-turn reply's tokens (whose log-probs are
    0.0 placeholders)."""
    lengths: list[int]
    """Response lengths (len of each ``tokens`` row)."""
    finish_reasons: list[str]
    """"stop" (eos, stop token or stop sequence generated) or "length" (max_new_tokens reached)."""
    forward_passes: int
    """Model forwards run (1 prefill + decode steps)."""
    prefill_rows: int
    """Rows whose forward fed more than one token: each group's prompt once (``share_prefill``), and the rows
    prefilled again after an eviction."""
    fed_tokens: int
    """Tokens the forwards fed (each row's once, a group's prompt once, more after evictions)."""
    kv_cache_bytes: int
    """Bytes of the KV block pool on this rank; released before ``generate`` returned."""
    decode_attention: str
    """The paged kernels that ran (paged_attention.py): "paged-flash-attn" or "paged-torch"."""
    kv_block_tokens: int
    """Tokens per KV block."""
    kv_peak_blocks: int
    """The most KV blocks rows held at once."""
    kv_peak_held_tokens: int
    """The K/V positions those blocks held then (blocks shared by a group counted once)."""
    evictions: int
    """Rows evicted for want of blocks (and prefilled again later)."""
    decode_graph_steps: int = 0
    """Decode steps run from a decode graph (``cuda_graphs``; captured and replayed on a GPU)."""
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


def clear_rotary_caches(chunks: list) -> None:
    """Empty the rotary tables Megatron cached during the call: they cover its longest sequence, memory the training
    step does not need (its own lengths are cached again as it runs)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for chunk in chunks:
        getattr(chunk, "rotary_pos_emb_cache", {}).clear()
    RotaryEmbedding.forward.cache_clear()
    try:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
        YarnRotaryEmbedding.forward.cache_clear()
    except (ImportError, AttributeError):
        pass


def generate(models, prompts: Sequence[Sequence[int]], config: EngineConfig, *, seed: Optional[int] = None,
             generator: Optional[torch.Generator] = None, stop_requested: Optional[Callable[[bool], tuple]] = None,
             turn_ended: Optional[TurnEnded] = None, settle_replies: Optional[SettleReplies] = None,
             feed: Optional[Feed] = None) -> GenerationOutput:
    """Generate a response for every prompt under ``config`` (config.py ``EngineConfig``); see the module
    docstring and engine.py. Returns on every rank of the model-parallel group.

    Sampling draws are seeded with ``seed`` (or drawn from ``generator``; 0 when both are None); pass the same seed
    on every TP/PP rank of a replica (``data_parallel_seed`` makes one). Each row's draws depend on the seed, its
    place in ``prompts`` and its position only, so the tokens do not depend on the KV budget, the admission order
    or the pipeline parts. ``stop_requested(generating) -> (stop, anyone generating)`` is asked every
    ``engine.STOP_POLL_STEPS`` steps (a collective); a yes raises ``GenerationStopped``.

    Multi-turn (``turn_ended``, turns.py ``TurnEnded``): a response is the whole conversation after the prompt,
    turns of at most ``config.max_turn_tokens`` and the replies between them, at most ``max_new_tokens`` in all and
    at most ``max_total_tokens`` with the prompt; ``policy_mask`` tells the policy's tokens from the replies'.
    ``settle_replies`` (turns.py ``SettleReplies``): for replies made while rows decode at tp or pp > 1.

    With a ``feed`` (feed.py ``Feed``) it is a session over the feed's prompts instead of ``prompts`` (empty),
    which ends only when the feed raises ``GenerationStopped``: rows join and leave while others decode, each
    prompt's completions go to ``feed.finished`` as soon as they have all ended, and a row may be as long as the
    model's positions (or ``max_total_tokens``).
    """
    if (not prompts and feed is None) or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. a BOS token)")
    chunks = model_chunks(models)
    check_generation_layout(chunks)
    device = next(chunks[0].parameters()).device
    max_positions = getattr(chunks[0], "max_sequence_length", None)
    if feed is not None:
        config = dataclasses.replace(config, max_total_tokens=min(config.max_total_tokens or max_positions,
                                                                  max_positions or config.max_total_tokens))
    longest = max((len(p) for p in prompts), default=0)
    total = min(longest + config.max_new_tokens, config.max_total_tokens or longest + config.max_new_tokens)
    if max_positions is not None and total > max_positions:
        raise ValueError(f"longest prompt ({longest}) + max_new_tokens ({config.max_new_tokens}) = {total} exceeds "
                         f"the model's max_position_embeddings ({max_positions}); give generation.max_new_tokens at "
                         f"most {max(max_positions - longest, 0)} or shorter prompts")
    if any(t >= config.vocab_size or t < 0 for p in prompts for t in p):
        raise ValueError(f"prompt token ids must lie in [0, {config.vocab_size})")
    chain = StageChain(chunks, device=device, microbatches=config.pipeline_microbatches)
    with whole_sequences(chunks):
        try:
            engine = Engine(config, chunks, chain=chain, lockstep=Lockstep(chunks), seed=draw_seed(seed, generator),
                            hooks=EngineHooks(stop_requested=stop_requested, turn_ended=turn_ended,
                                              settle_replies=settle_replies, feed=feed))
            engine.add(prompts)
            rows, stats = engine.run()
        finally:
            clear_rotary_caches(chunks)
    return GenerationOutput(
        tokens=[row.response for row in rows], logprobs=[row.policy_lp for row in rows],
        sampling_logprobs=[row.sampling_lp for row in rows], policy_mask=[row.policy_mask for row in rows],
        lengths=[len(row.tokens) - row.prompt_len for row in rows],
        finish_reasons=[row.finish for row in rows], forward_passes=stats.steps, prefill_rows=stats.prefills,
        fed_tokens=stats.fed_tokens,
        kv_cache_bytes=stats.pool_bytes, decode_attention=f"paged-{stats.kernels}",
        kv_block_tokens=stats.block_tokens, kv_peak_blocks=stats.peak_blocks,
        kv_peak_held_tokens=stats.peak_held_tokens, evictions=stats.evictions, routes=stats.routes,
        decode_graph_steps=stats.graph_steps)
