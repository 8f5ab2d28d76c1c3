"""Decode-only engine steps replayed from CUDA graphs, one graph per row-count bucket (``generation.cuda_graphs``).

A decode-only step (every fed row feeds one token) is padded to the next bucket of ``GRAPH_ROWS`` with rows that
write and read the part's scratch block only, its inputs are copied into fixed buffers (the tokens, positions
and the ``PagedContext``'s lengths, slots and block table), and the forward runs on those buffers. On a GPU the
first step of each bucket captures the forward into a ``torch.cuda.CUDAGraph`` (after one eager warm-up on a
side stream: it writes the same K/V the step writes, so it changes nothing) and every later step of that bucket
replays it: the long tail of a rollout, a few rows decoding, stops paying one kernel launch per op. On a CPU
nothing is captured and the same padded step runs on the same buffers eagerly, so CI runs everything but the
capture. Mixed steps (a row prefilled) and steps of more than ``GRAPH_ROWS[-1]`` rows run eagerly.

A capture holds the addresses of the weights, the KV pool and these buffers, so the graphs live for one
``generate`` call (one rollout): the colocated trainer's offload phases move the weights and free the pool
between calls, and the next call captures again. All graphs of a call share one memory pool (steps replay one
after another). What the paged attention needs to be capturable: no host synchronisation in a decode step
(paged_attention.py ``reference_kvcache`` gathers its table's whole width, here the fixed table's, whether the step
is captured, replayed or run eagerly). A capture is ``thread_local``, so that other threads' CUDA
calls do not invalidate it, and the rotary tables it reads stay referenced until the graphs close
(``PagedContext.graph_tables``): Megatron's per-process LRU of them could otherwise free one a graph still reads.
Where graphs cannot replay a step (MoE dispatch, MLA's latent kernel, pipeline stages, gloo's TP collectives)
``spec/parallel.cuda_graph_error`` refuses the key at launch and here.

Test: ``.venv/bin/python -m pytest tests/test_paged_engine.py -q -k graph``; on a GPU ``bench/gpu_check.sh``
(part 4c) captures, replays against eager decoding, and reports the graphs' memory.
"""

from __future__ import annotations

import bisect
from typing import Callable, Optional

import torch

from megatron_rl.spec.parallel import DECODE_GRAPH_ROWS as GRAPH_ROWS


def bucket_rows(rows: int) -> Optional[int]:
    """The bucket a decode step of ``rows`` rows runs at, or None (eagerly) past the largest."""
    i = bisect.bisect_left(GRAPH_ROWS, rows)
    return GRAPH_ROWS[i] if i < len(GRAPH_ROWS) else None


class DecodeGraphs:
    """The fixed inputs of one part's decode steps (up to ``rows`` rows, ``width`` table columns) and, on a GPU,
    a captured forward per bucket."""

    def __init__(self, *, rows: int, width: int, device: torch.device) -> None:
        top = bucket_rows(min(rows, GRAPH_ROWS[-1])) or GRAPH_ROWS[-1]
        self.device, self.top, self.rows, self.width = device, top, rows, width
        as_int = dict(dtype=torch.int32, device=device)
        self.buffers = {"ids": torch.zeros(top, dtype=torch.long, device=device),
                        "positions": torch.zeros(top, dtype=torch.long, device=device),
                        "cu_q": torch.arange(top + 1, **as_int), "cu_k": torch.zeros(top + 1, **as_int),
                        "k_lens": torch.zeros(top, **as_int), "table": torch.zeros(top, width, **as_int),
                        "slot_block": torch.zeros(top, dtype=torch.long, device=device),
                        "slot_offset": torch.zeros(top, dtype=torch.long, device=device),
                        "last": torch.arange(top, dtype=torch.long, device=device)}
        self.captured: dict = {}
        """``{bucket: (graph, logits)}`` on a GPU."""
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def bucket(self, rows: int) -> Optional[int]:
        """The bucket for a decode step of ``rows`` rows, or None when it runs eagerly."""
        found = bucket_rows(rows)
        return found if found is not None and found <= self.top else None

    def inputs(self, bucket: int) -> dict:
        """The buffers a step of ``bucket`` rows reads, as views (fixed addresses)."""
        b = self.buffers
        views = {name: b[name][:bucket] for name in ("ids", "positions", "k_lens", "table", "slot_block",
                                                      "slot_offset", "last")}
        views.update(cu_q=b["cu_q"][:bucket + 1], cu_k=b["cu_k"][:bucket + 1])
        return views

    def run(self, bucket: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The step's logits: ``forward()`` (which reads the buffers of ``bucket``) replayed from its graph on a
        GPU, captured at its first step; called as is on a CPU."""
        if self.pool is None:
            return forward()
        if bucket not in self.captured:
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                forward()  # warm-up (lazy initialisations must not land in the graph)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the CUDA calls of other threads (environment steps, the NCCL watchdog, a weight
            # receiver) must not invalidate the capture, as they would in the default global mode
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = forward()
            self.captured[bucket] = (graph, logits)
        graph, logits = self.captured[bucket]
        graph.replay()
        return logits

    def close(self) -> None:
        """Drop the graphs (they hold the KV pool's and the weights' addresses)."""
        self.captured.clear()
