"""Where a step's completions come from: colocated, the training processes generate them between optimizer steps
(the default); with rollout workers (``cluster.rollout_tasks > 0``) ``rollout_workers.RolloutWorkers`` answers the
same calls."""

from __future__ import annotations

import contextlib

from megatron_rl.algorithms.advantages import groups_with_signal
from megatron_rl.generation import GenerationStopped
from megatron_rl.rl.rollout_workers import RolloutWorkers
from megatron_rl.rl.sampled import SampledBatch
from megatron_rl.rollout.batch import Rollout


class Colocated:
    """Generation is a phase of the training processes (``run``: the ``RLRun`` it serves)."""

    recomputes_old_logprobs = False
    """The sampling weights are the training weights: the old log-probs are the sampler's unless
    ``algorithm.recompute_old_logprobs`` says otherwise."""
    report_names: tuple[str, ...] = ()
    """Loss reports of its own: none."""

    def __init__(self, run) -> None:
        self.run = run

    def serving(self) -> contextlib.AbstractContextManager:
        """No rollout workers to serve."""
        return contextlib.nullcontext()

    def extra_state(self) -> dict:
        return {}

    def after_resume(self, start: int, extra: dict) -> None:
        """Nothing to start."""

    def sample(self, step: int) -> SampledBatch:
        """prompts_per_step prompts x group_size completions, generated and scored. With drop_zero_signal_groups
        (DAPO dynamic sampling) groups whose rewards are all equal are dropped and more prompts are drawn until
        prompts_per_step groups have signal, at most max_sampling_draws rounds. A stop request that arrives while
        step ``step`` generates is taken within STOP_POLL_STEPS engine steps: the step is abandoned, the
        prompt sampler and the generation RNG go back to where the step began, and the run saves the state
        before it (step - 1) and exits for requeue, so a long rollout does not outlast Slurm's warning window."""
        run = self.run
        ctx, algo = run.ctx, run.algo
        group, wanted = algo.group_size, algo.prompts_per_step
        drawn, kept, sample_s, score_s = [], [], 0.0, 0.0
        at_start = run.extra_state()
        if run.environments is not None:
            run.environments.forget_through(ctx.last_saved_step)
        while True:
            with ctx.timer() as t_generate:
                try:
                    rollout = run.generate(run.sampler.next_batch(),
                                           stop_requested=lambda generating: ctx.stop_while_generating(
                                               "generate", step, generating), episodes_of=(step, len(drawn)))
                except GenerationStopped:
                    run.sampler.load_state_dict(at_start["sampler"])
                    run.generator.set_state(at_start["generator"])
                    ctx.preempt_before(run.engine, step, what="its generation")
            with ctx.timer() as t_score:
                run.score(rollout)
            sample_s, score_s = sample_s + t_generate.seconds, score_s + t_score.seconds
            drawn.append(rollout)
            if not algo.drop_zero_signal_groups:
                kept.append(rollout)
                break
            signal = groups_with_signal(rollout.rewards, group).tolist()
            kept.append(rollout.select([g * group + i for g, ok in enumerate(signal) if ok for i in range(group)]))
            if sum(len(k.response_ids) for k in kept) >= wanted * group or len(drawn) >= algo.max_sampling_draws:
                break
        batch = Rollout.concat(kept)
        return SampledBatch(drawn=Rollout.concat(drawn), kept=batch.select(list(range(min(len(batch.response_ids),
                                                                                          wanted * group)))),
                            draws=len(drawn), sample_s=sample_s, score_s=score_s)

    def sync_weights(self, step: int) -> None:
        """Generation samples from the training weights themselves: nothing to send."""

    def step_metrics(self, metrics: dict, batch: SampledBatch) -> dict:
        return metrics


def sample_source(run, placement=None):
    """``run``'s source (``run``: an ``RLRun``): its rollout workers (``placement``, split placement), or
    ``Colocated``."""
    return Colocated(run) if placement is None else RolloutWorkers(run, placement)
