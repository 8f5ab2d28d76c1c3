"""RL post-training on Megatron Core: GRPO (and its variants: Dr. GRPO, DAPO, CISPO, on-policy distillation) and
PPO, colocated or with rollout workers. The default job of ``python launch.py``.

    python launch.py                                   # GRPO: tiny model, synthetic task, 2 local CPU processes
    python launch.py --config configs/ppo_tiny.yaml    # PPO: the same loop with a critic
    python launch.py --config configs/grpo_async_tiny.yaml      # 1 trainer + 1 rollout worker process on CPU
    python launch.py --config configs/grpo_llama70b.yaml cluster.nodes=8 --wait   # a Slurm cluster

Each step reads like the algorithm: sample (generate ``group_size`` completions per prompt, and score them),
train (the old policy's, the reference's and the teacher's log-probs, the advantages, then one or more optimizer
steps through Megatron's forward-backward schedule), sync the weights, evaluate, save. What differs between
the algorithms and placements is a strategy the loop calls (``megatron_rl.rl``):

- the sample source: ``Colocated`` (the training weights sample, in the same processes) or ``RolloutWorkers``
  (``cluster.rollout_tasks > 0``: workers generate while the trainers step, within a staleness bound);
- the advantages: ``GroupAdvantages`` (GRPO: group-relative rewards) or ``Critic`` (PPO: a value model and GAE,
  with its own optimizer step after each policy step).

Layouts: generation runs at every training layout (megatron_rl/generation/layout.py): sequence and context
parallelism are off while generating, context-parallel ranks generate as extra rollout workers (the rollout is
split over the dp*cp workers, then gathered whole on every rank, and training slices it by DP rank as usual),
and MoE models at ep > 1 decode in lockstep over the workers that share experts. With algorithm.router_replay an
MoE rollout carries the experts generation chose, and its training forwards use them
(megatron_rl/models/router_replay.py).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from megatron_rl.algorithms.policy_loss import GRPOLossConfig
from megatron_rl.data.prompts import PromptSampler, load_eval_prompts, load_prompt_data
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.rewards.job import job_rewards
from megatron_rl.rl.advantages import GroupAdvantages
from megatron_rl.rl.critic import Critic
from megatron_rl.rl.minibatches import Minibatcher, PackingFigures, combine_minibatches, forward_length, record_policy_step
from megatron_rl.rl.rollout_workers import RolloutWorkers
from megatron_rl.rl.scoring import Scorer
from megatron_rl.rl.sources import Colocated, SampledBatch
from megatron_rl.rl.warmup import sft_warm_up
from megatron_rl.rollout.batch import REPORTS, TEACHER_REPORTS, Rollout, RolloutBatch, make_grpo_loss, store_logprobs
from megatron_rl.rollout.multi_turn import Environments, episode_metrics
from megatron_rl.rollout.sampling import correct_answers, held_out, sample_rollout, summarize
from megatron_rl.runtime.distributed import on_rank_zero
from megatron_rl.runtime.phases import generation_phase, offload_metrics, training_phase
from megatron_rl.runtime.training import Engine, build_engine, logits_forward
from megatron_rl.spec.errors import ConfigError
from megatron_rl.trainers.common import WARMUP_DONE, TrainerContext

if TYPE_CHECKING:
    from megatron_rl.spec.config.schema import JobConfig
    from megatron_rl.spec.model_shape import ModelShape


# ----------------------------------------------------------------------------------------------- the loop
def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    run = RLRun(cfg, shape, ctx)
    with run.source.serving():  # rollout workers generate until the loop ends
        start = run.resume_or_warm_up()
        for step in range(start + 1, cfg.run.steps + 1):
            batch = run.source.sample(step)  # generate and score; DAPO dynamic sampling draws until it has signal
            ctx.log_samples(step, batch.drawn)
            with ctx.timer() as t_train:
                train_metrics = run.train_on(batch.kept, step)  # log-probs, advantages, optimizer steps
            run.source.sync_weights(step)  # rollout workers: the new weights reach them
            if run.eval_prompts is not None and step % cfg.data.eval_interval == 0:
                run.evaluate(step)  # held-out pass@1, logged with phase "eval"
            ctx.end_step(run.engine, step, run.step_metrics(batch, train_metrics, t_train.seconds))
        run.finish()


class RLRun:
    """State of one RL run: policy engine, optional reference and teacher, data, rewards, generation RNG, and the
    run's sample source and advantage strategy."""

    def __init__(self, cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
        self.cfg, self.shape, self.ctx = cfg, shape, ctx
        self.algo = cfg.algorithm
        self.tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
        if self.tokenizer.vocab_size > shape.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but model {shape.name} only "
                              f"{shape.vocab_size}; use a matching model.tokenizer")
        self.dataset, self.sft_examples = load_prompt_data(cfg.data, self.tokenizer, seed=cfg.run.seed,
                                                           run_dir=Path(cfg.run.dir), write_once=on_rank_zero)
        self.eval_prompts = load_eval_prompts(cfg, self.tokenizer) if cfg.data.eval_interval else None
        self.sampler = PromptSampler(self.dataset, self.algo.prompts_per_step, seed=cfg.run.seed)
        self.environments = Environments.of_job(cfg)
        self.scorer = Scorer(self.algo, job_rewards(self.algo, cfg.environment, model=cfg.model,
                                                    parallel=cfg.parallel, runtime=cfg.runtime),
                             episodic=self.environments is not None, max_new_tokens=cfg.generation.max_new_tokens)
        self.engine: Engine = build_engine(cfg, shape)
        self.reference = None
        self.teacher = None
        if self.algo.teacher is not None:  # on-policy distillation: built once, its weights parked between passes
            from megatron_rl.runtime.teacher import Teacher

            self.teacher = Teacher(self.algo.teacher, engine=self.engine, tokenizer=self.tokenizer)
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        self.warmup_done = 0
        self.advantage = Critic(self) if self.algo.name == "ppo" else GroupAdvantages()
        self.source = Colocated(self) if ctx.placement is None else RolloutWorkers(self, ctx.placement)
        self.loss_fn = make_grpo_loss(self.advantage.policy_loss(
            GRPOLossConfig.from_algorithm(self.algo, max_response_len=cfg.generation.max_new_tokens)))
        self.recompute_old_logprobs = self.source.recomputes_old_logprobs or wants_recomputed_old_logprobs(
            cfg, shape, self.engine)
        self.report_names = REPORTS + (TEACHER_REPORTS if self.teacher is not None else ()) + self.source.report_names
        self.minibatcher = Minibatcher(self.algo, cfg.parallel, engine=self.engine, shape=shape,
                                       pad_id=self.tokenizer.pad_id)
        self.packing = PackingFigures()
        """The last rollout's training tokens against its rows' own."""
        ctx.extra_state = self.extra_state

    # ------------------------------------------------------------------ state
    def extra_state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "generator": self.generator.get_state(),
                WARMUP_DONE: self.warmup_done, **self.advantage.extra_state(), **self.source.extra_state()}

    def resume_or_warm_up(self) -> int:
        start = self.ctx.resume(self.engine)
        extra = self.ctx.resumed_extra
        if extra:  # this run's checkpoint, perhaps one saved inside the warm-up (step 0)
            self.sampler.load_state_dict(extra["sampler"])
            self.generator.set_state(extra["generator"])
            self.warmup_done = extra.get(WARMUP_DONE, self.algo.sft_warmup_steps)
        lora = self.engine.opts.lora is not None  # the reference is the base: taken before the warm-up trains
        if self.algo.kl_coef > 0 and lora:
            self.reference = self.engine.reference_model(self.ctx.ckpt_dir / "reference")
        if self.warmup_done < self.algo.sft_warmup_steps:
            sft_warm_up(self)
        if self.algo.kl_coef > 0 and not lora:  # the weights RL started from, kept with the checkpoints
            self.reference = self.engine.reference_model(self.ctx.ckpt_dir / "reference")
        self.advantage.after_resume(extra)
        self.source.after_resume(start, extra)
        return start

    # ------------------------------------------------------------------ sample
    def generate(self, prompts: list, *, group: Optional[int] = None, seed: Optional[int] = None,
                 record_routes: Optional[bool] = None, stop_requested=None,
                 episodes_of: Optional[tuple[int, int]] = None) -> Rollout:
        """``group`` (default group_size) completions per prompt; each rollout worker (data-parallel x
        context-parallel rank) samples its share, then all see all. ``seed``: default the next draw of the run's
        generation RNG. ``record_routes`` (default algorithm.router_replay): keep the experts each token was
        routed to, for the training forwards to replay. ``stop_requested``: see ``sample_rollout``. ``episodes_of``:
        (step, draw) of a training rollout with environments, whose episode journal it keeps."""
        step_seed = int(torch.randint(0, 2**62, (1,), generator=self.generator)) if seed is None else seed
        step, draw = episodes_of if episodes_of is not None else (None, 0)
        record_routes = self.algo.router_replay if record_routes is None else record_routes
        with self.advantage.generating(), generation_phase(self.engine,
                                                           offload_optimizer=self.cfg.generation.offload_optimizer):
            if self.environments is not None:
                return self.environments.sample(self.engine.chunks, prompts, cfg=self.cfg, shape=self.shape,
                                                tokenizer=self.tokenizer, group=group or self.algo.group_size,
                                                seed=step_seed, seq_multiple=self.engine.sequence_multiple,
                                                record_routes=record_routes, stop_requested=stop_requested,
                                                step=step, draw=draw)
            return sample_rollout(self.engine.chunks, prompts, cfg=self.cfg, shape=self.shape,
                                  tokenizer=self.tokenizer, group=group or self.algo.group_size, seed=step_seed,
                                  record_routes=record_routes,
                                  seq_multiple=self.engine.sequence_multiple, stop_requested=stop_requested)

    def score(self, rollout: Rollout) -> None:
        self.scorer.score(rollout)

    def evaluate(self, step: int) -> dict[str, float]:
        """pass@1 (one sample per held-out prompt, the generation settings) and mean reward, logged with phase
        "eval". Its seeds are its own, so evaluating leaves training's random stream, and metrics, unchanged."""
        with self.ctx.timer() as t_eval:
            rollout = held_out(lambda batch, group, seed: self.generate(batch, group=group, seed=seed,
                                                                        record_routes=False),
                               list(self.eval_prompts), samples=1, batch_prompts=self.algo.rollout_size,
                               seed_of=lambda start: random.Random(f"eval:{self.cfg.run.seed}:{step}:{start}")
                               .getrandbits(62))
        total, rollout.per_fn = self.scorer.totals(rollout)
        rollout.rewards = torch.tensor(total, dtype=torch.float32)
        summary = summarize(rollout, samples=1)
        metrics = {"pass_at_1": summary["pass@1"], "reward_mean": summary["mean_reward"],
                   "prompts": float(summary["n_prompts"]), "time_eval_s": t_eval.seconds}
        self.ctx.logger.log(step, metrics, phase="eval")
        return metrics

    # ------------------------------------------------------------------ train
    def train_on(self, rollout: Rollout, step: int) -> dict[str, float]:
        """algorithm.epochs passes over the rollout, one policy optimizer step per mini-batch of global_batch_size
        completions (and the critic's after it, with PPO). The old policy's log-probs (when recomputed), the
        reference's and the teacher's are taken first, from the weights that sampled the rollout; then the
        advantages."""
        minibatches, self.packing = self.minibatcher(rollout)
        if not minibatches:
            return {"skipped_minibatches": 1.0}
        self.advantage.add_rewards(rollout, minibatches)
        totals: dict[str, list[float]] = {}
        with training_phase(self.engine), self.advantage.training():
            self.old_and_reference_logprobs(minibatches)
            advantage_metrics = self.advantage.advantages(minibatches)  # PPO: values, GAE, whitening
            for epoch in range(1, self.algo.epochs + 1):
                for batches in minibatches:
                    if self.advantage.trains_policy(step):
                        record_policy_step(totals, epoch, self.engine.train_step(
                            batches, self.loss_fn, seq_length=forward_length(batches),
                            report_names=self.report_names, forward_fn=logits_forward), epochs=self.algo.epochs)
                    self.advantage.update(totals, epoch, batches)
        return {**advantage_metrics, **combine_minibatches(totals),
                "train_tokens_per_real_token": self.packing.ratio()}

    def old_and_reference_logprobs(self, minibatches: list[list[RolloutBatch]]) -> None:
        """The old policy's log-probs (when recomputed), the reference's and the teacher's, from the weights that
        sampled the rollout: call before its first optimizer step."""
        for batches in minibatches:
            if self.recompute_old_logprobs:
                store_logprobs(batches, "old_logp",
                               self.engine.policy_logprobs(batches, seq_length=forward_length(batches)))
            if self.reference is not None:
                store_logprobs(batches, "ref_logp", self.engine.reference_logprobs(
                    self.reference, batches, seq_length=forward_length(batches)))
        if self.teacher is not None:
            for batches, values in zip(minibatches, self.teacher.logprobs(minibatches)):
                store_logprobs(batches, "teacher_logp", values)

    # ------------------------------------------------------------------ metrics and end
    def step_metrics(self, batch: SampledBatch, train: dict, t_train: float) -> dict:
        """Reward, accuracy and lengths of every completion drawn; training metrics; times and throughput; the
        optimizer offload's bytes and times over the step's generation phases (its evaluation's included); the
        strategies' own."""
        rollout, t_gen, t_score = batch.drawn, batch.sample_s, batch.score_s
        rewards = rollout.rewards
        lengths = torch.tensor([len(r) for r in rollout.response_ids], dtype=torch.float32)
        correct = correct_answers(rollout)
        gen_tokens = float(lengths.sum())
        train_tokens = gen_tokens + sum(len(p) for p in rollout.prompt_ids)
        metrics = {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "accuracy": float(correct.float().mean()), "response_length": float(lengths.mean()),
            **{f"reward_{name}": float(torch.tensor(v).mean()) for name, v in rollout.per_fn.items()},
            "truncated_fraction": sum(rollout.truncated) / len(rollout.truncated),
            **episode_metrics(rollout.episodes),
            **({"sampling_draws": float(batch.draws), "groups_kept": len(batch.kept.response_ids) / self.algo.group_size}
               if self.algo.drop_zero_signal_groups else {}),
            **train,
            # (token, MoE layer) routes the training forwards replayed, on this rank's pipeline stage
            **({"replayed_routes": float(sum(r.shape[0] * r.shape[1] for r in batch.kept.routes))}
               if batch.kept.routes else {}),
            "generate_tokens_per_s": gen_tokens / max(t_gen, 1e-9),
            "train_tokens_per_s": train_tokens / max(t_train, 1e-9),
            "time_generate_s": t_gen, "time_score_s": t_score, "time_train_s": t_train,
            "step_time_s": t_gen + t_score + t_train,
            **offload_metrics(self.engine, *self.ctx.companions.values()),  # with PPO's critic
            **self.advantage.step_metrics(train),
        }
        return self.source.step_metrics(metrics, batch)

    def finish(self) -> None:
        self.ctx.finish(self.engine)
        if self.cfg.logging.plot and self.ctx.rank == 0:
            from megatron_rl.plotting import plot_run

            self.ctx.say(f"curves: {plot_run(self.cfg.run.dir)}")


def wants_recomputed_old_logprobs(cfg: JobConfig, shape: ModelShape, engine: Engine) -> bool:
    """algorithm.recompute_old_logprobs, with auto resolved: recompute whenever generation's kernels may differ
    from training's (bf16 or fp16 numerics, Transformer Engine layers, MoE routing)."""
    setting = cfg.algorithm.recompute_old_logprobs
    if setting != "auto":
        return bool(setting)
    return engine.opts.dtype != torch.float32 or engine.opts.transformer_engine or shape.is_moe
