"""Next-token micro-batches: the pretrain corpus's rows, SFT examples, and the dict the LM loss reads.

A micro-batch is ``{"tokens", "labels", "loss_mask", "position_ids"}``, each ``[rows, seq_length]``: inputs are
a row's tokens but the last, labels its tokens but the first, and ``loss_mask`` (on the label positions) says
which labels count (``megatron_rl.algorithms.lm_loss``). Pair (DPO, RM) batches are ``megatron_rl.data.pairs``';
a rollout's are ``megatron_rl.rollout.batch``'s.
"""

from __future__ import annotations

import torch


def progression_batch(*, seed: int, step: int, batch_size: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """The pretrain trainer's synthetic corpus: ``[batch, seq_length + 1]`` token ids (start + stride * i) mod
    vocab, identical on every rank. A model can learn it: the loss falls well below ln(vocab) in a few dozen steps."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 8, (batch_size, 1), generator=gen)
    return (start + stride * torch.arange(seq_length + 1)) % vocab_size


def lm_batch(rows: torch.Tensor, row_mask: torch.Tensor) -> dict:
    """A next-token micro-batch from full rows: inputs rows[:, :-1], labels rows[:, 1:]; ``row_mask`` says which
    row tokens are targets (it is shifted onto the label positions)."""
    tokens = rows[:, :-1].contiguous()
    batch = {"tokens": tokens, "labels": rows[:, 1:].contiguous(), "loss_mask": row_mask[:, 1:].float().contiguous(),
             "position_ids": torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens).contiguous()}
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    return batch


def collate_lm(rows: torch.Tensor) -> dict:
    """A micro-batch where every token after the first is a target."""
    return lm_batch(rows, torch.ones_like(rows, dtype=torch.float32))


def collate_sft(examples: list[tuple[list[int], list[int]]], *, seq_length: int, pad_id: int) -> dict:
    """SFT examples ((ids, loss mask) each) padded to seq_length + 1 tokens; the loss mask is shifted onto the
    label positions."""
    rows = torch.full((len(examples), seq_length + 1), pad_id, dtype=torch.long)
    masks = torch.zeros((len(examples), seq_length + 1), dtype=torch.float32)
    for i, (ids, mask) in enumerate(examples):
        rows[i, :len(ids)] = torch.tensor(ids)
        masks[i, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return lm_batch(rows, masks)
