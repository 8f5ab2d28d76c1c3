"""Held-out evaluation of a policy checkpoint with the colocated generator: ``algorithm.name=eval``.

    .venv/bin/python launch.py eval --ckpt runs/default/checkpoints --config configs/grpo_tiny.yaml eval.stage=grpo

No optimizer and no training: the model chunks at the job's layout (any layout the trainers run) load
``model.init_from``, sample ``eval.samples`` completions of every held-out prompt (data.eval_path, or a
synthetic task's test problems) with the generation settings, score them with ``algorithm.rewards`` (the GRPO
reward functions) and report pass@1, pass@k (k = eval.samples, Chen et al. 2021's unbiased estimator), mean
reward and mean response length (megatron_rl/rollout/sampling.py). Rank 0 prints a short table, logs the figures
with phase "eval" in metrics.jsonl, and adds an entry keyed by ``eval.stage`` (default run.name) to
``<run.dir>/eval.json``: {"pass@1", "pass@k", "k", "mean_reward", "mean_response_length", "n_prompts",
"checkpoint", "kept"}. With ``eval.min_pass_at_1``, a result below it is marked ``kept: false`` and the job exits
3, so that a pipeline stops before the stages after it. A reward-model checkpoint (saved by the rm trainer) is
scored instead on the held-out preference pairs: its entry holds the pair accuracy and reward margin.

Test: ``.venv/bin/python -m pytest tests/test_evaluate.py -q``
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from megatron_rl.rollout.sampling import held_out, sample_rollout, summarize
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.spec.run_files import EVAL_FILE, GATE_EXIT_CODE
from megatron_rl.trainers.common import TrainerContext


class GateFailed(SystemExit):
    """eval.min_pass_at_1 was not reached: the job ends with GATE_EXIT_CODE."""

    def __init__(self) -> None:
        super().__init__(GATE_EXIT_CODE)


def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    from megatron_rl.data.prompts import load_eval_prompts
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.builder import build_model_chunks
    from megatron_rl.runtime import checkpoint as ckpt
    from megatron_rl.runtime.training import model_options
    from megatron_rl.rollout.multi_turn import Environments, episode_metrics
    from megatron_rl.rewards.job import job_rewards, reward_totals

    if not cfg.model.init_from:
        raise ConfigError("algorithm.name=eval needs the checkpoint to evaluate: model.init_from=CKPT (or "
                          "launch.py eval --ckpt CKPT)")
    if is_reward_model(cfg.model.init_from):
        return evaluate_reward_model(cfg, shape, ctx)
    tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    prompts = load_eval_prompts(cfg, tokenizer)
    if prompts is None:
        raise ConfigError("algorithm.name=eval needs held-out prompts: set data.eval_path, or a synthetic data.task")
    prompts = list(prompts)[:cfg.eval.max_prompts]
    opts = model_options(cfg, shape)
    chunks = build_model_chunks(shape, opts)
    ckpt.load_checkpoint(cfg.model.init_from, chunks=chunks, load_optimizer=False)
    rewards = job_rewards(cfg.algorithm, cfg.environment, model=cfg.model, parallel=cfg.parallel,
                          runtime=cfg.runtime)
    environments = Environments.of_job(cfg)  # multi-turn: each sample an episode in a fresh environment

    def generate(batch: list, group: int, seed: int):
        options = dict(cfg=cfg, shape=shape, tokenizer=tokenizer, group=group, seed=seed,
                       seq_multiple=opts.dims.sequence_multiple)
        if environments is not None:
            return environments.sample(chunks, batch, **options)
        return sample_rollout(chunks, batch, record_routes=False, **options)

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
        record(Path(cfg.run.dir) / EVAL_FILE, stage, entry)
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


def is_reward_model(checkpoint: str) -> bool:
    """Whether ``checkpoint`` was saved by the rm trainer (its common state carries the reward-model metadata)."""
    from megatron_rl.rewards.reward_model_scorer import read_reward_model_metadata

    try:
        read_reward_model_metadata(checkpoint)
    except ConfigError:
        return False
    return True


def evaluate_reward_model(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    """A reward-model checkpoint: held-out pair accuracy (the rm trainer's own evaluation, phase "eval") as its
    eval.json entry: {"accuracy", "reward_margin", "n_pairs", "checkpoint", "kept"}."""
    from megatron_rl.algorithms.reward_model import RM_REPORTS, preference_loss
    from megatron_rl.models.reward_model import build_reward_model_chunks, load_reward_model_weights, reward_forward
    from megatron_rl.runtime.training import build_engine
    from megatron_rl.trainers import pairs

    max_length = pairs.preference_max_length(cfg, shape)
    encoder, _, held_out_pairs = pairs.load_pairs(cfg, shape, max_length=max_length)
    if held_out_pairs is None:
        raise ConfigError("evaluating a reward model needs held-out preference pairs: set data.eval_path, or a "
                          "synthetic prefer_* data.task")
    engine = build_engine(cfg, shape, build_chunks=build_reward_model_chunks)
    load_reward_model_weights(cfg.model.init_from, engine.chunks)
    batcher = pairs.RewardPairBatcher(cfg, pad_id=encoder.pad_id, max_length=max_length)
    algo = cfg.algorithm
    metrics = pairs.evaluate(engine, batcher, held_out_pairs, cfg, lambda rewards, batch: preference_loss(
        rewards, batch, margin=algo.rm_margin, centering_coef=algo.rm_centering_coef), forward_fn=reward_forward,
        report_names=RM_REPORTS)
    stage = cfg.eval.stage or cfg.run.name
    entry = {"accuracy": metrics["accuracy"], "reward_margin": metrics["reward_margin"],
             "n_pairs": len(held_out_pairs), "checkpoint": str(cfg.model.init_from), "kept": True}
    if ctx.rank == 0:
        record(Path(cfg.run.dir) / EVAL_FILE, stage, entry)
        ctx.logger.log(0, metrics, phase="eval", total=0)
    ctx.logger.close()
    ctx.say(f"{'stage':<12} {'accuracy':>8} {'margin':>8} {'pairs':>7}\n"
            f"{stage:<12} {entry['accuracy']:>8.3f} {entry['reward_margin']:>8.3f} {entry['n_pairs']:>7d}")


def record(path: Path, stage: str, entry: dict) -> None:
    """Add (or replace) ``stage``'s entry in the eval.json at ``path``, privately."""
    from megatron_rl.spec.private import write_private_text

    entries = json.loads(path.read_text()) if path.is_file() else {}
    entries[stage] = entry
    write_private_text(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")


def table(stage: str, entry: dict) -> str:
    """The short table the job prints."""
    k = entry["k"]
    head = f"{'stage':<12} {'pass@1':>7} {f'pass@{k}':>7} {'reward':>7} {'length':>7} {'prompts':>7}  kept"
    row = (f"{stage:<12} {entry['pass@1']:>7.3f} {entry['pass@k']:>7.3f} {entry['mean_reward']:>7.3f} "
           f"{entry['mean_response_length']:>7.1f} {entry['n_prompts']:>7d}  {'yes' if entry['kept'] else 'no'}")
    return f"{head}\n{row}"
