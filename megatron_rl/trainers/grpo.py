"""GRPO on Megatron Core with colocated rollouts: the default job of ``python launch.py``.

    python launch.py                                   # tiny model, synthetic task, 2 local CPU processes
    python launch.py --config configs/grpo_tiny.yaml parallel.tp=2
    python launch.py --config configs/grpo_llama70b.yaml cluster.nodes=8 --wait   # a Slurm cluster

Each step reads like the algorithm: generate (the training weights sample ``group_size`` completions per
prompt, in the same processes), score (verifiers, a reward model, or your function), compute group-relative
advantages, train (one or more optimizer steps through Megatron's forward-backward schedule), save.

Layouts: generation runs at every training layout (megatron_rl/generation/layout.py): sequence and context
parallelism are off while generating, context-parallel ranks generate as extra rollout workers (the rollout is
split over the dp*cp workers, then gathered whole on every rank, and training slices it by DP rank as usual),
and MoE models at ep > 1 decode in lockstep over the workers that share experts.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Any, Optional

import torch

from launcher.config.schema import JobConfig
from launcher.errors import ConfigError
from launcher.model_shape import ModelShape
from megatron_rl.algorithms.advantages import expand_group_mask, group_advantages, groups_with_signal
from megatron_rl.algorithms.policy_loss import GRPOLossConfig
from megatron_rl.rollout.batch import REPORTS, Rollout, collate_rollout, make_grpo_loss, rollout_rows
from megatron_rl.runtime import checkpoint as ckpt
from megatron_rl.runtime.distributed import on_rank_zero
from megatron_rl.runtime.phases import generation_phase, training_phase
from megatron_rl.runtime.training import (Engine, build_engine, data_parallel_share, data_parallel_slice,
                                          gather_data_parallel, logits_forward)
from megatron_rl.trainers.common import TrainerContext

RULE_VERIFIERS = ("exact", "math")


# ----------------------------------------------------------------------------------------------- the loop
def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    run = GrpoRun(cfg, shape, ctx)
    start = run.resume_or_warm_up()
    for step in range(start + 1, cfg.run.steps + 1):
        with ctx.timer() as t_generate:
            prompts = run.sampler.next_batch()
            rollout = run.generate(prompts)
        with ctx.timer() as t_score:
            run.score(rollout)
        with ctx.timer() as t_train:
            train_metrics = run.train_on(rollout)
        metrics = run.step_metrics(rollout, train_metrics, t_generate.seconds, t_score.seconds, t_train.seconds)
        ctx.end_step(run.engine, step, metrics)
    run.finish()


class GrpoRun:
    """State of one GRPO run: policy engine, optional reference model, data, rewards and generation RNG."""

    def __init__(self, cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
        from megatron_rl.data.tokenizer import load_tokenizer

        self.cfg, self.shape, self.ctx = cfg, shape, ctx
        self.algo = cfg.algorithm
        self.tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
        if self.tokenizer.vocab_size > shape.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but model {shape.name} only "
                              f"{shape.vocab_size}; use a matching model.tokenizer")
        self.dataset, self.sft_examples = load_prompt_data(cfg, Path(cfg.run.dir))
        from megatron_rl.data.prompts import PromptSampler

        self.sampler = PromptSampler(self.dataset, self.algo.prompts_per_step, seed=cfg.run.seed)
        self.rewards = build_rewards(cfg, shape)
        self.loss_fn = make_grpo_loss(GRPOLossConfig.from_algorithm(self.algo,
                                                                    max_response_len=cfg.generation.max_new_tokens))
        self.engine: Engine = build_engine(cfg, shape)
        self.reference = None
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        ctx.extra_state = self.extra_state

    # ------------------------------------------------------------------ state
    def extra_state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "generator": self.generator.get_state()}

    def resume_or_warm_up(self) -> int:
        start = self.ctx.resume(self.engine)
        if start:
            extra = self.ctx.resumed_extra
            self.sampler.load_state_dict(extra["sampler"])
            self.generator.set_state(extra["generator"])
        elif self.algo.sft_warmup_steps:
            self.warm_up()
        if self.algo.kl_coef > 0:  # the weights GRPO started from, kept with the run's checkpoints
            self.reference = self.engine.frozen_copy(self.ctx.ckpt_dir / "reference")
        return start

    def warm_up(self) -> None:
        """A short SFT stage (the project's SFT trainer step) before GRPO; logged with phase "sft"."""
        from megatron_rl.trainers.sft import batch_for_step, encode_examples, sft_seq_length, sft_step

        examples = encode_examples(self.tokenizer, self.sft_examples, self.cfg.model.seq_length or self.shape.seq_length)
        seq_length = sft_seq_length(examples, multiple=self.engine.sequence_multiple)
        for step in range(1, self.algo.sft_warmup_steps + 1):
            batch = batch_for_step(examples, step=step, batch_size=self.algo.global_batch_size, seed=self.cfg.run.seed)
            with training_phase(self.engine):
                metrics = sft_step(self.engine, batch, global_batch_size=self.algo.global_batch_size,
                                   micro_batch_size=self.cfg.parallel.micro_batch_size, seq_length=seq_length,
                                   pad_id=self.tokenizer.pad_id)
            self.ctx.logger.log(step, metrics, phase="sft", total=self.algo.sft_warmup_steps)
        self.engine.reset_optimizer_schedule()
        self.ctx.say(f"SFT warm-up: {self.algo.sft_warmup_steps} steps, final loss {metrics['loss']:.4f}")

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: list) -> Rollout:
        """group_size completions per prompt; each rollout worker (data-parallel x context-parallel rank)
        samples its share, then all see all."""
        from megatron_rl.generation import data_parallel_seed, generate

        group = self.algo.group_size
        texts = [p.prompt for p in prompts for _ in range(group)]
        prompt_ids = [self.tokenizer.encode(t, add_bos=True) for t in texts]
        gen = self.cfg.generation
        step_seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        mine = data_parallel_share(prompt_ids, with_context_parallel=True)
        with generation_phase(self.engine, offload_optimizer=gen.offload_optimizer):
            out = generate(
                [ckpt.unwrap(c) for c in self.engine.chunks], mine,
                max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                eos_id=self.tokenizer.eos_id, stop_sequences=[self.tokenizer.encode(s) for s in gen.stop],
                vocab_size=min(self.tokenizer.vocab_size, self.shape.vocab_size), seed=data_parallel_seed(step_seed))
        sampled = gather_data_parallel([(list(tokens), list(map(float, lp)))
                                        for tokens, lp in zip(out.tokens, out.logprobs)], with_context_parallel=True)
        responses, logprobs = [tokens for tokens, _ in sampled], [lp for _, lp in sampled]
        completions = [self.tokenizer.decode(r) for r in responses]
        return Rollout(prompt_ids=prompt_ids, response_ids=responses, logprobs=logprobs, prompts=texts,
                       completions=completions, answers=[p.answer for p in prompts for _ in range(group)],
                       seq_multiple=self.engine.sequence_multiple)

    # ------------------------------------------------------------------ score
    def score(self, rollout: Rollout) -> None:
        total, per_fn = self.rewards.score(rollout.prompts, rollout.completions, rollout.answers)
        rollout.rewards = torch.tensor(total, dtype=torch.float32)
        rollout.per_fn = per_fn
        rollout.advantages = group_advantages(rollout.rewards, self.algo.group_size,
                                              normalize_std=self.algo.advantage == "std")

    # ------------------------------------------------------------------ train
    def train_on(self, rollout: Rollout) -> dict[str, float]:
        """One optimizer step per mini-batch of global_batch_size completions."""
        rows = rollout_rows(rollout)
        if self.algo.drop_zero_signal_groups:
            keep = expand_group_mask(groups_with_signal(rollout.rewards, self.algo.group_size), self.algo.group_size)
            rows = [row for row, kept in zip(rows, keep.tolist()) if kept]
        gbs = self.algo.global_batch_size
        usable = len(rows) - len(rows) % gbs
        if usable == 0:
            return {"skipped_minibatches": 1.0}
        seq_length = rollout.seq_length
        totals: dict[str, list[float]] = {}
        with training_phase(self.engine):
            for start in range(0, usable, gbs):
                micro = data_parallel_slice(rows[start:start + gbs], micro_batch_size=self.cfg.parallel.micro_batch_size)
                batches = [collate_rollout(mb, seq_length=seq_length, pad_id=self.tokenizer.pad_id) for mb in micro]
                if self.reference is not None:
                    self.engine.reference_logprobs(self.reference, batches, seq_length=seq_length)
                metrics = self.engine.train_step(batches, self.loss_fn, seq_length=seq_length, report_names=REPORTS,
                                                 forward_fn=logits_forward)
                for key, value in metrics.items():
                    totals.setdefault(key, []).append(value)
                if start == 0:
                    totals["first_ratio_min"] = [metrics["ratio_min"]]
                    totals["first_ratio_max"] = [metrics["ratio_max"]]
        return _combine_minibatches(totals)

    # ------------------------------------------------------------------ metrics and end
    def step_metrics(self, rollout: Rollout, train: dict, t_gen: float, t_score: float, t_train: float) -> dict:
        rewards = rollout.rewards
        lengths = torch.tensor([len(r) for r in rollout.response_ids], dtype=torch.float32)
        verifier = next((name for name in RULE_VERIFIERS if name in rollout.per_fn), None)
        correct = torch.tensor(rollout.per_fn[verifier]) >= 1.0 if verifier else rewards > 0
        gen_tokens = float(lengths.sum())
        train_tokens = gen_tokens + sum(len(p) for p in rollout.prompt_ids)
        metrics = {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "accuracy": float(correct.float().mean()), "response_length": float(lengths.mean()),
            **{f"reward_{name}": float(torch.tensor(v).mean()) for name, v in rollout.per_fn.items()},
            **train,
            "generate_tokens_per_s": gen_tokens / max(t_gen, 1e-9),
            "train_tokens_per_s": train_tokens / max(t_train, 1e-9),
            "time_generate_s": t_gen, "time_score_s": t_score, "time_train_s": t_train,
            "step_time_s": t_gen + t_score + t_train,
        }
        return metrics

    def finish(self) -> None:
        self.ctx.finish(self.engine)
        if self.cfg.logging.plot and self.ctx.rank == 0:
            from megatron_rl.plotting import plot_run

            self.ctx.say(f"curves: {plot_run(self.cfg.run.dir)}")


# ------------------------------------------------------------------------------------------------ helpers
def _combine_minibatches(totals: dict[str, list[float]]) -> dict[str, float]:
    combined = {}
    for key, values in totals.items():
        if key.endswith("_min"):
            combined[key] = min(values)
        elif key.endswith("_max"):
            combined[key] = max(values)
        else:
            combined[key] = sum(values) / len(values)
    combined["minibatches"] = float(len(totals.get("loss", [])))
    return combined


def load_prompt_data(cfg: JobConfig, run_dir: Path):
    """(PromptDataset, SFT examples) from data.train_path, or the synthetic data.task written under run.dir/data."""
    from megatron_rl.data.prompts import PromptDataset
    from megatron_rl.data.synthetic import TASKS, write_synthetic_dataset
    from megatron_rl.data.sft import read_sft_jsonl

    if cfg.data.warmup_task is not None and cfg.data.warmup_task not in TASKS:
        raise ConfigError(f"data.warmup_task={cfg.data.warmup_task!r} is not a synthetic task ({', '.join(TASKS)}); "
                          "or set it to null")
    if cfg.data.train_path:
        dataset = PromptDataset.from_jsonl(cfg.data.train_path, prompt_key=cfg.data.prompt_key,
                                           answer_key=cfg.data.answer_key)
        sft = [{"prompt": r.prompt, "completion": str(r.answer)} for r in dataset]
        return dataset, _warmup_records(cfg) or sft
    if cfg.data.task not in TASKS:
        raise ConfigError(f"data.task={cfg.data.task!r} is not a synthetic task ({', '.join(TASKS)}); "
                          "or set data.train_path to a JSONL file")
    data_dir = run_dir / "data"
    on_rank_zero(lambda: write_synthetic_dataset(data_dir, task=cfg.data.task, seed=cfg.run.seed,
                                                 sft_answers="random"))
    dataset = PromptDataset.from_jsonl(data_dir / "train.jsonl")
    return dataset, _warmup_records(cfg) or read_sft_jsonl(data_dir / "sft.jsonl")


def _warmup_records(cfg: JobConfig) -> list[dict]:
    """Correct prompt/completion pairs of data.warmup_task (a related task), or [] when it is null."""
    from megatron_rl.data.synthetic import sft_records, split_problems

    if cfg.data.warmup_task is None:
        return []
    problems, _ = split_problems(cfg.data.warmup_task, seed=cfg.run.seed)
    return sft_records(problems, task=cfg.data.warmup_task, answers="correct")


def build_rewards(cfg: JobConfig, shape: ModelShape):
    """WeightedRewards from algorithm.rewards ({name or dotted path: weight}); `rm` is the trained reward model."""
    from megatron_rl.rewards import WeightedRewards, build_reward_fn

    fns, weights = {}, {}
    for name, weight in cfg.algorithm.reward_weights.items():
        if name == "rm":
            if not cfg.algorithm.reward_model:
                raise ConfigError("algorithm.rewards has `rm` but algorithm.reward_model is not set; give the RM "
                                  "checkpoint folder")
            from megatron_rl.rewards.reward_model_scorer import RewardModelScorer

            fns[name] = RewardModelScorer(cfg.algorithm.reward_model, dtype=cfg.model.dtype,
                                          micro_batch_size=cfg.parallel.micro_batch_size,
                                          sequence_parallel=cfg.parallel.sequence_parallel)
        else:
            fns[name] = build_reward_fn(name)
        weights[name] = float(weight)
    return WeightedRewards(fns=fns, weights=weights)
