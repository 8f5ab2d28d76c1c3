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

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.prompts import PromptSampler, load_eval_prompts, load_prompt_data
from megatron_rl.data.tokenizer import check_fits, load_tokenizer
from megatron_rl.rewards.job import job_rewards
from megatron_rl.rl import (Minibatcher, PolicyRollouts, PolicyUpdate, Scorer, advantage_strategy, evaluate_held_out,
                            rl_step_metrics, sample_source, sft_warm_up, teacher_of, wants_recomputed_old_logprobs)
from megatron_rl.rollout.multi_turn import Environments
from megatron_rl.runtime.distributed import on_rank_zero
from megatron_rl.runtime.phases import offload_metrics
from megatron_rl.trainers.common import WARMUP_DONE, TrainerContext, job_engine

if TYPE_CHECKING:
    from megatron_rl.rl import SampledBatch
    from megatron_rl.rollout.batch import Rollout
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
                evaluate_held_out(run, step)  # pass@1, logged with phase "eval"
            ctx.end_step(run.engine, step, run.step_metrics(batch, train_metrics, t_train.seconds))
        run.finish()


class RLRun:
    """One RL run, assembled from the job's sections: the policy engine and its update, data, rewards, the
    generation RNG, and the run's sample source and advantage strategy (``megatron_rl.rl``)."""

    def __init__(self, cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
        self.cfg, self.shape, self.ctx = cfg, shape, ctx
        self.algo = algo = cfg.algorithm
        self.tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
        check_fits(self.tokenizer, shape)
        self.dataset, self.sft_examples = load_prompt_data(cfg.data, self.tokenizer, seed=cfg.run.seed,
                                                           run_dir=Path(cfg.run.dir), write_once=on_rank_zero)
        self.eval_prompts = (load_eval_prompts(cfg.data, self.tokenizer, seed=cfg.run.seed)
                             if cfg.data.eval_interval else None)
        self.sampler = PromptSampler(self.dataset, algo.prompts_per_step, seed=cfg.run.seed)
        self.chat = ChatFormat.from_config(cfg.data, self.tokenizer)
        self.environments = Environments.of(cfg.environment, run_dir=cfg.run.dir, checkpoint_dir=cfg.checkpoint_dir)
        self.scorer = Scorer(algo, job_rewards(algo, cfg.environment, model=cfg.model, parallel=cfg.parallel,
                                               runtime=cfg.runtime),
                             episodic=self.environments is not None, max_new_tokens=cfg.generation.max_new_tokens)
        self.engine = job_engine(cfg, shape, dims=ctx.dims)
        teacher = teacher_of(algo, engine=self.engine, tokenizer=self.tokenizer)
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        self.warmup_done = 0
        self.advantage = advantage_strategy(self, lambda **kw: job_engine(cfg, shape, dims=ctx.dims, **kw))
        self.source = sample_source(self, ctx.placement)
        self.rollouts = PolicyRollouts(self.engine, cfg.generation, tokenizer=self.tokenizer,
                                       vocab_size=shape.vocab_size, chat=self.chat, environments=self.environments,
                                       parked=self.advantage.generating)
        self.update = PolicyUpdate(
            algo, engine=self.engine, advantage=self.advantage, teacher=teacher,
            minibatcher=Minibatcher(algo, cfg.parallel, engine=self.engine, shape=shape,
                                    pad_id=self.tokenizer.pad_id),
            max_response_len=cfg.generation.max_new_tokens, reports=self.source.report_names,
            recompute_old_logprobs=(self.source.recomputes_old_logprobs
                                    or wants_recomputed_old_logprobs(algo, shape, self.engine)))
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
            self.update.reference = self.engine.reference_model(self.ctx.ckpt_dir / "reference")
        if self.warmup_done < self.algo.sft_warmup_steps:
            sft_warm_up(self)
        if self.algo.kl_coef > 0 and not lora:  # the weights RL started from, kept with the checkpoints
            self.update.reference = self.engine.reference_model(self.ctx.ckpt_dir / "reference")
        self.advantage.after_resume(extra)
        self.source.after_resume(start, extra)
        return start

    # ------------------------------------------------------------------ a step's parts
    def generate(self, prompts: list, *, group: Optional[int] = None, seed: Optional[int] = None,
                 record_routes: Optional[bool] = None, stop_requested=None,
                 episodes_of: Optional[tuple[int, int]] = None) -> Rollout:
        """``PolicyRollouts`` of ``prompts``: ``group`` (default group_size) completions each; ``seed`` (default: the
        next draw of the run's generation RNG); ``record_routes`` (default algorithm.router_replay);
        ``episodes_of``: (step, draw) of a training rollout with environments, whose episode journal it keeps."""
        step_seed = int(torch.randint(0, 2**62, (1,), generator=self.generator)) if seed is None else seed
        step, draw = episodes_of if episodes_of is not None else (None, 0)
        return self.rollouts(prompts, group=group or self.algo.group_size, seed=step_seed,
                             record_routes=self.algo.router_replay if record_routes is None else record_routes,
                             stop_requested=stop_requested, step=step, draw=draw)

    def score(self, rollout: Rollout) -> None:
        self.scorer.score(rollout)

    def train_on(self, rollout: Rollout, step: int) -> dict[str, float]:
        return self.update(rollout, step)

    def step_metrics(self, batch: SampledBatch, train: dict, t_train: float) -> dict:
        """``rl_step_metrics`` (the offload's over the policy and PPO's critic), the strategies' own."""
        metrics = rl_step_metrics(batch, train, t_train, group_size=self.algo.group_size,
                                  dynamic_sampling=self.algo.drop_zero_signal_groups,
                                  offload=offload_metrics(self.engine, *self.ctx.companions.values()))
        return self.source.step_metrics({**metrics, **self.advantage.step_metrics(train)}, batch)

    def finish(self) -> None:
        self.ctx.finish(self.engine)
        if self.cfg.logging.plot and self.ctx.rank == 0:
            from megatron_rl.plotting import plot_run  # matplotlib: only when curves are asked for

            self.ctx.say(f"curves: {plot_run(self.cfg.run.dir)}")
