"""The policy's update on a rollout: the old policy's, the reference's and the teacher's log-probs, the
advantages (the run's strategy), then ``algorithm.epochs`` passes of one clipped-loss optimizer step per
mini-batch (``algorithms.policy_loss`` through ``rl.loss.make_grpo_loss``), each followed by the
strategy's own step (PPO's critic)."""

from __future__ import annotations

import torch

from megatron_rl.algorithms.policy_loss import GRPOLossConfig
from megatron_rl.rl.minibatches import Minibatcher, PackingFigures, combine_minibatches, forward_length, record_policy_step
from megatron_rl.rl.loss import REPORTS, TEACHER_REPORTS, make_grpo_loss
from megatron_rl.rollout.batch import Rollout, RolloutBatch, store_logprobs
from megatron_rl.runtime.phases import training_phase
from megatron_rl.runtime.training import Engine, logits_forward
from megatron_rl.spec.config.schema import AlgorithmConfig
from megatron_rl.spec.model_shape import ModelShape


def teacher_of(algorithm: AlgorithmConfig, *, engine: Engine, tokenizer):
    """On-policy distillation's frozen teacher (algorithm.teacher), at the policy's layout, its weights parked
    between passes; None without one."""
    if algorithm.teacher is None:
        return None
    from megatron_rl.runtime.teacher import Teacher  # a second model: built only when distilling

    return Teacher(algorithm.teacher, engine=engine, tokenizer=tokenizer)


def wants_recomputed_old_logprobs(algorithm: AlgorithmConfig, shape: ModelShape, engine: Engine) -> bool:
    """algorithm.recompute_old_logprobs, with auto resolved: recompute whenever generation's kernels may differ
    from training's (bf16 or fp16 numerics, Transformer Engine layers, MoE routing)."""
    setting = algorithm.recompute_old_logprobs
    if setting != "auto":
        return bool(setting)
    return engine.opts.dtype != torch.float32 or engine.opts.transformer_engine or shape.is_moe


class PolicyUpdate:
    """Trains ``engine`` on rollouts cut by ``minibatcher``, with ``advantage`` (the run's strategy) and the
    ``teacher`` (or None); ``max_response_len`` bounds the loss's length normalisation; ``recompute_old_logprobs``:
    the old policy's log-probs come from the weights the step starts from (else the sampler's); ``reports``: the
    loss reports beyond the policy's own (the sample source's). ``reference`` is the run's reference model (None
    without a KL term), set once it is taken."""

    def __init__(self, algorithm: AlgorithmConfig, *, engine: Engine, minibatcher: Minibatcher, advantage,
                 teacher, max_response_len: int, recompute_old_logprobs: bool, reports: tuple[str, ...]) -> None:
        self.algo, self.engine, self.minibatcher, self.advantage, self.teacher = (algorithm, engine, minibatcher,
                                                                                 advantage, teacher)
        self.loss_fn = make_grpo_loss(advantage.policy_loss(
            GRPOLossConfig.from_algorithm(algorithm, max_response_len=max_response_len)))
        self.recompute_old_logprobs = recompute_old_logprobs
        self.report_names = REPORTS + (TEACHER_REPORTS if teacher is not None else ()) + reports
        self.reference = None
        self.packing = PackingFigures()
        """The last rollout's training tokens against its rows' own."""

    def __call__(self, rollout: Rollout, step: int) -> dict[str, float]:
        """algorithm.epochs passes over the rollout, one policy optimizer step per mini-batch of global_batch_size
        completions (and the strategy's after it). The old policy's log-probs (when recomputed), the reference's
        and the teacher's are taken first, from the weights that sampled the rollout; then the advantages."""
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
