"""Supervised fine-tuning on prompt/completion pairs (loss on the completion and its end-of-sequence token).

    python launch.py algorithm.name=sft data.train_path=sft.jsonl run.steps=100

Also the warm-up stage of the default GRPO job (``algorithm.sft_warmup_steps``): a short SFT pass that teaches
a fresh tiny model the answer format, so GRPO starts from a policy that answers (at chance level).
Data: ``megatron_rl.data.sft`` (prompt/completion or chat records from JSONL, JSON, Parquet, Arrow or a
save_to_disk folder; ``data.chat_template`` renders them with the tokenizer's chat template).
"""

from __future__ import annotations

import random

import torch

from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.sft import encode_sft_example, read_sft_records
from megatron_rl.runtime.training import Engine, build_engine, data_parallel_slice
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.trainers.common import TrainerContext
from megatron_rl.trainers.pretrain import lm_batch, lm_loss

REPORTS = ("loss",)


def encode_examples(tokenizer, records: list[dict], max_length: int,
                    chat: ChatFormat | None = None) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per record (``encode_sft_example``)."""
    return [encode_sft_example(tokenizer, r["prompt"], r["completion"], max_length, chat=chat) for r in records]


def collate_sft(examples: list[tuple[list[int], list[int]]], *, seq_length: int, pad_id: int) -> dict:
    """A micro-batch padded to seq_length + 1 tokens; the loss mask is shifted onto the label positions."""
    rows = torch.full((len(examples), seq_length + 1), pad_id, dtype=torch.long)
    masks = torch.zeros((len(examples), seq_length + 1), dtype=torch.float32)
    for i, (ids, mask) in enumerate(examples):
        rows[i, :len(ids)] = torch.tensor(ids)
        masks[i, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return lm_batch(rows, masks)


def sft_step(engine: Engine, examples: list, *, global_batch_size: int, micro_batch_size: int, seq_length: int,
             pad_id: int) -> dict[str, float]:
    """One optimizer step of SFT on ``examples`` (the global batch, identical on every rank)."""
    micro = data_parallel_slice(examples[:global_batch_size], micro_batch_size=micro_batch_size)
    batches = [collate_sft(mb, seq_length=seq_length, pad_id=pad_id) for mb in micro]
    return engine.train_step(batches, lm_loss, seq_length=seq_length, report_names=REPORTS)


def batch_for_step(examples: list, *, step: int, batch_size: int, seed: int) -> list:
    """The SFT examples of a step: a deterministic function of (seed, step), the same on every rank."""
    rng = random.Random(f"sft:{seed}:{step}")
    return [examples[rng.randrange(len(examples))] for _ in range(batch_size)]


def sft_seq_length(examples: list, *, multiple: int = 1) -> int:
    """The longest example, rounded up to ``multiple`` (``Engine.sequence_multiple``); the extra positions are
    masked right padding, so the loss does not change."""
    longest = max(len(ids) for ids, _ in examples)
    return -(-longest // multiple) * multiple


def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    from megatron_rl.data.synthetic import TASKS, sft_records, split_problems
    from megatron_rl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.data.train_path:
        records = read_sft_records(cfg.data.train_path, prompt_key=cfg.data.prompt_key,
                                   answer_key=cfg.data.answer_key, messages_key=cfg.data.messages_key)
    elif cfg.data.task in TASKS:
        train_problems, _ = split_problems(cfg.data.task, seed=cfg.run.seed)
        records = sft_records(train_problems, task=cfg.data.task, answers="correct")
    else:
        raise ConfigError(f"data.task={cfg.data.task!r} has no SFT data; set data.train_path to a data file")
    max_length = cfg.data.max_length or cfg.model.seq_length or shape.seq_length
    examples = encode_examples(tokenizer, records, max_length, ChatFormat.from_config(cfg.data, tokenizer))
    engine = build_engine(cfg, shape)
    seq_length = sft_seq_length(examples, multiple=engine.sequence_multiple)
    start = ctx.resume(engine)
    for step in range(start + 1, cfg.run.steps + 1):
        with ctx.timer() as timer:
            batch = batch_for_step(examples, step=step, batch_size=cfg.algorithm.global_batch_size, seed=cfg.run.seed)
            metrics = sft_step(engine, batch, global_batch_size=cfg.algorithm.global_batch_size,
                               micro_batch_size=cfg.parallel.micro_batch_size, seq_length=seq_length,
                               pad_id=tokenizer.pad_id)
        metrics["step_time_s"] = timer.seconds
        ctx.end_step(engine, step, metrics)
    ctx.finish(engine)
