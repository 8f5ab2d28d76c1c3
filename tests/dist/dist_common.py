"""What the torchrun check scripts in tests/dist share: starting a layout (several, one after another, in one
launch), a short pretraining of the engine they check, and writing each rank's result for the test that started
them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch


def start_layout(*, seed: int, **sizes):
    """Megatron's parallel state at ``sizes`` (``job_dims``' keywords) in this launch's processes, made again when
    an earlier layout of the same launch set it (a check of several layouts starts its processes once)."""
    from megatron.core import parallel_state

    from megatron_rl.runtime.distributed import initialize, job_dims

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    return initialize(job_dims(**sizes), seed=seed)


def progression_trainer(engine, *, micro_batch_size: int) -> Callable[[int], dict]:
    """``train_step(step)``: one optimizer step of ``engine`` on the pretrain progression task (global batch of
    4 rows of 16 tokens, this DP rank's share), the same data at every layout."""
    from megatron_rl.runtime.training import data_parallel_slice
    from megatron_rl.algorithms.lm_loss import lm_loss
    from megatron_rl.data.batches import collate_lm, progression_batch

    vocab = engine.shape.vocab_size

    def train_step(step: int) -> dict:
        rows = progression_batch(seed=7, step=step, batch_size=4, seq_length=16, vocab_size=vocab)
        micro = data_parallel_slice(list(rows), micro_batch_size=micro_batch_size)
        return engine.train_step([collate_lm(torch.stack(mb)) for mb in micro], lm_loss, seq_length=16,
                                 report_names=("loss",))

    return train_step


def write_rank_result(out: str | Path, result: dict) -> None:
    """``OUT/rank{R}.json`` of this rank, then a barrier (every rank has written when any returns)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
