"""The model runner: a scheduled step's inputs, the forward on the paged context, and the sampled rows' tokens.

A step's integer inputs (tokens, positions, KV slots, query/key offsets, the rows' block tables, and the sampled
rows' draw keys and logit rows) are worked out on the host, where the engine knows them, and reach the device in
one copy from pinned memory (``send_step``); the choice comes back in one copy (``StepChoice.host_lists``). So a
decode step waits on the device once, whatever the layer count: the kernels take the longest row from the host
and index with integer tensors, never a boolean mask (paged_attention.py).

Every fed row samples one token at its last position; a group's members admitted with it sample from their
lead's logits. A decode-only step (every row feeding one token) runs padded to a row bucket on the decode graphs'
fixed buffers (graphs.py); a worker of an expert-parallel lockstep pads its step to the most tokens any worker
feeds (layout.py ``Lockstep``), with padding rows that attend within a scratch block.

Test: ``.venv/bin/python -m pytest tests/test_paged_engine.py -q -k sync``
"""

from __future__ import annotations

from array import array
from itertools import accumulate
from typing import Optional

import torch

from megatron_rl.generation.block_manager import BlockManager
from megatron_rl.generation.graphs import DecodeGraphs
from megatron_rl.generation.paged import PagedContext
from megatron_rl.generation.sampling import SamplingParams, StepChoice, choose_tokens, position_keys
from megatron_rl.generation.scheduler import ScheduledStep

LONG_INPUTS = ("ids", "positions", "slot_block", "slot_offset", "last", "source", "seeds", "requests", "draws",
               "token_rows")
"""A step's int64 inputs: the fed tokens and their positions and KV slots, each row's last token, and per sampled
row its draw seed, request and position; the logits row each samples from (empty when every fed row samples from
its own, in order); the fed tokens' rows (route recording)."""


def padding_rows(tokens: int, block_tokens: int) -> list:
    """Rows of at most ``block_tokens`` padding tokens each (they attend within the scratch block), ``tokens`` in
    all: what a worker adds to a step so that every worker of an expert-parallel lockstep feeds as many."""
    return [block_tokens] * (tokens // block_tokens) + ([tokens % block_tokens] if tokens % block_tokens else [])


def _extend_slots(slots: dict, blocks: list, start: int, stop: int, block_tokens: int) -> None:
    """Positions ``start .. stop - 1`` of a row holding ``blocks``: their positions, blocks and offsets."""
    slots["positions"].extend(range(start, stop))
    for j in range(start // block_tokens, (stop - 1) // block_tokens + 1):
        low, high = max(start, j * block_tokens), min(stop, (j + 1) * block_tokens)
        slots["slot_block"].extend([blocks[j]] * (high - low))
        slots["slot_offset"].extend(range(low - j * block_tokens, high - j * block_tokens))


def send_step(host: dict, *, width: int, device: torch.device) -> dict:
    """``host`` (``LONG_INPUTS``, ``cu_q``, ``cu_k``, ``k_lens`` and the rows' block ``table`` of ``width`` columns,
    flattened, as lists) on ``device``, sent in one copy from pinned memory: int64 views, and int32 views (``cu_q``,
    ``cu_k``, ``k_lens``, ``table``, as flash-attn takes them) of the same buffer. The lists are packed by
    ``array`` (``torch.tensor`` of a list costs ~100 ns an element, a tenth of a 64-row step's host time)."""
    int_names = ("cu_q", "cu_k", "k_lens", "table")
    packed = array("q")
    for name in LONG_INPUTS:
        packed.extend(host[name])
    longs = len(packed)
    ints = array("i")
    for name in int_names:
        ints.extend(host[name])
    sizes = [len(host[name]) for name in int_names]
    pad = len(ints) % 2  # int32 pairs fill the int64 words
    ints.extend([0] * pad)
    packed.frombytes(ints.tobytes())
    buffer = torch.frombuffer(packed, dtype=torch.long) if packed else torch.empty(0, dtype=torch.long)
    if device.type == "cuda":
        buffer = torch.empty(len(packed), dtype=torch.long, pin_memory=True).copy_(buffer)
        buffer = buffer.to(device, non_blocking=True)
    views = dict(zip(LONG_INPUTS, buffer[:longs].split([len(host[name]) for name in LONG_INPUTS])))
    views.update(zip(int_names, buffer[longs:].view(torch.int32).split(sizes + [pad])))
    views["table"] = views["table"].view(-1, width)
    return views


class ModelRunner:
    """The forwards of one engine part: its paged ``context`` over the part's blocks, its decode ``graphs`` (None:
    every step eagerly) and ``scratch`` block (padding rows' home; None without padding)."""

    def __init__(self, *, blocks: BlockManager, context: PagedContext, graphs: Optional[DecodeGraphs],
                 scratch: Optional[int], lockstep, recorder, counters: dict) -> None:
        self.blocks, self.context, self.graphs, self.scratch = blocks, context, graphs, scratch
        self.lockstep, self.recorder, self.counters = lockstep, recorder, counters
        self.device = context.device
        self.graph_bucket: Optional[int] = None
        """The decode graph's bucket this step runs at (None: eagerly)."""
        self.sampled: list = []
        """The rows that sample this step: every fed row, and the members of a group admitted with its lead."""
        self.inputs: dict = {}

    def fit_graphs(self, rows: int, width: int) -> None:
        """Decode graphs whose buffers take ``rows`` rows of ``width`` blocks (a session's prompts came; captured
        again when they grow)."""
        if self.graphs is not None and (rows > self.graphs.rows or width > self.graphs.width):
            self.graphs.close()
            self.graphs = DecodeGraphs(rows=max(rows, 2 * self.graphs.rows), width=max(width, self.graphs.width),
                                       device=self.device)

    def prepare(self, step: ScheduledStep, generating: bool) -> bool:
        """The step's inputs on the device, and the context set for its forward. False when no worker of a
        lockstep feeds anything (or, without one, this part feeds nothing)."""
        fed, bt = step.fed, self.blocks.block_tokens
        q_lens = [row.uncached for row in fed]
        most, anyone = self.lockstep.step_shape(sum(q_lens), generating)
        if not anyone:
            return False
        padding = padding_rows(most - sum(q_lens), bt)
        self.graph_bucket = None
        if self.graphs is not None and q_lens and not padding and max(q_lens) == 1:
            self.graph_bucket = self.graphs.bucket(len(q_lens))
            if self.graph_bucket is not None:
                padding = [1] * (self.graph_bucket - len(q_lens))  # one token each, on the scratch block
        host: dict = {name: [] for name in LONG_INPUTS}
        ids, positions, slot_block, slot_offset = (host[name] for name in ("ids", "positions", "slot_block",
                                                                          "slot_offset"))
        for row in fed:
            if row.cached == len(row.tokens) - 1:  # a decoding row: its last token
                at = row.cached
                ids.append(row.tokens[at])
                positions.append(at)
                slot_block.append(row.blocks[at // bt])
                slot_offset.append(at % bt)
            else:
                ids.extend(row.tokens[row.cached:])
                _extend_slots(host, row.blocks, row.cached, len(row.tokens), bt)
        for tokens in padding:
            ids.extend([0] * tokens)
            _extend_slots(host, [self.scratch], 0, tokens, bt)
        q_all = q_lens + padding
        k_lens = [len(row.tokens) for row in fed] + padding
        host.update(cu_q=[0, *accumulate(q_all)], cu_k=[0, *accumulate(k_lens)], k_lens=k_lens)
        host["last"] = [end - 1 for end in host["cu_q"][1:]]
        self._sampling_inputs(step, host)
        if self.recorder is not None:
            host["token_rows"] = [row.index for row in fed for _ in range(row.uncached)]
        width = -(-max(k_lens) // bt)
        table = host["table"] = []
        for row in fed:
            table.extend(row.blocks[:width])
            table.extend([0] * (width - len(row.blocks)))
        table.extend([self.scratch] * (width * len(padding)))
        self.inputs = send_step(host, width=width, device=self.device)
        into = None if self.graph_bucket is None else self.graphs.inputs(self.graph_bucket)
        self.context.set_step(self.inputs, max_q=max(q_all), max_k=max(k_lens), into=into)
        self.ids = self.inputs["ids"] if into is None else into["ids"].copy_(self.inputs["ids"])
        self.positions = self.context.positions
        self.counters["forwards"] += 1
        self.counters["prefills"] += sum(q > 1 for q in q_lens)
        self.counters["fed"] += sum(q_lens)
        return True

    def _sampling_inputs(self, step: ScheduledStep, host: dict) -> None:
        """Who samples: every fed row from its own logits, an admitted group's members from their lead's."""
        if not step.admitted:  # the fed rows' own logits, in order: no gather (``sample``)
            self.sampled = list(step.fed)
        else:
            members = {id(group.lead): group.rows for group in step.admitted}
            self.sampled = []
            for i, row in enumerate(step.fed):
                for member in members.get(id(row), [row]):
                    self.sampled.append(member)
                    host["source"].append(i)
        host["seeds"] = [row.seed for row in self.sampled]
        host["requests"] = [row.request for row in self.sampled]
        host["draws"] = [len(row.tokens) for row in self.sampled]

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
        if self.recorder is not None:
            rows = self.inputs["token_rows"]
            self.recorder.take_tokens(rows, self.positions[:rows.numel()], chunk=chunk)

    def sample(self, logits: torch.Tensor, *, params: SamplingParams, vocab_size: int) -> StepChoice:
        """The sampled rows' tokens from the last stage's logits ``[fed rows (+ padding rows), vocab]``."""
        keys = None
        if not params.greedy:  # the rows' position_draws, drawn inside the choice block by block
            keys = position_keys(self.inputs["seeds"], self.inputs["requests"], self.inputs["draws"])
        return choose_tokens(self.sampled_logits(logits), vocab_size=vocab_size, params=params, race_keys=keys)

    def sampled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows of ``logits`` the sampled rows draw from, in ``sampled`` order: the fed rows' own (a view; the
        padding rows after them sample nothing), or, when a group was admitted, gathered (its members share their
        lead's)."""
        source = self.inputs["source"]
        return logits[source] if source.numel() else logits[:len(self.sampled)]
