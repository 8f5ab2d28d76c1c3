"""Held-out evaluation of a policy checkpoint with the colocated generator: ``algorithm.name=eval``.

    .venv/bin/python launch.py eval --ckpt runs/default/checkpoints --config configs/grpo_tiny.yaml eval.stage=grpo

No optimizer and no training: the model chunks at the job's layout (any layout the trainers run) load
``model.init_from``, sample ``eval.samples`` completions of every held-out prompt (data.eval_path, or a
synthetic task's test problems) with the generation settings, score them with ``algorithm.rewards`` (the GRPO
reward functions) and report pass@1, pass@k (k = eval.samples, Chen et al. 2021's unbiased estimator), mean
reward and mean response length (megatron_rl/rollout/colocated.py). Rank 0 prints a short table, logs the figures
with phase "eval" in metrics.jsonl, and adds an entry keyed by ``eval.stage`` (default run.name) to
``<run.dir>/eval.json``: {"pass@1", "pass@k", "k", "mean_reward", "mean_response_length", "n_prompts",
"checkpoint", "kept"}. With ``eval.min_pass_at_1``, a result below it is marked ``kept: false`` and the job exits
3, so that a pipeline stops before the stages after it. A reward-model checkpoint (saved by the rm trainer) is
scored instead on the held-out preference pairs: its entry holds the pair accuracy and reward margin.

Test: ``.venv/bin/python -m pytest tests/test_evaluate.py -q``
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.prompts import load_eval_prompts
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.models.builder import build_model_chunks
from megatron_rl.rewards.job import job_rewards, reward_totals
from megatron_rl.rollout.multi_turn import Environments, episode_metrics
from megatron_rl.rollout.colocated import engine_config, held_out, sample_rollout, summarize
from megatron_rl.runtime.checkpoint import load_checkpoint
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.run_files import EVAL_FILE, GATE_EXIT_CODE
from megatron_rl.trainers import pairs
from megatron_rl.trainers.common import TrainerContext, job_model_options, record_eval

if TYPE_CHECKING:
    from megatron_rl.spec.config.schema import JobConfig
    from megatron_rl.spec.model_shape import ModelShape


class GateFailed(SystemExit):
    """eval.min_pass_at_1 was not reached: the job ends with GATE_EXIT_CODE."""

    def __init__(self) -> None:
        super().__init__(GATE_EXIT_CODE)


def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    if not cfg.model.init_from:
        raise ConfigError("algorithm.name=eval needs the checkpoint to evaluate: model.init_from=CKPT (or "
                          "launch.py eval --ckpt CKPT)")
    if pairs.is_reward_model(cfg.model.init_from):
        return pairs.evaluate_reward_model(cfg, shape, ctx)
    tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    prompts = load_eval_prompts(cfg.data, tokenizer, seed=cfg.run.seed)
    if prompts is None:
        raise ConfigError("algorithm.name=eval needs held-out prompts: set data.eval_path, or a synthetic data.task")
    prompts = list(prompts)[:cfg.eval.max_prompts]
    opts = job_model_options(cfg, shape, ctx.dims)
    chunks = build_model_chunks(shape, opts)
    load_checkpoint(cfg.model.init_from, chunks=chunks, load_optimizer=False)
    rewards = job_rewards(cfg.algorithm, cfg.environment, model=cfg.model, parallel=cfg.parallel,
                          runtime=cfg.runtime)
    # multi-turn: each sample an episode in a fresh environment
    environments = Environments.of(cfg.environment, run_dir=cfg.run.dir, checkpoint_dir=cfg.checkpoint_dir)
    config = engine_config(cfg.generation, tokenizer, vocab_size=shape.vocab_size)

    def generate(batch: list, group: int, seed: int):
        options = dict(config=config, group=group, seed=seed, seq_multiple=opts.dims.sequence_multiple)
        if environments is not None:
            return environments.sample(chunks, batch, chat=ChatFormat.from_config(cfg.data, tokenizer),
                                       stop=cfg.generation.stop, **options)
        return sample_rollout(chunks, batch, tokenizer=tokenizer, **options)

    with ctx.timer() as t_eval:
        rollout = held_out(generate, prompts, samples=cfg.eval.samples, batch_prompts=cfg.algorithm.prompts_per_step,
                           seed_of=lambda start: random.Random(f"eval:{cfg.run.seed}:{start}").getrandbits(62))
    total, rollout.per_fn = reward_totals(rollout, rewards=rewards, episodic=environments is not None)
    rollout.rewards = torch.tensor(total, dtype=torch.float32)
    summary = summarize(rollout, samples=cfg.eval.samples)
    gate = cfg.eval.min_pass_at_1
    kept = gate is None or summary["pass@1"] >= gate
    stage = cfg.eval.stage or cfg.run.name
    entry = {**summary, **episode_metrics(rollout.episodes), "checkpoint": str(cfg.model.init_from), "kept": kept}
    if ctx.rank == 0:
        record_eval(Path(cfg.run.dir) / EVAL_FILE, stage, entry)
        ctx.logger.log(0, {"pass_at_1": summary["pass@1"], "pass_at_k": summary["pass@k"], "k": float(summary["k"]),
                           "reward_mean": summary["mean_reward"], "response_length": summary["mean_response_length"],
                           "prompts": float(summary["n_prompts"]), **episode_metrics(rollout.episodes),
                           "time_eval_s": t_eval.seconds},
                       phase="eval", total=0)
    ctx.logger.close()
    ctx.say(table(stage, entry))
    if not kept:
        ctx.say(f"eval gate: pass@1 {summary['pass@1']:.3f} < eval.min_pass_at_1={gate}: {stage} is discarded")
        raise GateFailed()


def table(stage: str, entry: dict) -> str:
    """The short table the job prints."""
    k = entry["k"]
    head = f"{'stage':<12} {'pass@1':>7} {f'pass@{k}':>7} {'reward':>7} {'length':>7} {'prompts':>7}  kept"
    row = (f"{stage:<12} {entry['pass@1']:>7.3f} {entry['pass@k']:>7.3f} {entry['mean_reward']:>7.3f} "
           f"{entry['mean_response_length']:>7.1f} {entry['n_prompts']:>7d}  {'yes' if entry['kept'] else 'no'}")
    return f"{head}\n{row}"
