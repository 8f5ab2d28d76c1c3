"""PPO's advantage strategy: a learned critic and GAE (``algorithm.name=ppo``; the loop is ``trainers/rl.py``'s).

    python launch.py --config configs/ppo_tiny.yaml                 # tiny model, synthetic task, 2 CPU processes
    python launch.py --config configs/ppo_tiny.yaml parallel.tp=2

Each step: generate and score (sequence rewards), then the critic's values and the old policy's and
reference's log-probs of every response token, GAE over the response tokens (rewards at the last token, minus a
per-token KL penalty with ``algorithm.kl_in_reward``), advantages whitened over the rollout, then
``algorithm.epochs`` passes of mini-batches that each take one optimizer step of the policy (GRPO's clipped loss,
``make_grpo_loss``, with per-token advantages) and one of the critic (the clipped value loss), then save.

The critic is a ``GPTRewardModel`` (the policy's trunk, a scalar head read at every position: ``value_forward``)
at the policy's layout in the same processes, with its own Adam (``algorithm.critic_lr``). It starts from the
policy after the SFT warm-up (fresh head) or from a reward-model checkpoint (``algorithm.critic_init``). Its
optimizer state and grads are offloaded during generation with the policy's (``generation.offload_optimizer``).
Checkpoints: the critic is a second sharded checkpoint, ``<checkpoint dir>/critic/step_N`` beside the policy's
``step_N`` (``TrainerContext.companions``). It is in our reward-model format, so
``launch.py convert megatron-to-hf --ckpt <checkpoint dir>/critic`` exports it as HF ``*ForTokenClassification``
(num_labels=1, a value at every token; the checkpoint records that it is the critic, ``checkpoint.COMPANION_KEY``).

Values sit at the policy's label positions: the value of position t is V(state before response token t+1), the
position whose logits give that token's log-prob. The value loss is a token mean over the global mini-batch.
With ``parallel.micro_batch_tokens`` the critic's forwards take the policy's packed micro-batches; GAE runs over
the whole rollout, each micro-batch row found by its ``row_ids``.

Test: ``.venv/bin/python -m pytest tests/test_ppo.py -q``
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from megatron_rl.algorithms.gae import clipped_value_loss, explained_variance, gae, token_rewards, whiten
from megatron_rl.algorithms.policy_loss import GRPOLossConfig, kl_penalty
from megatron_rl.models import unwrap
from megatron_rl.models.packed_sequences import as_rows
from megatron_rl.models.reward_model import load_reward_model_weights, value_forward
from megatron_rl.rl.minibatches import forward_length
from megatron_rl.rollout.batch import RolloutBatch, old_logprob_key
from megatron_rl.runtime.distributed import collective_device
from megatron_rl.runtime.phases import generation_phase, training_phase

VALUE_REPORTS = ("value_loss", "value_clip_fraction", "value_pred_mean")
CRITIC_READY = "critic_initialised"
"""Extra-state key: whether the critic has had its starting weights (a checkpoint inside the warm-up has not)."""


class Critic:
    """PPO's value model and GAE, beside the run's policy (``run``: the ``RLRun`` it serves); ``engine``: the
    critic's (``GPTRewardModel`` chunks at the policy's layout, its own optimizer at algorithm.critic_lr)."""

    def __init__(self, run, engine) -> None:
        self.run, self.algo, self.ctx = run, run.algo, run.ctx
        self.value_loss_fn = make_value_loss(clip=self.algo.value_clip, coef=self.algo.value_coef)
        self.engine = engine
        self.ready = False
        self.kl_clamps: dict = {}
        run.ctx.companions["critic"] = self.engine

    def policy_loss(self, config: GRPOLossConfig) -> GRPOLossConfig:
        """The algorithm's, without the KL term with ``algorithm.kl_in_reward`` (the KL is a reward term then; it
        is still reported)."""
        self.kl_clamps = {"clamp": config.kl_clamp, "log_ratio_clamp": config.kl_log_ratio_clamp}
        return dataclasses.replace(config, kl_coef=0.0) if self.algo.kl_in_reward else config

    # ------------------------------------------------------------------ state
    def extra_state(self) -> dict:
        return {CRITIC_READY: self.ready}

    def after_resume(self, extra: dict) -> None:
        """The critic resumes with the policy; a fresh run gives it its starting weights now (after the warm-up)."""
        if not extra.get(CRITIC_READY):
            self.initialise()

    def initialise(self) -> None:
        """algorithm.critic_init: policy (the trunk of the policy as it is now, after the warm-up; a fresh head) or
        rm (a reward-model checkpoint, head included). A fresh optimizer then starts from these weights."""
        if self.algo.critic_init == "rm":
            source = self.algo.critic_init_from or self.algo.reward_model
            head = load_reward_model_weights(source, self.engine.chunks)
            what = f"reward model {source}" + ("" if head else " (trunk only; head fresh)")
        else:
            for critic, policy in zip(self.engine.chunks, self.run.engine.chunks):
                weights = {k: v for k, v in unwrap(policy).state_dict().items() if not k.startswith("output_layer.")}
                missing, unexpected = unwrap(critic).load_state_dict(weights, strict=False)
                bad = [k for k in missing if not k.startswith("rm_head.")] + list(unexpected)
                if bad:
                    raise RuntimeError(f"the critic's trunk does not match the policy's: {bad[:3]}")
            what = "the policy's trunk, fresh value head"
        self.engine.reset_optimizer_schedule()
        self.ready = True
        self.ctx.say(f"critic initialised from {what}")

    # ------------------------------------------------------------------ phases
    def generating(self) -> contextlib.AbstractContextManager:
        """The critic's optimizer state and grads offloaded with the policy's."""
        return generation_phase(self.engine, offload_optimizer=self.run.cfg.generation.offload_optimizer)

    def training(self) -> contextlib.AbstractContextManager:
        return training_phase(self.engine)

    # ------------------------------------------------------------------ advantages
    def add_rewards(self, rollout, minibatches: list[list[RolloutBatch]]) -> None:
        """Each micro-batch also carries its completions' sequence rewards."""
        for index, batch in _rows_of(minibatches, self.algo.global_batch_size):
            batch.sequence_reward = rollout.rewards[index.cpu()].to(batch.tokens.device)

    def advantages(self, minibatches: list[list[RolloutBatch]]) -> dict[str, float]:
        """The critic's values of every micro-batch, then token rewards, GAE and whitening over the whole rollout
        (gathered over the data-parallel ranks, so the whitening is global); each micro-batch gets
        ``advantages`` [mbs, seq], ``returns`` and ``old_values``. Runs where the losses are computed (the last
        pipeline stage); the metrics are shared along the pipeline."""
        from megatron.core import parallel_state as ps

        for batches in minibatches:
            sink: list[torch.Tensor] = []
            self.engine.train(False)
            self.engine.forward_only(batches, value_collector(sink), seq_length=forward_length(batches),
                                     report_names=(), forward_fn=value_forward)
            self.engine.train(True)
            for batch, values in zip(batches, sink):
                batch.old_values = values
        metrics = torch.zeros(len(ROLLOUT_METRICS), dtype=torch.float64)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            metrics = self._gae_over_rollout(minibatches)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            metrics = metrics.to(collective_device(ps.get_pipeline_model_parallel_group()))
            torch.distributed.broadcast(metrics, src=ps.get_pipeline_model_parallel_last_rank(),
                                        group=ps.get_pipeline_model_parallel_group())
        return dict(zip(ROLLOUT_METRICS, metrics.tolist()))

    def _gae_over_rollout(self, minibatches: list[list[RolloutBatch]]) -> torch.Tensor:
        algo = self.algo
        policy = old_logprob_key(minibatches[0][0])
        keys = ["loss_mask", "old_values", policy] + (["ref_logp"] if algo.kl_in_reward and algo.kl_coef else [])
        whole = _whole_rollout(minibatches, keys + ["sequence_reward"], minibatch_rows=algo.global_batch_size)
        rows = whole["sequence_reward"]
        mask, values = whole["loss_mask"], whole["old_values"]
        kl = None
        if "ref_logp" in whole:
            kl = kl_penalty(whole[policy], whole["ref_logp"], algo.kl_estimator, self.kl_clamps["clamp"],
                            log_ratio_clamp=self.kl_clamps["log_ratio_clamp"]) * mask
        rewards = token_rewards(rows, mask, kl=kl, kl_coef=algo.kl_coef if kl is not None else 0.0)
        advantages, returns = gae(rewards, values, mask, gamma=algo.gamma, lam=algo.gae_lambda)
        raw_mean = float((advantages * mask).sum() / mask.sum().clamp(min=1))
        if algo.whiten_advantages:
            advantages = whiten(advantages, mask, shift_mean=algo.whiten_shift_mean)
        for index, batch in _rows_of(minibatches, self.algo.global_batch_size):  # back to the micro-batches
            width = batch.loss_mask.shape[1]
            batch.advantages = advantages[index, :width].to(batch.loss_mask.device)
            batch.returns = returns[index, :width].to(batch.loss_mask.device)
        tokens = mask.sum().clamp(min=1)
        return torch.tensor([explained_variance(values, returns, mask), float((values * mask).sum() / tokens),
                             float((returns * mask).sum() / tokens), raw_mean,
                             float((kl * mask).sum() / tokens) if kl is not None else 0.0], dtype=torch.float64)

    # ------------------------------------------------------------------ train
    def trains_policy(self, step: int) -> bool:
        """Not while the critic warms up (algorithm.critic_warmup_steps)."""
        return step > self.algo.critic_warmup_steps

    def update(self, totals: dict[str, list[float]], epoch: int, batches: list[RolloutBatch]) -> None:
        """One critic optimizer step on a mini-batch, its metrics added to ``totals``."""
        critic = self.engine.train_step(batches, self.value_loss_fn, seq_length=forward_length(batches),
                                        report_names=VALUE_REPORTS, forward_fn=value_forward)
        for key, value in critic.items():
            totals.setdefault(key if key in VALUE_REPORTS else f"critic_{key}", []).append(value)
        if self.algo.epochs > 1:
            totals.setdefault(f"value_clip_fraction_epoch{epoch}", []).append(critic["value_clip_fraction"])

    def step_metrics(self, train: dict) -> dict:
        return {"critic_warmup": float(not train.get("minibatches"))}


ROLLOUT_METRICS = ("explained_variance", "value_mean", "returns_mean", "advantage_mean", "kl_reward")
"""Per rollout, before any update: explained variance of the returns by the critic's values, mean value and
return per response token, the mean GAE advantage before whitening, and the mean per-token KL penalised in the
reward (0 without kl_in_reward)."""


def _rows_of(minibatches: list[list[RolloutBatch]], minibatch_rows: int):
    """(each row's index in the rollout ``[rows]``, its micro-batch) for every micro-batch of this rank: a copy kept
    out of the loss (a negative ``row_ids`` entry) names the row it copies."""
    for m, batches in enumerate(minibatches):
        for batch in batches:
            ids = batch.row_ids
            yield m * minibatch_rows + torch.where(ids >= 0, ids, -1 - ids), batch


def _whole_rollout(minibatches: list[list[RolloutBatch]], keys: list[str], *, minibatch_rows: int) -> dict[str, torch.Tensor]:
    """``keys`` of every rank's micro-batches as rollout-wide tensors, the rollout's row i at row i: ``[rows]`` for
    per-row values, ``[rows, L]`` for per-token ones (L the widest micro-batch of any rank; zeros past a row's own
    width). Gathered over the data-parallel ranks, whose row counts may differ (packing shares rows by tokens);
    copies kept out of the loss are left out."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    device = minibatches[0][0].loss_mask.device
    width = max(b.loss_mask.shape[1] for batches in minibatches for b in batches)
    if torch.distributed.get_world_size(group) > 1:
        widest = torch.full((1,), width, device=collective_device(group))
        torch.distributed.all_reduce(widest, op=torch.distributed.ReduceOp.MAX, group=group)
        width = int(widest)
    index, values = [], {key: [] for key in keys}
    for rows, batch in _rows_of(minibatches, minibatch_rows):
        own = (batch.row_ids >= 0).to(device)
        index.append(rows.to(device)[own])
        for key in keys:
            value = batch[key].to(device)[own]
            values[key].append(value if value.dim() == 1 else
                               torch.nn.functional.pad(value, (0, width - value.shape[1])))
    index = _all_gather_rows(torch.cat(index), group)
    whole = {}
    for key in keys:
        gathered = _all_gather_rows(torch.cat(values[key]), group)
        whole[key] = gathered.new_zeros(len(minibatches) * minibatch_rows, *gathered.shape[1:])
        whole[key][index] = gathered
    return whole


def _all_gather_rows(rows: torch.Tensor, group) -> torch.Tensor:
    """``[n, ...]`` rows of every rank of ``group``, in rank order; ``n`` may differ between ranks."""
    world = torch.distributed.get_world_size(group)
    if world == 1:
        return rows
    count = torch.full((1,), rows.shape[0], device=collective_device(group))
    counts = [torch.empty_like(count) for _ in range(world)]
    torch.distributed.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    padded = rows.new_zeros(max(counts), *rows.shape[1:])
    padded[:rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def value_collector(sink: list):
    """A forward-only 'loss' that appends each micro-batch's values ``[rows, L]`` to ``sink`` (last stage only)."""

    def loss_fn(values: torch.Tensor, batch: dict):
        sink.append(as_rows(values.detach().float(), batch))
        zero = torch.zeros((), dtype=torch.float32, device=values.device)
        return zero, torch.ones((), dtype=torch.int, device=values.device), {}

    return loss_fn


def make_value_loss(*, clip: float | None, coef: float):
    """The critic's loss for ``Engine.train_step``: ``coef`` x the clipped value loss summed over the response
    tokens, with the token count as denominator (a token mean over the global mini-batch)."""

    def loss_fn(values: torch.Tensor, batch: RolloutBatch):
        values = as_rows(values, batch)
        mask = batch.loss_mask
        per_token, clipped = clipped_value_loss(values, batch.old_values, batch.returns, mask, clip=clip)
        tokens = mask.sum().to(torch.int)
        total = per_token.sum()
        reports = {"value_loss": (total.detach(), tokens), "value_clip_fraction": (clipped.sum(), tokens),
                   "value_pred_mean": ((values.detach() * mask).sum(), tokens)}
        return coef * total, tokens, reports

    return loss_fn
