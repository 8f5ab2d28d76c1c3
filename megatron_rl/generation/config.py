"""``EngineConfig``: what the engine is asked to do, built once (from the job's ``generation`` settings, or by hand).

The job builds it with ``EngineConfig.from_generation`` (megatron_rl/rollout/colocated.py); a multi-turn job
narrows it to an episode's limits with ``dataclasses.replace``. ``generate`` (decoding.py) takes it with the call's
own arguments (seed, prompts, callbacks), and the engine's rooms each read the fields they need. Torch-free.

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DEFAULT_BLOCK_TOKENS = 256
"""Tokens per KV block: flash-attn's paged kernels need a multiple of 256 (generation.kv_block_tokens)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Sampling, stopping, memory and layout settings of a ``generate`` call."""

    vocab_size: int
    """The real (unpadded) vocabulary: ids at or above it are never generated, and prompts must lie below it."""
    max_new_tokens: int
    """Most tokens generated per row (a multi-turn row: its whole conversation after the prompt)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """0: off."""
    top_p: float = 1.0
    """1.0: off."""
    eos_id: Optional[int] = None
    """A row ends after it (kept in the response)."""
    stop_token_ids: tuple = ()
    """More tokens that end a row, as ``eos_id``."""
    stop_sequences: tuple = ()
    """Token sequences that end a row (kept in the response)."""
    record_routes: bool = False
    """Return each row's expert routes (router replay; ``GenerationOutput.routes``)."""
    share_prefill: bool = True
    """The completions of one prompt (a GRPO group) are admitted together and the prompt prefilled once, its full
    blocks shared; False prefills every row."""
    max_concurrent: Optional[int] = None
    """An optional cap on the rows decoding at once (the KV memory is the limit)."""
    pipeline_microbatches: Optional[int] = None
    """Under PP, the parts the rows decode in (default pp)."""
    kv_memory_gib: Optional[float] = None
    """The KV block pool (None: every row's blocks at its longest, nothing is ever evicted)."""
    kv_block_tokens: int = DEFAULT_BLOCK_TOKENS
    """Tokens per KV block."""
    max_turn_tokens: Optional[int] = None
    """Multi-turn: most tokens of one policy turn."""
    max_total_tokens: Optional[int] = None
    """Most tokens of a row, prompt, turns and replies together."""
    reply_steps: int = 0
    """Multi-turn: a reply made while rows decode (a ``Future``) joins its row this many engine steps after the
    turn ended, waited for then if not ready, so runs repeat bit for bit; 0: at the first step it is ready
    (environment.reply_steps)."""
    cuda_graphs: bool = False
    """Decode-only steps padded to a row bucket and replayed from CUDA graphs (graphs.py)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_new_tokens", "kv_block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.reply_steps < 0:
            raise ValueError(f"reply_steps must be >= 0, got {self.reply_steps}")
        for name in ("max_concurrent", "max_turn_tokens", "max_total_tokens", "pipeline_microbatches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.kv_memory_gib is not None and self.kv_memory_gib <= 0:
            raise ValueError(f"kv_memory_gib must be > 0, got {self.kv_memory_gib}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_sequences", tuple(tuple(s) for s in self.stop_sequences))

    @classmethod
    def from_generation(cls, gen, *, vocab_size: int, eos_id: Optional[int], stop_sequences, **more) -> "EngineConfig":
        """From the job's ``generation`` section (spec/config/schema.py ``GenerationConfig``); the tokenizer gives
        ``eos_id`` and the encoded ``gen.stop``; ``more``: fields the section does not hold (``record_routes``)."""
        return cls(vocab_size=vocab_size, max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                   top_p=gen.top_p, top_k=gen.top_k, eos_id=eos_id, stop_sequences=stop_sequences,
                   max_concurrent=gen.max_concurrent, kv_memory_gib=gen.kv_memory_gib,
                   kv_block_tokens=gen.kv_block_tokens, cuda_graphs=gen.cuda_graphs, **more)

    @property
    def stop_ids(self) -> list:
        """Every token that ends a row."""
        return ([self.eos_id] if self.eos_id is not None else []) + list(self.stop_token_ids)

    @property
    def kv_memory_bytes(self) -> Optional[int]:
        return None if self.kv_memory_gib is None else int(self.kv_memory_gib * 2**30)
