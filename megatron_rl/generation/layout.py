"""Generation at training layouts that split the sequence or the experts: SP and CP off, experts in lockstep.

The generation phase decodes on the training weights, which do not change with the layout; only the way a
forward pass splits its work does. Two splits make no sense for a decode step (one token per sequence):

* Sequence parallelism (SP) scatters the sequence over the TP ranks between attention/MLP blocks.
  ``whole_sequences(chunks)`` turns it off for the phase and back on after. Megatron Core (0.16.1, 0.19.2) reads it at
  run time from: every ``TransformerConfig`` the modules hold (embedding scatter and dropout fork, rotary
  length, transformer block RNG fork, shared experts), each ``ColumnParallelLinear`` / ``RowParallelLinear``'s
  own ``sequence_parallel`` attribute (all-gather before / reduce-scatter after the matmul, instead of the
  plain TP copy / all-reduce), and the embedding's ``reduce_scatter_embeddings`` flags (``LanguageModelEmbedding``
  and its ``VocabParallelEmbedding``). The norms are plain torch norms under SP (their weights are only tagged
  for the gradient all-reduce). The MoE token
  dispatchers gather over their TP x EP group whatever SP says: without SP every TP rank holds the same tokens,
  the gather holds each token once per TP rank, and the reduce-scatter still hands each rank the full expert
  output of its own copy (each copy is summed over distinct experts or expert-TP shards, never twice).
* Context parallelism (CP) gives each CP rank 2 of 2*cp sequence chunks. CP ranks hold full weights, so they
  generate as extra data-parallel workers over whole sequences (``generation_workers``): the phase sets the
  configs' ``context_parallel_size`` to 1 (Megatron scales the rotary length by it), the rotary embeddings'
  ``cp_group`` to None (else the table is sliced to this rank's chunks), and ``CPDotProductAttention`` back to
  the plain local attention (its ``cp_size`` 1 and a causal softmax again); Transformer Engine attention (GPUs)
  gets no CP group for the phase, as Megatron's ``TEDotProductAttention`` does per call for packed sequences
  (not exercised on CPU). The rotary tables cached under the training layout are dropped on the way in and out.

Expert parallelism (EP): an MoE forward is a collective over the ranks that share experts, which at ep > tp
span data-parallel replicas (and CP ranks, now separate generation workers). ``Lockstep`` makes those replicas
agree, at every engine step, on the most tokens any of them feeds and whether any still generates: every replica
runs the same forwards with the same token counts (the allgather dispatcher needs equal counts; the all-to-all one
only the same number of calls), padding its own, until every replica's rows are finished.

Test: ``.venv/bin/python -m pytest tests/test_grpo_layouts.py -q`` (GRPO at MoE TP2·EP2·SP, CP2, uneven PP2;
first importance ratios 1) and ``tests/dist/gen_layouts.py`` (generation vs the training forward per layout).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _configs(chunks: list) -> list:
    from megatron.core.transformer.transformer_config import TransformerConfig

    found = {}
    for chunk in chunks:
        for module in chunk.modules():
            config = getattr(module, "config", None)
            if isinstance(config, TransformerConfig):
                found[id(config)] = config
    return list(found.values())


def _clear_rotary_caches() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding.forward.cache_clear()
    try:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
        YarnRotaryEmbedding.forward.cache_clear()
    except (ImportError, AttributeError):
        pass


def splits_sequence(chunks: list) -> bool:
    """Whether the chunks' forward splits sequences (SP on, or CP > 1)."""
    return any(c.sequence_parallel or c.context_parallel_size > 1 for c in _configs(chunks))


@contextlib.contextmanager
def whole_sequences(chunks: list) -> Iterator[None]:
    """For the duration: no sequence parallelism and no context parallelism in the modules of ``chunks``
    (see the module docstring for what is switched); everything is restored on exit, also on an error."""
    if not splits_sequence(chunks):
        yield
        return
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.cp_attention import CPDotProductAttention

    undo: list[tuple[object, str, object]] = []

    def switch(obj, name: str, value) -> None:
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        for config in _configs(chunks):
            switch(config, "sequence_parallel", False)
            switch(config, "context_parallel_size", 1)
        for chunk in chunks:
            for module in chunk.modules():
                for flag in ("sequence_parallel", "reduce_scatter_embeddings"):
                    if isinstance(module.__dict__.get(flag), bool) and module.__dict__[flag]:
                        switch(module, flag, False)
                if "Rotary" in type(module).__name__ and getattr(module, "cp_group", None) is not None:
                    switch(module, "cp_group", None)
                if _te_context_parallel(module):
                    saved = tuple(getattr(module, name, None)
                                  for name in ("cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type"))
                    module.set_context_parallel_group(None, None, None, saved[3])
                    undo.append((module, "set_context_parallel_group", saved))
                if isinstance(module, CPDotProductAttention) and module.cp_size > 1:
                    switch(module, "cp_size", 1)
                    # at cp > 1 its softmax takes explicit masks only; the plain local attention is causal
                    switch(module.scale_mask_softmax, "attn_mask_type", module.attn_mask_type)
                    if module.attn_mask_type != AttnMaskType.causal:
                        raise NotImplementedError(f"generation at cp > 1 with attn_mask_type {module.attn_mask_type}")
        _clear_rotary_caches()
        yield
    finally:
        for obj, name, value in reversed(undo):
            if name == "set_context_parallel_group":
                obj.set_context_parallel_group(*value)
            else:
                setattr(obj, name, value)
        _clear_rotary_caches()


def _te_context_parallel(module) -> bool:
    """A Transformer Engine attention module with a CP group (GPUs): the phase gives it none, the way Megatron's
    ``TEDotProductAttention`` turns CP off per call (``set_context_parallel_group(None, None, None, comm_type)``).
    Not exercised on CPU, where Transformer Engine cannot run."""
    return (type(module).__module__.startswith(("transformer_engine", "megatron.core.extensions"))
            and hasattr(module, "set_context_parallel_group") and getattr(module, "cp_group", None) is not None)


# ------------------------------------------------------------------------------------------ generation workers
def generation_workers() -> tuple[int, int]:
    """(number, rank) of the rollout workers: the data-parallel ranks times the context-parallel ranks (each CP
    rank generates whole sequences of its own). Equal on the TP/PP ranks of one worker."""
    from megatron.core import parallel_state as ps

    return (ps.get_data_parallel_world_size(with_context_parallel=True),
            ps.get_data_parallel_rank(with_context_parallel=True))


def experts_span_workers(chunks: list) -> bool:
    """Whether an MoE forward exchanges tokens between generation workers (ep > 1 with more than one worker):
    then every worker must run the same forwards (``Lockstep``)."""
    from megatron.core import parallel_state as ps

    moe = any(getattr(c, "num_moe_experts", None) for c in _configs(chunks))
    return bool(moe) and ps.get_expert_model_parallel_world_size() > 1 and generation_workers()[0] > 1


class Lockstep:
    """The decode loop's collective decisions over the generation workers that share experts.

    One rank per worker takes part in each all-reduce (the data-parallel-with-CP group of this TP/PP position);
    the TP and PP ranks of a worker hold the same values, so every rank reaches the same decisions. Disabled
    (no communication) when the experts do not span workers."""

    def __init__(self, chunks: list) -> None:
        from megatron.core import parallel_state as ps

        from megatron_rl.runtime.distributed import collective_device

        self.enabled = experts_span_workers(chunks)
        self.group = ps.get_data_parallel_group(with_context_parallel=True) if self.enabled else None
        self.device = collective_device(self.group) if self.enabled else None

    def step_shape(self, tokens: int, running: bool) -> tuple[int, bool]:
        """(the most tokens any worker feeds this step, whether any worker still generates): one all-reduce.
        Disabled: this worker's own."""
        if not self.enabled:
            return tokens, running
        packed = torch.tensor([tokens, int(running)], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=self.group)
        most, any_running = packed.tolist()  # one copy to the host
        return most, bool(any_running)
