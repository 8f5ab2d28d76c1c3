"""A training run's held-out evaluation (``data.eval_interval``): pass@1 and mean reward, phase "eval"."""

from __future__ import annotations

import random

import torch

from megatron_rl.rollout.colocated import held_out, summarize


def evaluate_held_out(run, step: int) -> dict[str, float]:
    """pass@1 of ``run`` (an ``RLRun``: one sample per held-out prompt, the generation settings) and mean reward,
    logged with phase "eval". Its seeds are its own, so evaluating leaves training's random stream, and metrics,
    unchanged."""
    with run.ctx.timer() as t_eval:
        rollout = held_out(lambda batch, group, seed: run.generate(batch, group=group, seed=seed,
                                                                   record_routes=False),
                           list(run.eval_prompts), samples=1, batch_prompts=run.algo.rollout_size,
                           seed_of=lambda start: random.Random(f"eval:{run.cfg.run.seed}:{step}:{start}")
                           .getrandbits(62))
    total, rollout.per_fn = run.scorer.totals(rollout)
    rollout.rewards = torch.tensor(total, dtype=torch.float32)
    summary = summarize(rollout, samples=1)
    metrics = {"pass_at_1": summary["pass@1"], "reward_mean": summary["mean_reward"],
               "prompts": float(summary["n_prompts"]), "time_eval_s": t_eval.seconds}
    run.ctx.logger.log(step, metrics, phase="eval")
    return metrics
