"""The block manager: which KV blocks each sequence holds (allocate, free, share a prompt's blocks), over one
``BlockPool`` (paged.py, the cache tensors and their reference counts).

A sequence's ``blocks`` list is its row of the block table: each step sends its rows' lists to the device
(runner.py). A GRPO group's completions share their prompt's full blocks from admission on (reference counted);
each takes its own copy of the prompt's last, partial block, filled once the lead's prefill has written it.

Test: ``.venv/bin/python -m pytest tests/test_paged_engine.py -q -k block``
"""

from __future__ import annotations

from megatron_rl.generation.paged import BlockPool
from megatron_rl.generation.sequence import Sequence


class BlockManager:
    """Blocks of ``pool`` for sequences."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool, self.block_tokens = pool, pool.block_tokens
        self.peak_blocks, self.peak_held = 0, 0
        """The most blocks rows held at once, and the K/V positions they held then (shared blocks once)."""

    @property
    def free_blocks(self) -> int:
        return len(self.pool.free)

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_tokens)

    def allocate(self, seq: Sequence, length: int) -> bool:
        """Blocks for ``length`` positions of ``seq``; False when the pool ran out first (``seq`` keeps the blocks
        it got: the scheduler preempts a row and asks again)."""
        while len(seq.blocks) * self.block_tokens < length:
            block = self.pool.take()
            if block is None:
                return False
            seq.blocks.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []

    def share_prompt(self, lead: Sequence, members: list) -> None:
        """At admission: every member holds the lead's full prompt blocks (shared) and a block of its own for the
        prompt's partial last block (``copy_prompt_tail`` fills it after the lead's prefill). The caller checked
        that the blocks are free."""
        full = len(lead.tokens) // self.block_tokens
        for seq in members:
            for block in lead.blocks[:full]:
                self.pool.share(block)
            seq.blocks = lead.blocks[:full]
            if not self.allocate(seq, len(lead.tokens)):
                raise RuntimeError("the KV pool ran out of blocks it was checked to hold")

    def copy_prompt_tail(self, lead: Sequence, members: list) -> None:
        """After the lead's prefill: its partial last block into each member's own."""
        full, partial = divmod(len(lead.tokens), self.block_tokens)
        if partial:
            for seq in members:
                self.pool.copy(lead.blocks[full], seq.blocks[full], partial)

    def note_peak(self, running: list) -> None:
        """Record the blocks held now if they are the most so far."""
        if self.pool.taken > self.peak_blocks:
            shared = sum(r - 1 for r in self.pool.refs if r > 1) * self.block_tokens
            self.peak_blocks, self.peak_held = self.pool.taken, sum(row.cached for row in running) - shared
