"""Supervised fine-tuning on prompt/completion pairs (loss on the completion and its end-of-sequence token).

    python launch.py algorithm.name=sft data.train_path=sft.jsonl run.steps=100

Also the warm-up stage of the default GRPO job (``algorithm.sft_warmup_steps``): a short SFT pass that teaches
a fresh tiny model the answer format, so GRPO starts from a policy that answers (at chance level).
Data: ``megatron_rl.data.sft`` (prompt/completion or chat records from JSONL, JSON, Parquet, Arrow or a
save_to_disk folder; ``data.chat_template`` renders them with the tokenizer's chat template).
"""

from __future__ import annotations

from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.sft import batch_for_step, encode_examples, read_sft_records, sft_seq_length
from megatron_rl.runtime.training import sft_step
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.trainers.common import TrainerContext, job_engine


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
    engine = job_engine(cfg, shape, dims=ctx.dims)
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
