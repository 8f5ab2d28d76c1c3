"""Generation forwards across pipeline stages: one forward through every stage, and the pipelined decode loop.

``StageChain.forward`` runs one forward of the rows through every stage (and virtual stage), hidden states handed
on by send/recv, in ``microbatches`` parts so that stage s works on part m + 1 while stage s + 1 works on part m.
Within one forward that overlaps only the pipeline's fill and drain; it runs the prefill.

``pipelined_decode`` overlaps successive decode steps. The rows are split into M parts (M = pp by default), each
decoding on its own: part m's step t + 1 enters stage 0 as soon as part m's step-t token is chosen, while the
later stages still work on the other parts' step t. Every rank walks its units in the order (step, virtual
stage, part); a unit waits for the previous virtual stage of the same part and step, or, on stage 0's first
virtual stage, for the part's previous token. With M >= pp every stage is busy in the steady state: a step of
all rows takes vpp x max(pp, M) forwards of one part's virtual stage (plus a hop each), against vpp x pp forwards
of all rows when the stages take turns (M = 1).

The last stage picks the tokens (TP rank 0's choice, broadcast over TP) and sends each part's choice straight to
every other stage. Messages to an earlier stage (the choices, and the last stage's hand-over to stage 0's next
virtual stage) travel on a group of their own (``runtime.distributed.pipeline_return_group``), so every
communicator carries one direction, its messages in the order both ends post them. They go untagged, as NCCL
matches them; gloo matches untagged messages by order too, so the CPU runs check that order. Every rank records
the same choices for a part before that part's next forward, so every rank holds the same rows, compacts the
same way (each part in its own cache slots) and stops at the same point; under an expert-parallel ``Lockstep``
the replicas agree per part, as the whole batch does at PP=1.

Sampling draws one ``[batch, vocab]`` exponential race per step, the first time any part needs it, and each part
indexes its rows (``StepDraws``): the draws, and so the tokens, are those of the whole batch decoded in one piece
(``generate(share_prefill=False, compact=False, pipeline_microbatches=1)``).

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q -k pipelined`` (PP2 x VPP2 against the stages in
turn, greedy, sampled and with stops); ``bench/pipeline_decode.py`` times both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_rl.generation.layout import Lockstep
from megatron_rl.generation.rows import DecodeRows, Feed
from megatron_rl.generation.sampling import StepChoice
from megatron_rl.runtime.distributed import pipeline_return_group

def default_pipeline_microbatches(pp: int) -> int:
    """pp parts: with M >= pp parts every stage works at once in the steady state of ``pipelined_decode``. On the
    CPU, where a forward of half the rows costs nearly as much as one of all of them, bench/pipeline_decode.py
    still measured 2 parts at PP2 1.22x the speed of the stages in turn (small model, 64 rows)."""
    return pp


class StageChain:
    """The pipeline stages of one replica as seen from this rank: forwards through every (virtual) stage, the
    hand-over of hidden states, and the last stage's choice shared with every rank."""

    def __init__(self, chunks: list, context, *, device: torch.device, microbatches: Optional[int] = None) -> None:
        from megatron.core import parallel_state as ps

        self.chunks = chunks
        self.context = context
        self.device = device
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        config = chunks[0].config
        self.hidden_size = config.hidden_size
        self.pipeline_dtype = config.pipeline_dtype or config.params_dtype
        if self.pp_size > 1:
            self.prev_rank = ps.get_pipeline_model_parallel_prev_rank()
            self.next_rank = ps.get_pipeline_model_parallel_next_rank()
            self.pp_group = ps.get_pipeline_model_parallel_group()
            self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()
            self.pp_ranks = torch.distributed.get_process_group_ranks(self.pp_group)
            self.return_group = pipeline_return_group()
            # messages to a later stage go on Megatron's pipeline group, those to an earlier one (the last
            # stage's to stage 0, the token choices) on the return group: each communicator carries one direction
            self.recv_group = self.return_group if self.pp_rank == 0 else self.pp_group
            self.send_group = self.return_group if self.is_last_stage else self.pp_group
        if self.tp_size > 1:
            self.tp_group = ps.get_tensor_model_parallel_group()
            self.tp_src_rank = ps.get_tensor_model_parallel_src_rank()
        self.microbatches = default_pipeline_microbatches(self.pp_size) if microbatches is None \
            else microbatches

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """Logits ``[batch, padded_vocab]`` of the last fed position on the last stage; None elsewhere."""
        if self.pp_size == 1 and len(self.chunks) == 1:
            return self.chunks[0](tokens, positions, None, inference_context=self.context,
                                  runtime_gather_output=True)[:, -1]
        rows = tokens.size(0)
        parts = max(1, min(self.microbatches, rows))
        bounds = [(rows * i // parts, rows * (i + 1) // parts) for i in range(parts)]
        outputs, sends = [], []
        try:
            for start, stop in bounds:
                self.context.batch_size_offset = start
                output = None
                for v in range(len(self.chunks)):
                    output = self.chunk_forward(v, tokens[start:stop], positions[start:stop], sends)
                if output is not None:
                    outputs.append(output)
        finally:
            self.context.batch_size_offset = 0
            for handle, _ in sends:
                handle.wait()
        return torch.cat(outputs) if self.is_last_stage else None

    def chunk_forward(self, v: int, tokens: torch.Tensor, positions: torch.Tensor, sends: list, *,
                      context=None, last_position: bool = True) -> Optional[torch.Tensor]:
        """Virtual stage ``v`` of this rank on these rows: receive its input, run it, send its output on.
        Returns, after the model's last virtual stage, the last fed position's logits (``last_position``; else
        the logits as the model returns them, ``[rows, vocab]`` for the paged engine's packed rows), else None.
        ``context``: the inference context of this forward (default the chain's)."""
        model = self.chunks[v]
        if v > 0 or self.pp_rank > 0:
            hidden = torch.empty((tokens.size(1), tokens.size(0), self.hidden_size),
                                 dtype=self.pipeline_dtype, device=self.device)
            torch.distributed.recv(hidden, src=self.prev_rank, group=self.recv_group)
            model.set_input_tensor(hidden)
        output = model(tokens, positions, None, inference_context=self.context if context is None else context,
                       runtime_gather_output=True)
        if v < len(self.chunks) - 1 or not self.is_last_stage:
            sent = output.contiguous()  # kept alive until the send completes
            sends.append((torch.distributed.isend(sent, dst=self.next_rank, group=self.send_group), sent))
            return None
        return output[:, -1] if last_position else output[0]

    def share(self, choice: Optional[StepChoice], batch: int) -> StepChoice:
        """The last stage's TP-rank-0 choice, on every TP and PP rank."""
        if self.tp_size == 1 and self.pp_size == 1:
            return choice
        packed = self._tp_shared(choice, batch)
        if self.pp_size > 1:
            torch.distributed.broadcast(packed, src=self.pp_last_rank, group=self.pp_group)
        return _unpacked(packed)

    def send_choice(self, choice: StepChoice, sends: list) -> StepChoice:
        """On the last stage: TP rank 0's choice, sent on to every other stage (``receive_choice``)."""
        packed = self._tp_shared(choice, choice.tokens.numel())
        for rank in self.pp_ranks[:-1]:
            sends.append((torch.distributed.isend(packed, dst=rank, group=self.return_group), packed))
        return _unpacked(packed)

    def receive_choice(self, rows: int) -> StepChoice:
        packed = torch.empty((3, rows), dtype=torch.float64, device=self.device)
        torch.distributed.recv(packed, src=self.pp_last_rank, group=self.return_group)
        return _unpacked(packed)

    def _tp_shared(self, choice: Optional[StepChoice], batch: int) -> torch.Tensor:
        packed = torch.empty((3, batch), dtype=torch.float64, device=self.device)
        if choice is not None:
            torch.stack([choice.tokens.double(), choice.policy_logprobs.double(),
                         choice.sampling_logprobs.double()], out=packed)
        if self.tp_size > 1 and self.is_last_stage:
            torch.distributed.broadcast(packed, src=self.tp_src_rank, group=self.tp_group)
        return packed


def _unpacked(packed: torch.Tensor) -> StepChoice:
    return StepChoice(tokens=packed[0].long(), policy_logprobs=packed[1].float(), sampling_logprobs=packed[2].float())


@dataclass(kw_only=True)
class _Part(Feed):
    """A contiguous share of the rows decoding on its own, in cache slots ``offset`` on."""

    in_flight: bool = False
    """Fed at the latest step: its choice is on the way to the stages before the last."""


def pipelined_decode(chain: StageChain, rows: DecodeRows, *, first: int, total: int,
                     choose: Callable[[torch.Tensor, torch.Tensor, int], StepChoice], compact: bool,
                     check_every: int, lockstep: Lockstep, recorder=None) -> tuple[int, int]:
    """Decode steps ``first + 1 ..`` of ``rows`` (step ``first``'s choice already recorded) in ``chain.microbatches``
    parts, successive steps overlapping across the stages (module docstring). ``choose(logits, batch_rows, t)``
    picks the tokens of those batch rows at position t (last stage only). Under an expert-parallel ``lockstep``
    the replicas agree per part on when it ends and how many rows it feeds, as the whole batch does at PP=1.
    ``recorder`` (a ``RouteRecorder``) takes each forward's routes. Returns (decode steps run, compactions); the
    rows are complete on every rank."""
    context, device = chain.context, rows.tokens.device
    size = rows.size
    count = max(1, min(chain.microbatches, size))
    parts = [_Part(offset=size * i // count, rows=rows.part(size * i // count, size * (i + 1) // count))
             for i in range(count)]
    virtual = len(chain.chunks)
    steps = 0
    sends: list = []

    def recorded(part: _Part, choice: StepChoice, t: int) -> None:
        part.record(choice, t, check=(t + 1 - first) % check_every == 0, lockstep=lockstep, compact=compact,
                    context=context, total=total)

    try:
        for t in range(first + 1, total + 1):
            earlier, sends = sends, []
            fed_any = False
            for v in range(virtual):
                for part in parts:
                    if v == 0 and part.in_flight and not chain.is_last_stage:
                        recorded(part, chain.receive_choice(part.fed_rows), t - 1)
                    if v == 0:
                        part.in_flight = part.live and t < total
                    if not part.in_flight:
                        continue
                    fed_any = True
                    local = part.fed()
                    context.batch_size_offset = part.offset
                    context.sequence_len_offset = t - 1
                    logits = chain.chunk_forward(v, part.rows.tokens[local, t - 1:t],
                                                 torch.full((local.numel(), 1), t - 1, device=device), sends)
                    if recorder is not None:
                        recorder.take(t - 1, t, rows=part.offset + local, chunk=v)
                    if logits is not None:
                        choice = chain.send_choice(choose(logits, part.offset + local, t), sends)
                        recorded(part, choice, t)
            for handle, _ in earlier:  # received by now: every rank has moved past step t - 1
                handle.wait()
            if not fed_any:
                break
            steps += 1
    finally:
        context.batch_size_offset = 0
        for handle, _ in sends:
            handle.wait()
    return steps, sum(part.compactions for part in parts)
