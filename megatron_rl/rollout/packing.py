"""Sequence packing for the RL training and log-prob forwards (``parallel.micro_batch_tokens``).

A mini-batch's rows are shared over the data-parallel ranks by tokens (longest first, each to the rank holding
the fewest). Each rank runs as many micro-batches as first-fit-decreasing needs to pack its rows into micro-batches
of at most ``micro_batch_tokens`` tokens (a longer row gets one of its own), the most any rank needs, with its rows
spread over them as evenly as it can. Every micro-batch of every rank runs at one length T, the fullest one's
tokens rounded up to the sequence multiple, and every rank runs the same number of them: expert-parallel
all-to-alls and pipeline messages pair the ranks' forwards one to one, and the pipeline schedule sizes its
messages by T. A rank that packs into fewer micro-batches splits its fullest ones, or, with fewer rows than
micro-batches, adds a copy of a row kept out of the loss. Interleaved pipelining takes a multiple of pp
micro-batches.

The model sees each micro-batch as one sequence of T tokens with per-row attention boundaries
(``megatron_rl.models.packed_sequences``); the losses see the rows as ``[rows, L]``, as from padded micro-batches.
``train_tokens_per_real_token`` = tokens computed / tokens of the rows: 1 would be no padding at all.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_rl.models.packed_sequences import attention_inputs, with_padding_segments
from megatron_rl.rollout.batch import RolloutBatch, RolloutRow


def pack_rows(lengths: list[int], *, dp: int, token_budget: int, multiple: int = 1,
              count_multiple: int = 1) -> tuple[list[list[list[int]]], int]:
    """(per data-parallel rank, its micro-batches as lists of row indices; the packed length T). Index -1 - i
    names a copy of row i kept out of the loss (the fallback of the module docstring)."""
    if not lengths:
        raise ValueError("no rows to pack")
    packed = max(token_budget, max(lengths))
    packed = -(-packed // multiple) * multiple
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ranks: list[list[int]] = [[] for _ in range(dp)]
    loads = [0] * dp
    for i in order:
        r = min(range(dp), key=lambda k: (loads[k], k))
        ranks[r].append(i)
        loads[r] += lengths[i]
    first_fit = [_first_fit_decreasing(rows, lengths, packed) for rows in ranks]
    count = max(len(b) for b in first_fit)
    count = -(-count // count_multiple) * count_multiple
    load = lambda b: sum(lengths[source_row(i)] for i in b)  # noqa: E731
    bins_per_rank = []
    for rows, bins in zip(ranks, first_fit):
        # the fewest micro-batches first fit needs, then the rows spread evenly over that many (longest first,
        # to the lightest), whichever leaves the fullest one lighter: T follows the fullest of all
        spare = min(rows or range(len(lengths)), key=lambda i: (lengths[i], i))  # a rank without rows copies one
        candidates = (_to_count(bins, lengths, count, spare),
                      _to_count(_spread(rows, lengths, count), lengths, count, spare))
        bins_per_rank.append(min(candidates, key=lambda c: max(load(b) for b in c)))
    fullest = max(load(b) for bins in bins_per_rank for b in bins)
    return bins_per_rank, -(-fullest // multiple) * multiple


def _spread(rows: list[int], lengths: list[int], count: int) -> list[list[int]]:
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        b = min(range(count), key=lambda k: (loads[k], k))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [b for b in bins if b]


def source_row(index: int) -> int:
    """The row a packed index names (a negative index is a copy outside the loss: see ``_to_count``)."""
    return index if index >= 0 else -1 - index


def _first_fit_decreasing(rows: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _to_count(bins: list[list[int]], lengths: list[int], count: int, spare: int) -> list[list[int]]:
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if splittable:
            fullest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
            bins.append([fullest.pop()])
        else:  # fewer rows than micro-batches: a copy of the rank's shortest row, kept out of the loss
            bins.append([-1 - spare])
    return bins


def pack_minibatch(rows: list[RolloutRow], *, dp: int, dp_rank: int, token_budget: int, multiple: int,
                   count_multiple: int, pad_id: int, thd: bool) -> tuple[list[RolloutBatch], dict]:
    """This data-parallel rank's packed micro-batches of a mini-batch's rollout rows, and the mini-batch's
    packing figures (``train_tokens``: computed over every rank; ``real_tokens``: the rows')."""
    lengths = [row.forward_tokens for row in rows]
    per_rank, packed = pack_rows(lengths, dp=dp, token_budget=token_budget, multiple=multiple,
                                 count_multiple=count_multiple)
    micro = []
    for indices in per_rank[dp_rank]:
        micro.append(collate_packed([_row(rows, i) for i in indices], packed_length=packed, pad_id=pad_id, thd=thd,
                                    row_ids=indices))
    figures = {"train_tokens": float(dp * len(per_rank[0]) * packed), "real_tokens": float(sum(lengths))}
    return micro, figures


def _row(rows: list[RolloutRow], index: int) -> RolloutRow:
    return rows[index] if index >= 0 else dataclasses.replace(rows[source_row(index)], in_loss=False)


def collate_packed(rows: list[RolloutRow], *, packed_length: int, pad_id: int, thd: bool,
                   row_ids: Optional[list[int]] = None) -> RolloutBatch:
    """One packed micro-batch of rollout rows (``row_ids``: their places in the mini-batch, default 0, 1, ...; see
    ``megatron_rl.rollout.batch.collate_rollout`` for the padded one, whose row-view entries ``loss_mask``,
    ``behav_logp`` and ``advantages`` these equal)."""
    widths = [row.forward_tokens for row in rows]
    width = max(widths)
    tokens = torch.full((packed_length + 1,), pad_id, dtype=torch.long)
    labels = torch.full((packed_length,), pad_id, dtype=torch.long)
    position_ids = torch.zeros(packed_length, dtype=torch.long)
    row_index = torch.zeros((len(rows), width), dtype=torch.long)
    row_valid = torch.zeros((len(rows), width), dtype=torch.bool)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    behav_logp = torch.zeros((len(rows), width), dtype=torch.float32)
    advantages = torch.zeros(len(rows), dtype=torch.float32)
    starts = [0]
    for i, row in enumerate(rows):
        seq = torch.tensor(row.prompt_ids + row.response_ids, dtype=torch.long)
        start, n = starts[-1], widths[i]
        tokens[start:start + n] = seq[:-1]
        labels[start:start + n] = seq[1:]
        position_ids[start:start + n] = torch.arange(n)
        row_index[i, :n] = torch.arange(start, start + n)
        row_valid[i, :n] = True
        first, end = len(row.prompt_ids) - 1, n  # label positions of the response tokens
        loss_mask[i, first:end] = row.loss_mask()
        behav_logp[i, first:end] = torch.tensor(row.logprobs, dtype=torch.float32)
        advantages[i] = row.advantage
        starts.append(start + n)
    starts = with_padding_segments(starts, packed_length)
    routes = _packed_routes([row.routes for row in rows], starts, packed_length) \
        if rows and rows[0].routes is not None else None
    batch = RolloutBatch(tokens=tokens[None, :-1], labels=labels[None], position_ids=position_ids[None],
                         row_index=row_index, row_valid=row_valid, loss_mask=loss_mask, behav_logp=behav_logp,
                         advantages=advantages, routes=routes,
                         row_ids=torch.tensor(list(range(len(rows))) if row_ids is None else row_ids)).to_device()
    return batch.replace(**attention_inputs(starts, thd=thd, device=batch.tokens.device))


def _packed_routes(routes: list[torch.Tensor], starts: list[int], packed_length: int) -> torch.Tensor:
    from megatron_rl.models.router_replay import NO_ROUTE

    slots, topk = routes[0].shape[1:]
    out = torch.full((1, packed_length, slots, topk), NO_ROUTE, dtype=routes[0].dtype)
    for start, row in zip(starts, routes):
        out[0, start:start + row.size(0)] = row
    return out
