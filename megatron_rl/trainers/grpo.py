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
and MoE models at ep > 1 decode in lockstep over the workers that share experts. With algorithm.router_replay an
MoE rollout carries the experts generation chose, and its training forwards use them
(megatron_rl/models/router_replay.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.algorithms.advantages import group_advantages, groups_with_signal
from megatron_rl.algorithms.policy_loss import GRPOLossConfig
from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.prompts import load_eval_prompts
from megatron_rl.generation import GenerationStopped
from megatron_rl.rewards import overlong_penalty
from megatron_rl.rollout.batch import (REPORTS, TEACHER_REPORTS, Rollout, RolloutBatch, RolloutRow,
                                       collate_rollout, make_grpo_loss, rollout_rows, store_logprobs)
from megatron_rl.rollout.multi_turn import Environments, episode_metrics
from megatron_rl.rollout.packing import pack_minibatch
from megatron_rl.rollout.sampling import correct_answers, held_out, sample_rollout, summarize
from megatron_rl.runtime.distributed import on_rank_zero
from megatron_rl.runtime.phases import generation_phase, offload_metrics, training_phase
from megatron_rl.runtime.training import Engine, build_engine, data_parallel_slice, logits_forward
from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.trainers.common import WARMUP_DONE, TrainerContext


# ----------------------------------------------------------------------------------------------- the loop
def train(cfg: JobConfig, shape: ModelShape, ctx: TrainerContext) -> None:
    """Colocated GRPO. With rollout workers (cluster.rollout_tasks > 0) megatron_rl/trainers/grpo_async.py runs
    this loop with its split-placement run."""
    run_loop(GrpoRun(cfg, shape, ctx), cfg, ctx)


def run_loop(run: "GrpoRun", cfg: JobConfig, ctx: TrainerContext) -> None:
    with run.serving():  # split placement: the rollout workers generate until the loop ends
        start = run.resume_or_warm_up()
        for step in range(start + 1, cfg.run.steps + 1):
            batch = run.sample(step)  # generate and score; DAPO dynamic sampling draws until the batch has signal
            ctx.log_samples(step, batch.drawn)
            with ctx.timer() as t_train:
                train_metrics = run.train_on(batch.kept)
            run.sync_weights(step)  # split placement: the new weights reach the rollout workers
            if run.eval_prompts is not None and step % cfg.data.eval_interval == 0:
                run.evaluate(step)  # held-out pass@1, logged with phase "eval"
            ctx.end_step(run.engine, step, run.step_metrics(batch, train_metrics, t_train.seconds))
        run.finish()


@dataclasses.dataclass
class SampledBatch:
    """What one step sampled: every completion drawn (the reward metrics are theirs) and those trained on."""

    drawn: Rollout
    """Every completion generated this step, scored."""
    kept: Rollout
    """The completions trained on (with dynamic sampling, the groups with signal)."""
    draws: int
    """Rollout rounds it took."""
    sample_s: float
    """Seconds the trainers spent getting the completions: generating them (colocated), or waiting for the rollout
    workers' (split placement, whose own generation time comes with their samples)."""
    score_s: float
    """Seconds spent scoring them."""


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
        self.dataset, self.sft_examples = load_prompt_data(cfg, Path(cfg.run.dir), self.tokenizer)
        self.eval_prompts = load_eval_prompts(cfg, self.tokenizer) if cfg.data.eval_interval else None
        from megatron_rl.data.prompts import PromptSampler

        self.sampler = PromptSampler(self.dataset, self.algo.prompts_per_step, seed=cfg.run.seed)
        self.environments = Environments.of_job(cfg)
        self.rewards = job_rewards(cfg, shape)
        self.loss_fn = make_grpo_loss(GRPOLossConfig.from_algorithm(self.algo,
                                                                    max_response_len=cfg.generation.max_new_tokens))
        self.engine: Engine = build_engine(cfg, shape)
        self.reference = None
        self.teacher = None
        if self.algo.teacher is not None:  # on-policy distillation: built once, its weights parked between passes
            from megatron_rl.runtime.teacher import Teacher

            self.teacher = Teacher(self.algo.teacher, engine=self.engine, tokenizer=self.tokenizer)
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        self.warmup_done = 0
        self.recompute_old_logprobs = wants_recomputed_old_logprobs(cfg, shape, self.engine)
        self.report_names = REPORTS + (TEACHER_REPORTS if self.teacher is not None else ())
        self.packing = PackingFigures()
        """The last rollout's training tokens against its rows' own (``minibatches``)."""
        ctx.extra_state = self.extra_state

    # ------------------------------------------------------------------ state
    def extra_state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "generator": self.generator.get_state(),
                WARMUP_DONE: self.warmup_done}

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
            self.warm_up()
        if self.algo.kl_coef > 0 and not lora:  # the weights GRPO started from, kept with the checkpoints
            self.reference = self.engine.reference_model(self.ctx.ckpt_dir / "reference")
        return start

    def warm_up(self) -> None:
        """A short SFT stage (the project's SFT trainer step) before GRPO; logged with phase "sft". A stop request
        is taken after each step: the checkpoint (step 0) records how far the warm-up got, and the requeued run
        goes on from there."""
        from megatron_rl.trainers.sft import batch_for_step, encode_examples, sft_seq_length, sft_step

        examples = encode_examples(self.tokenizer, self.sft_examples, self.cfg.model.seq_length or self.shape.seq_length,
                                   ChatFormat.from_config(self.cfg.data, self.tokenizer))
        seq_length = sft_seq_length(examples, multiple=self.engine.sequence_multiple)
        total = self.algo.sft_warmup_steps
        for step in range(self.warmup_done + 1, total + 1):
            batch = batch_for_step(examples, step=step, batch_size=self.algo.global_batch_size, seed=self.cfg.run.seed)
            with training_phase(self.engine):
                metrics = sft_step(self.engine, batch, global_batch_size=self.algo.global_batch_size,
                                   micro_batch_size=self.cfg.parallel.micro_batch_size, seq_length=seq_length,
                                   pad_id=self.tokenizer.pad_id)
            self.ctx.logger.log(step, metrics, phase="sft", total=total)
            self.warmup_done = step
            if step < total and self.ctx.stop_in_phase("sft", step):
                self.ctx.preempt(self.engine, 0, what=f"SFT warm-up step {step} of {total}")
        self.engine.reset_optimizer_schedule()
        self.ctx.say(f"SFT warm-up: {self.algo.sft_warmup_steps} steps, final loss {metrics['loss']:.4f}")

    def serving(self):
        """Colocated: generation is a phase of these processes, so there are no rollout workers to serve."""
        return contextlib.nullcontext()

    def sync_weights(self, step: int) -> None:
        """Colocated: generation samples from the training weights themselves; nothing to send."""

    # ------------------------------------------------------------------ sample
    def sample(self, step: int) -> SampledBatch:
        """prompts_per_step prompts x group_size completions, generated and scored. With drop_zero_signal_groups
        (DAPO dynamic sampling) groups whose rewards are all equal are dropped and more prompts are drawn until
        prompts_per_step groups have signal, at most max_sampling_draws rounds. A stop request that arrives while
        step ``step`` generates is taken within STOP_POLL_STEPS engine steps: the step is abandoned, the
        prompt sampler and the generation RNG go back to where the step began, and the run saves the state
        before it (step - 1) and exits for requeue, so a long rollout does not outlast Slurm's warning window."""
        group, wanted = self.algo.group_size, self.algo.prompts_per_step
        drawn, kept, sample_s, score_s = [], [], 0.0, 0.0
        at_start = self.extra_state()
        if self.environments is not None:
            self.environments.forget_through(self.ctx.last_saved_step)
        while True:
            with self.ctx.timer() as t_generate:
                try:
                    rollout = self.generate(self.sampler.next_batch(),
                                            stop_requested=lambda generating: self.ctx.stop_while_generating(
                                                "generate", step, generating), episodes_of=(step, len(drawn)))
                except GenerationStopped:
                    self.sampler.load_state_dict(at_start["sampler"])
                    self.generator.set_state(at_start["generator"])
                    self.ctx.preempt_before(self.engine, step, what="its generation")
            with self.ctx.timer() as t_score:
                self.score(rollout)
            sample_s, score_s = sample_s + t_generate.seconds, score_s + t_score.seconds
            drawn.append(rollout)
            if not self.algo.drop_zero_signal_groups:
                kept.append(rollout)
                break
            signal = groups_with_signal(rollout.rewards, group).tolist()
            kept.append(rollout.select([g * group + i for g, ok in enumerate(signal) if ok for i in range(group)]))
            if sum(len(k.response_ids) for k in kept) >= wanted * group or len(drawn) >= self.algo.max_sampling_draws:
                break
        batch = Rollout.concat(kept)
        return SampledBatch(drawn=Rollout.concat(drawn), kept=batch.select(list(range(min(len(batch.response_ids),
                                                                                          wanted * group)))),
                            draws=len(drawn), sample_s=sample_s, score_s=score_s)

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
        with generation_phase(self.engine, offload_optimizer=self.cfg.generation.offload_optimizer):
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

    def evaluate(self, step: int) -> dict[str, float]:
        """pass@1 (one sample per held-out prompt, the generation settings) and mean reward, logged with phase
        "eval". Its seeds are its own, so evaluating leaves training's random stream, and metrics, unchanged."""
        with self.ctx.timer() as t_eval:
            rollout = held_out(lambda batch, group, seed: self.generate(batch, group=group, seed=seed,
                                                                        record_routes=False),
                               list(self.eval_prompts), samples=1, batch_prompts=self.algo.rollout_size,
                               seed_of=lambda start: random.Random(f"eval:{self.cfg.run.seed}:{step}:{start}")
                               .getrandbits(62))
        total, rollout.per_fn = self.reward_totals(rollout)
        rollout.rewards = torch.tensor(total, dtype=torch.float32)
        summary = summarize(rollout, samples=1)
        metrics = {"pass_at_1": summary["pass@1"], "reward_mean": summary["mean_reward"],
                   "prompts": float(summary["n_prompts"]), "time_eval_s": t_eval.seconds}
        self.ctx.logger.log(step, metrics, phase="eval")
        return metrics

    # ------------------------------------------------------------------ score
    def reward_totals(self, rollout: Rollout) -> tuple[list[float], dict[str, list[float]]]:
        """``reward_totals`` of the run's rewards and environments."""
        return reward_totals(rollout, rewards=self.rewards, episodic=self.environments is not None)

    def score(self, rollout: Rollout) -> None:
        """Rewards (plus DAPO's overlong penalty when algorithm.overlong is set) and group advantages."""
        total, per_fn = self.reward_totals(rollout)
        overlong = self.algo.overlong
        if overlong is not None:
            per_fn["overlong"] = overlong_penalty([len(r) for r in rollout.response_ids],
                                                  max_len=self.cfg.generation.max_new_tokens,
                                                  buffer_len=overlong.buffer, penalty_factor=overlong.penalty)
            total = [t + p for t, p in zip(total, per_fn["overlong"])]
        rollout.rewards = torch.tensor(total, dtype=torch.float32)
        rollout.per_fn = per_fn
        rollout.advantages = group_advantages(rollout.rewards, self.algo.group_size,
                                              normalize_std=self.algo.advantage == "std")

    # ------------------------------------------------------------------ train
    def train_on(self, rollout: Rollout) -> dict[str, float]:
        """algorithm.epochs passes over the rollout, one optimizer step per mini-batch of global_batch_size
        completions. The old policy's log-probs (when recomputed) and the reference's are taken first, from the
        weights that sampled the rollout."""
        minibatches = self.minibatches(rollout)
        if not minibatches:
            return {"skipped_minibatches": 1.0}
        totals: dict[str, list[float]] = {}
        with training_phase(self.engine):
            self.old_and_reference_logprobs(minibatches)
            for epoch in range(1, self.algo.epochs + 1):
                for batches in minibatches:
                    self.record_policy_step(totals, epoch, self.engine.train_step(
                        batches, self.loss_fn, seq_length=forward_length(batches), report_names=self.report_names,
                        forward_fn=logits_forward))
        return {**combine_minibatches(totals), "train_tokens_per_real_token": self.packing.ratio()}

    def minibatches(self, rollout: Rollout) -> list[list[RolloutBatch]]:
        """This DP rank's micro-batches of each mini-batch of global_batch_size completions (a rollout's remainder
        short of a whole mini-batch is left out): micro_batch_size rows padded to the rollout's longest, or with
        parallel.micro_batch_tokens rows packed by tokens (megatron_rl/rollout/packing.py). Each micro-batch's
        ``row_ids`` name its rows' places in their mini-batch (``RolloutBatch.row_ids``). ``self.packing`` counts the
        tokens they compute against the rows' own."""
        rows = rollout_rows(rollout, mask_truncated=self.algo.mask_truncated)
        gbs = self.algo.global_batch_size
        usable = len(rows) - len(rows) % gbs
        self.packing = PackingFigures()
        minibatches = []
        for start in range(0, usable, gbs):
            share = rows[start:start + gbs]
            if self.cfg.parallel.micro_batch_tokens is None:
                batches = []
                for ids in data_parallel_slice(list(range(len(share))),
                                               micro_batch_size=self.cfg.parallel.micro_batch_size):
                    batches.append(collate_rollout([share[i] for i in ids], seq_length=rollout.seq_length,
                                                   pad_id=self.tokenizer.pad_id, row_ids=ids))
                self.packing.add(train_tokens=len(share) * rollout.seq_length,
                                 real_tokens=sum(row.forward_tokens for row in share))
            else:
                batches, figures = self.pack(share)
                self.packing.add(**figures)
            minibatches.append(batches)
        return minibatches

    def pack(self, rows: list[RolloutRow]) -> tuple[list[RolloutBatch], dict]:
        """This DP rank's packed micro-batches of one mini-batch (parallel.micro_batch_tokens)."""
        from megatron.core import parallel_state as ps

        dims = self.engine.opts.dims
        return pack_minibatch(rows, dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                              token_budget=self.cfg.parallel.micro_batch_tokens, multiple=self.engine.sequence_multiple,
                              count_multiple=dims.pp if dims.vpp > 1 else 1, pad_id=self.tokenizer.pad_id,
                              thd=self.engine.opts.takes_packed_sequences(self.shape))

    def old_and_reference_logprobs(self, minibatches: list[list[RolloutBatch]]) -> None:
        """The old policy's log-probs (when recomputed), the reference's and the teacher's, from the weights that
        sampled the rollout: call before its first optimizer step."""
        for batches in minibatches:
            if self.recompute_old_logprobs:
                store_logprobs(batches, "old_logp", self.engine.policy_logprobs(batches, seq_length=forward_length(batches)))
            if self.reference is not None:
                store_logprobs(batches, "ref_logp", self.engine.reference_logprobs(self.reference, batches,
                                                                          seq_length=forward_length(batches)))
        if self.teacher is not None:
            for batches, values in zip(minibatches, self.teacher.logprobs(minibatches)):
                store_logprobs(batches, "teacher_logp", values)

    def record_policy_step(self, totals: dict[str, list[float]], epoch: int, metrics: dict[str, float]) -> None:
        """Add one policy optimizer step's metrics to ``totals``: the first step's ratio range, and per-epoch
        clip fraction and KL when there are several epochs."""
        if "first_ratio_min" not in totals:
            totals["first_ratio_min"] = [metrics["ratio_min"]]
            totals["first_ratio_max"] = [metrics["ratio_max"]]
        for key, value in metrics.items():
            totals.setdefault(key, []).append(value)
        if self.algo.epochs > 1:
            for key in ("clip_fraction", "kl"):
                totals.setdefault(f"{key}_epoch{epoch}", []).append(metrics[key])

    # ------------------------------------------------------------------ metrics and end
    def step_metrics(self, batch: SampledBatch, train: dict, t_train: float) -> dict:
        """Reward, accuracy and lengths of every completion drawn; training metrics; times and throughput; the
        optimizer offload's bytes and times over the step's generation phases (its evaluation's included)."""
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
        }
        return metrics

    def finish(self) -> None:
        self.ctx.finish(self.engine)
        if self.cfg.logging.plot and self.ctx.rank == 0:
            from megatron_rl.plotting import plot_run

            self.ctx.say(f"curves: {plot_run(self.cfg.run.dir)}")


# ------------------------------------------------------------------------------------------------ helpers
@dataclasses.dataclass
class PackingFigures:
    """Tokens the training forwards compute (padding included) and tokens of the rows, over a step's mini-batches."""

    train_tokens: float = 0.0
    real_tokens: float = 0.0

    def add(self, *, train_tokens: float, real_tokens: float) -> None:
        self.train_tokens += train_tokens
        self.real_tokens += real_tokens

    def ratio(self) -> float:
        """train_tokens_per_real_token: 1.0 is no padding at all."""
        return self.train_tokens / max(self.real_tokens, 1.0)


def forward_length(batches: list[RolloutBatch]) -> int:
    """The sequence length Megatron's schedule runs a mini-batch's micro-batches at (padded or packed: all alike)."""
    return batches[0].tokens.shape[1]


def wants_recomputed_old_logprobs(cfg: JobConfig, shape: ModelShape, engine: Engine) -> bool:
    """algorithm.recompute_old_logprobs, with auto resolved: recompute whenever generation's kernels may differ
    from training's (bf16 or fp16 numerics, Transformer Engine layers, MoE routing)."""
    setting = cfg.algorithm.recompute_old_logprobs
    if setting != "auto":
        return bool(setting)
    return engine.opts.dtype != torch.float32 or engine.opts.transformer_engine or shape.is_moe


def combine_minibatches(totals: dict[str, list[float]]) -> dict[str, float]:
    """One figure per metric over a step's mini-batches: the mean, or the min/max of *_min/*_max keys; plus the
    number of optimizer steps taken (``minibatches``)."""
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


def load_prompt_data(cfg: JobConfig, run_dir: Path, tokenizer):
    """(PromptDataset, SFT warm-up examples) from data.train_path (any format of megatron_rl.data.records, with
    the field mapping and chat format of cfg.data), or the synthetic data.task written under run.dir/data."""
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.data.sft import read_sft_records
    from megatron_rl.data.synthetic import TASKS, write_synthetic_dataset

    if cfg.data.warmup_task is not None and cfg.data.warmup_task not in TASKS:
        raise ConfigError(f"data.warmup_task={cfg.data.warmup_task!r} is not a synthetic task ({', '.join(TASKS)}); "
                          "or set it to null")
    if cfg.data.train_path:
        dataset = load_prompts(cfg.data, cfg.data.train_path, tokenizer)
        sft = [{"prompt": r.given, "completion": str(r.answer)} for r in dataset]
        return dataset, _warmup_records(cfg) or sft
    if cfg.data.task not in TASKS:
        raise ConfigError(f"data.task={cfg.data.task!r} is not a synthetic task ({', '.join(TASKS)}); "
                          "or set data.train_path to a data file")
    data_dir = run_dir / "data"
    on_rank_zero(lambda: write_synthetic_dataset(data_dir, task=cfg.data.task, seed=cfg.run.seed,
                                                 sft_answers="random"))
    dataset = load_prompts(cfg.data, data_dir / "train.jsonl", tokenizer)
    return dataset, _warmup_records(cfg) or read_sft_records(data_dir / "sft.jsonl")


def _warmup_records(cfg: JobConfig) -> list[dict]:
    """Correct prompt/completion pairs of data.warmup_task (a related task), or [] when it is null."""
    from megatron_rl.data.synthetic import sft_records, split_problems

    if cfg.data.warmup_task is None:
        return []
    problems, _ = split_problems(cfg.data.warmup_task, seed=cfg.run.seed)
    return sft_records(problems, task=cfg.data.warmup_task, answers="correct")


def reward_totals(rollout: Rollout, *, rewards, episodic: bool) -> tuple[list[float], dict[str, list[float]]]:
    """Each completion's reward and each function's share: ``rewards`` (algorithm.rewards, of an episode's last
    turn; None: none), plus, for ``episodic`` rollouts, each episode's reward from its environment."""
    total, per_fn = [0.0] * len(rollout.completions), {}
    if rewards is not None:
        total, per_fn = rewards.score(rollout.prompts, rollout.completions, rollout.answers)
    if episodic:
        per_fn["environment"] = list(rollout.env_rewards)
        total = [t + e for t, e in zip(total, rollout.env_rewards)]
    return total, per_fn


def job_rewards(cfg: JobConfig, shape: ModelShape):
    """The job's reward functions: ``build_rewards``, or None for an environment's job without algorithm.rewards
    (its episodes' rewards are the environment's)."""
    return None if cfg.environment.name is not None and not cfg.algorithm.rewards else build_rewards(cfg, shape)


def build_rewards(cfg: JobConfig, shape: ModelShape):
    """WeightedRewards from algorithm.rewards ({name or dotted path: weight or {weight, options}}); `rm` is the
    trained reward model."""
    from megatron_rl.rewards import WeightedRewards, build_reward_fn

    fns, weights = {}, {}
    for name, weight in cfg.algorithm.reward_weights.items():
        if name == "rm":
            if not cfg.algorithm.reward_model:
                raise ConfigError("algorithm.rewards has `rm` but algorithm.reward_model is not set; give the RM "
                                  "checkpoint folder")
            from megatron_rl.models.builder import resolve_transformer_engine
            from megatron_rl.rewards.reward_model_scorer import RewardModelScorer

            fns[name] = RewardModelScorer(cfg.algorithm.reward_model, dtype=cfg.model.dtype,
                                          micro_batch_size=cfg.parallel.micro_batch_size,
                                          micro_batch_tokens=cfg.parallel.micro_batch_tokens,
                                          sequence_parallel=cfg.parallel.sequence_parallel,
                                          transformer_engine=resolve_transformer_engine(
                                              cfg.runtime.transformer_engine),
                                          attention=cfg.runtime.attention)
        else:
            fns[name] = build_reward_fn(name, cfg.algorithm.reward_options[name])
        weights[name] = float(weight)
    return WeightedRewards(fns=fns, weights=weights)
