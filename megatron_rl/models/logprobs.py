"""Per-token log-probabilities and entropy from vocab-parallel logits (each TP rank holds a slice of the vocab).

Both are over the padded vocabulary, exactly as Megatron's cross entropy and the generation engine's
temperature-1 log-probs, so the colocated importance ratio starts at 1. (Padded ids are never sampled and
their logits are trained down; the Hugging Face export drops them.)
"""

from __future__ import annotations

import torch


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels) from vocab-parallel logits [..., V/tp]; differentiable (Megatron's parallel cross entropy).

    Megatron's cross entropy overwrites float32 logits in place: read anything else from them first.
    """
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the full vocabulary from vocab-parallel logits [..., V/tp] (no gradient)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    logits = logits.float()
    top = logits.max(dim=-1, keepdim=True).values
    torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - top
    exp = shifted.exp()
    stats = torch.stack([exp.sum(-1), (exp * shifted.nan_to_num(neginf=0.0)).sum(-1)])
    torch.distributed.all_reduce(stats, group=group)
    norm, weighted = stats[0], stats[1]
    return norm.log() - weighted / norm
