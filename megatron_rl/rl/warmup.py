"""The SFT warm-up before RL (``algorithm.sft_warmup_steps``): the SFT trainer's step on the run's warm-up
examples, logged with phase "sft", resumable inside the warm-up."""

from __future__ import annotations

from megatron_rl.data.sft import batch_for_step, encode_examples, sft_seq_length
from megatron_rl.runtime.phases import training_phase
from megatron_rl.runtime.training import sft_step


def sft_warm_up(run) -> None:
    """``run`` (an ``RLRun``) takes algorithm.sft_warmup_steps SFT steps from ``run.warmup_done``. A stop request is
    taken after each step: the checkpoint (step 0) records how far the warm-up got, and the requeued run goes on
    from there. The optimizer and LR schedule start afresh for RL afterwards."""
    cfg, algo, engine, ctx = run.cfg, run.algo, run.engine, run.ctx
    examples = encode_examples(run.tokenizer, run.sft_examples, cfg.model.seq_length or run.shape.seq_length,
                               run.chat)
    seq_length = sft_seq_length(examples, multiple=engine.sequence_multiple)
    total = algo.sft_warmup_steps
    for step in range(run.warmup_done + 1, total + 1):
        batch = batch_for_step(examples, step=step, batch_size=algo.global_batch_size, seed=cfg.run.seed)
        with training_phase(engine):
            metrics = sft_step(engine, batch, global_batch_size=algo.global_batch_size,
                               micro_batch_size=cfg.parallel.micro_batch_size, seq_length=seq_length,
                               pad_id=run.tokenizer.pad_id)
        ctx.logger.log(step, metrics, phase="sft", total=total)
        run.warmup_done = step
        if step < total and ctx.stop_in_phase("sft", step):
            ctx.preempt(engine, 0, what=f"SFT warm-up step {step} of {total}")
    engine.reset_optimizer_schedule()
    ctx.say(f"SFT warm-up: {algo.sft_warmup_steps} steps, final loss {metrics['loss']:.4f}")
