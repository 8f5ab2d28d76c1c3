"""Per-token log-probs of given sequences from a training-style forward (no KV cache).

``sequence_logprobs(models, tokens)`` runs Megatron's forward-only schedule (so PP / virtual PP apply) and
returns ``logp[b, t] = log p(tokens[b, t + 1] | tokens[b, :t + 1])`` for ``t < S - 1``. The log-softmax is
vocab-parallel under TP: ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` of the TP-sharded
logits is ``-logp`` of the label, over the padded vocabulary, exactly as in the training loss. The GRPO trainer
uses it for old and reference log-probs; tests use it to check generation.

Sequences may be right-padded: positions after a row's real end hold values the caller masks out (the causal
mask keeps them from touching earlier positions).

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q``
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from megatron_rl.generation.decoding import model_chunks


def _logprob_loss(logits: torch.Tensor, *, labels: torch.Tensor):
    from megatron.core import tensor_parallel

    # logits: [b, s, vocab/tp] (GPTModel returns batch-first); the cross entropy wants [s, b, vocab/tp]
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                       labels.transpose(0, 1).contiguous())
    logprobs = -nll.transpose(0, 1).float()
    return logprobs.sum() * 0.0, {"logprobs": logprobs}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    logits = model(batch["tokens"], batch["positions"], None)
    return logits, partial(_logprob_loss, labels=batch["labels"])


def sequence_logprobs(models, tokens: torch.Tensor, *, micro_batch_size: Optional[int] = None) -> torch.Tensor:
    """``[B, S - 1]`` float32 log-probs of ``tokens[:, 1:]``; on every TP/PP rank of the replica.

    ``micro_batch_size`` splits the batch into equal micro-batches (default: the whole batch at once, or pp
    micro-batches under virtual pipelining, whose interleaved schedule needs at least pp of them).
    Runs without gradients, with dropout off; the modules' train/eval mode is restored afterwards.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    wrapped = list(models) if isinstance(models, (list, tuple)) else [models]
    chunks = model_chunks(wrapped)
    device = next(chunks[0].parameters()).device
    tokens = tokens.to(device=device, dtype=torch.long)
    batch, seq = tokens.shape
    if seq < 2:
        raise ValueError("sequence_logprobs needs sequences of at least 2 tokens")
    pp = ps.get_pipeline_model_parallel_world_size()
    mbs = micro_batch_size or (batch // pp if len(chunks) > 1 and batch % pp == 0 else batch)
    if batch % mbs:
        raise ValueError(f"batch {batch} is not divisible by micro_batch_size {mbs}")
    inputs = tokens[:, :-1]
    positions = torch.arange(seq - 1, device=device).unsqueeze(0).expand(batch, -1)
    microbatches = [{"tokens": inputs[i:i + mbs], "positions": positions[i:i + mbs],
                     "labels": tokens[i:i + mbs, 1:]} for i in range(0, batch, mbs)]
    was_training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            data = iter(microbatches) if len(wrapped) == 1 else [iter(microbatches) for _ in wrapped]
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=data, model=wrapped,
                num_microbatches=len(microbatches), seq_length=seq - 1, micro_batch_size=mbs,
                forward_only=True)
    finally:
        for chunk, flag in zip(chunks, was_training):
            chunk.train(flag)
    result = torch.empty((batch, seq - 1), dtype=torch.float32, device=device)
    if ps.is_pipeline_last_stage():
        torch.cat([r["logprobs"] for r in reports], dim=0, out=result)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(result, src=ps.get_pipeline_model_parallel_last_rank(),
                                    group=ps.get_pipeline_model_parallel_group())
    return result
