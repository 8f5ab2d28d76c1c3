"""Generation across pipeline stages: the hand-over of hidden states and of the chosen tokens.

``StageChain`` is the pipeline of one replica as the paged engine (engine.py) sees it from this rank:
``chunk_forward`` runs one virtual stage of a forward (receive the previous stage's hidden states, run the chunk,
send them on), and the last stage's choice reaches every rank (``share`` at PP=1, ``send_choice`` /
``receive_choice`` under PP). The engine's ``_run_pipelined`` decodes the rows in ``microbatches`` parts, each on its
own, so that part m's step t + 1 enters stage 0 while the later stages work on the other parts' step t; with
M >= pp parts every stage is busy in the steady state.

The last stage picks the tokens (TP rank 0's choice, broadcast over TP) and sends each part's choice straight to
every other stage. Messages to an earlier stage (the choices, and the last stage's hand-over to stage 0's next
virtual stage) travel on a group of their own (``runtime.distributed.pipeline_return_group``), so every
communicator carries one direction, its messages in the order both ends post them. They go untagged, as NCCL
matches them; gloo matches untagged messages by order too, so the CPU runs check that order.

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q -k pipelined`` (PP2 x VPP2 in 1, 2 and 3 parts);
``bench/pipeline_decode.py`` times the parts against the stages in turn.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.generation.sampling import StepChoice
from megatron_rl.runtime.distributed import pipeline_return_group

def default_pipeline_microbatches(pp: int) -> int:
    """pp parts: with M >= pp parts every stage works at once in the steady state of the pipelined decode. On the
    CPU, where a forward of half the rows costs nearly as much as one of all of them, bench/pipeline_decode.py
    still measured 2 parts at PP2 1.22x the speed of the stages in turn (small model, 64 rows)."""
    return pp


class StageChain:
    """The pipeline stages of one replica as seen from this rank: forwards through every (virtual) stage, the
    hand-over of hidden states, and the last stage's choice shared with every rank."""

    def __init__(self, chunks: list, *, device: torch.device, microbatches: Optional[int] = None) -> None:
        from megatron.core import parallel_state as ps

        self.chunks = chunks
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

    def chunk_forward(self, v: int, tokens: torch.Tensor, positions: torch.Tensor, sends: list, *,
                      context) -> Optional[torch.Tensor]:
        """Virtual stage ``v`` of this rank on one forward's packed tokens (``[1, tokens]``, inference ``context``):
        receive its input, run it, send its output on. Returns, after the model's last virtual stage, the logits
        ``[rows, vocab]`` of each row's last token, else None."""
        model = self.chunks[v]
        if v > 0 or self.pp_rank > 0:
            hidden = torch.empty((tokens.size(1), tokens.size(0), self.hidden_size),
                                 dtype=self.pipeline_dtype, device=self.device)
            torch.distributed.recv(hidden, src=self.prev_rank, group=self.recv_group)
            model.set_input_tensor(hidden)
        output = model(tokens, positions, None, inference_context=context, runtime_gather_output=True)
        if v < len(self.chunks) - 1 or not self.is_last_stage:
            sent = output.contiguous()  # kept alive until the send completes
            sends.append((torch.distributed.isend(sent, dst=self.next_rank, group=self.send_group), sent))
            return None
        return output[0]

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
