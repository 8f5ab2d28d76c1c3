"""Rollouts as training data: prompt + response rows, aligned log-probs and advantages, collated into
micro-batches (``RolloutBatch``) for the policy loss (``megatron_rl.rl.loss``).

Context parallelism: rows are collated whole, padded to a multiple of 2*cp (``Rollout.seq_multiple``); the
training forward step gives each CP rank its two chunks of every per-token entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass(frozen=True, kw_only=True)
class RolloutRow:
    """One completion as training data (``rollout_rows``), what ``collate_rollout`` and
    ``megatron_rl.rollout.packing.collate_packed`` turn into micro-batches."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    """Per response token, under the policy that sampled it (the micro-batch's ``behav_logp``)."""
    advantage: float
    in_loss: bool = True
    """False: in the micro-batch with loss weight 0 (DAPO's overlong filtering; packing's copies of a row)."""
    response_mask: Optional[list[int]] = None
    """Multi-turn: per response token, 1 when the policy sampled it, 0 for an environment's reply (context)."""
    routes: Optional[torch.Tensor] = None
    """Router replay: the experts generation routed each fed position to (``Rollout.routes``)."""

    @property
    def forward_tokens(self) -> int:
        """Positions it takes in a training forward: its tokens but the last (inputs are shifted)."""
        return len(self.prompt_ids) + len(self.response_ids) - 1

    def loss_mask(self) -> torch.Tensor:
        """Each response token's loss weight: 1, or 0 for a row kept out of the loss (``in_loss``) and for a
        multi-turn reply's tokens (``response_mask`` 0: context the policy did not sample)."""
        mask = torch.full((len(self.response_ids),), 1.0 if self.in_loss else 0.0)
        if self.response_mask:
            mask = mask * torch.tensor(self.response_mask, dtype=torch.float32)
        return mask


@dataclass(kw_only=True, slots=True, eq=False)
class RolloutBatch(Mapping):
    """One training micro-batch of rollout rows, padded (``collate_rollout``: ``[rows, S]``) or packed
    (``megatron_rl.rollout.packing.collate_packed``: the model's entries ``[1, T]``, the losses' ``[rows, L]``).

    Its log-probs are named by the policy that gave them, and none changes meaning: ``behav_logp`` comes with the
    rollout, the trainer sets ``old_logp``, ``ref_logp`` and ``teacher_logp`` from the forwards that compute them
    (the engine returns them). The trainers and losses read the fields; Megatron's schedule, shared with the SFT,
    DPO and RM trainers' dict batches, reads it as a mapping of its set entries (``batch["tokens"]``,
    ``"routes" in batch``)."""

    tokens: torch.Tensor
    """Input ids: ``[rows, S]`` padded, ``[1, T]`` packed."""
    labels: torch.Tensor
    """Each position's next token, shaped as ``tokens``."""
    position_ids: torch.Tensor
    """Shaped as ``tokens`` (restarting at 0 in each packed row)."""
    loss_mask: torch.Tensor
    """``[rows, L]`` float: 1 at the label positions of the tokens the policy sampled and trains on."""
    advantages: torch.Tensor
    """``[rows]``, one per completion (GRPO); PPO replaces it by GAE's per-token ``[rows, L]``."""
    behav_logp: torch.Tensor
    """``[rows, L]``: the policy that sampled the rollout (generation's log-probs, maybe of older weights)."""
    row_ids: torch.Tensor
    """``[rows]`` long: each row's index in its mini-batch's rows; ``-1 - i`` is a copy of row i kept out of the loss
    (``megatron_rl.rollout.packing.pack_rows``' fallback)."""
    old_logp: Optional[torch.Tensor] = None
    """pi_old / pi_prox: the trainer's training-forward recomputation at the step's first weights
    (algorithm.recompute_old_logprobs); None: ``behav_logp`` stands for it (``old_logprobs``)."""
    ref_logp: Optional[torch.Tensor] = None
    """The frozen KL reference's (algorithm.kl_coef > 0)."""
    teacher_logp: Optional[torch.Tensor] = None
    """The distillation teacher's (algorithm.teacher)."""
    routes: Optional[torch.Tensor] = None
    """Router replay: the experts generation chose, ``[rows or 1, S or T, slots, topk]``, ``NO_ROUTE`` past a row."""
    row_index: Optional[torch.Tensor] = None
    """Packed: ``[rows, L]`` long, each row label's position in the packed stream (``packed_sequences.as_rows``)."""
    row_valid: Optional[torch.Tensor] = None
    """Packed: ``[rows, L]`` bool, which of ``row_index`` hold the row's positions."""
    attention_mask: Optional[torch.Tensor] = None
    """Packed on a kernel without per-sequence attention: the block-diagonal causal mask ``[1, 1, T, T]``."""
    packed_seq_params: Any = None
    """Packed with per-sequence attention: Megatron's ``PackedSeqParams`` (THD)."""
    sequence_reward: Optional[torch.Tensor] = None
    """PPO: ``[rows]``, each completion's reward (placed at its last token by GAE)."""
    old_values: Optional[torch.Tensor] = None
    """PPO: ``[rows, L]``, the critic's values before the step's updates."""
    returns: Optional[torch.Tensor] = None
    """PPO: ``[rows, L]``, GAE's returns (the value loss's targets)."""

    def __getitem__(self, key: str):
        value = getattr(self, key, None) if key in _BATCH_FIELDS else None
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name in _BATCH_FIELDS if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def replace(self, **entries) -> "RolloutBatch":
        """A copy with ``entries`` in place of its own (the context-parallel slice, for one)."""
        return dataclasses.replace(self, **entries)

    def to_device(self) -> "RolloutBatch":
        """On the accelerator when there is one (each tensor entry copied without blocking)."""
        if not torch.cuda.is_available():
            return self
        return self.replace(**{name: value.cuda(non_blocking=True) for name, value in self.items()
                               if isinstance(value, torch.Tensor)})


_BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutBatch))
LOGPROB_KEYS = ("behav_logp", "old_logp", "ref_logp", "teacher_logp")
"""A rollout micro-batch's per-token log-probs, each named by the policy that gave it (``RolloutBatch``)."""


@dataclass
class Rollout:
    """One rollout batch: every completion of every prompt, in group order (prompt-major)."""

    prompt_ids: list[list[int]]
    """Prompt tokens per completion (each prompt repeated group_size times)."""
    response_ids: list[list[int]]
    """Generated tokens per completion (ending with eos when it stopped)."""
    logprobs: list[list[float]]
    """Log-prob of each generated token under the policy that sampled it."""
    prompts: list[str]
    completions: list[str]
    answers: list[Any]
    truncated: list[bool] = field(default_factory=list)
    """Per completion: cut at generation.max_new_tokens instead of ending by itself."""
    rewards: Optional[torch.Tensor] = None
    per_fn: dict[str, list[float]] = field(default_factory=dict)
    advantages: Optional[torch.Tensor] = None
    routes: list[torch.Tensor] = field(default_factory=list)
    """With algorithm.router_replay: per completion, the experts generation routed each fed position to
    (``GenerationOutput.routes``, this rank's MoE layers); empty otherwise."""
    seq_multiple: int = 1
    """The training length is rounded up to a multiple of this (``Engine.sequence_multiple``: 2*cp under
    context parallelism, tp (times cp) under sequence parallelism); the extra positions are masked padding."""
    response_mask: list[list[int]] = field(default_factory=list)
    """Multi-turn: per response token, 1 when the policy sampled it, 0 for an environment's reply (context, out
    of the loss; its ``logprobs`` are 0.0 placeholders). Empty for single-turn rollouts (every token the
    policy's)."""
    env_rewards: list[float] = field(default_factory=list)
    """Multi-turn: each episode's reward from its environment (the sum of its turns')."""
    episodes: list[dict] = field(default_factory=list)
    """Multi-turn: each episode's log (``Episode.log``: turns, replies, rewards, how it ended)."""

    def select(self, rows: list[int]) -> "Rollout":
        """The completions ``rows`` (in that order), with their scores."""
        pick = lambda values: [values[i] for i in rows]  # noqa: E731
        index = torch.tensor(rows, dtype=torch.long)
        return Rollout(prompt_ids=pick(self.prompt_ids), response_ids=pick(self.response_ids),
                       logprobs=pick(self.logprobs), prompts=pick(self.prompts), completions=pick(self.completions),
                       answers=pick(self.answers), truncated=pick(self.truncated),
                       rewards=None if self.rewards is None else self.rewards[index],
                       per_fn={name: pick(values) for name, values in self.per_fn.items()},
                       advantages=None if self.advantages is None else self.advantages[index],
                       routes=pick(self.routes) if self.routes else [], seq_multiple=self.seq_multiple,
                       response_mask=pick(self.response_mask) if self.response_mask else [],
                       env_rewards=pick(self.env_rewards) if self.env_rewards else [],
                       episodes=pick(self.episodes) if self.episodes else [])

    @staticmethod
    def concat(parts: list["Rollout"]) -> "Rollout":
        """One rollout of several, in order (scores and advantages joined when they have them)."""
        joined = lambda name: [v for part in parts for v in getattr(part, name)]  # noqa: E731
        return Rollout(prompt_ids=joined("prompt_ids"), response_ids=joined("response_ids"),
                       logprobs=joined("logprobs"), prompts=joined("prompts"), completions=joined("completions"),
                       answers=joined("answers"), truncated=joined("truncated"),
                       rewards=None if parts[0].rewards is None else torch.cat([part.rewards for part in parts]),
                       per_fn={name: [v for part in parts for v in part.per_fn[name]] for name in parts[0].per_fn},
                       advantages=None if parts[0].advantages is None else torch.cat([p.advantages for p in parts]),
                       routes=joined("routes"), seq_multiple=parts[0].seq_multiple,
                       response_mask=joined("response_mask"), env_rewards=joined("env_rewards"),
                       episodes=joined("episodes"))

    def sample_records(self, count: int) -> list[dict]:
        """``count`` completions spread evenly over the rollout (so over its prompts), as JSON-ready records for the
        sample log: prompt, completion, reference answer, reward (total and per function), advantage, response
        tokens and whether generation cut it at the length limit; for an episode, its turns (each the policy's
        text, trained, and the reply that followed, context) and the count of trained tokens."""
        total = len(self.completions)
        rows = sorted({i * total // count for i in range(count)}) if total else []
        plain = lambda value: value if value is None or isinstance(value, (str, int, float, bool)) else str(value)  # noqa: E731
        return [{"prompt": self.prompts[i], "completion": self.completions[i], "answer": plain(self.answers[i]),
                 "reward": None if self.rewards is None else float(self.rewards[i]),
                 "rewards": {name: float(values[i]) for name, values in self.per_fn.items()},
                 "advantage": None if self.advantages is None else float(self.advantages[i]),
                 "response_tokens": len(self.response_ids[i]),
                 "truncated": bool(self.truncated[i]) if self.truncated else False,
                 **({"episode": self.episodes[i], "trained_tokens": sum(self.response_mask[i])}
                    if self.episodes else {})} for i in rows]

    @property
    def seq_length(self) -> int:
        """Padded training length: the longest prompt + response, minus the last token (inputs are shifted),
        rounded up to ``seq_multiple``."""
        longest = max(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)) - 1
        return -(-longest // self.seq_multiple) * self.seq_multiple


def collate_rollout(rows: list[RolloutRow], *, seq_length: int, pad_id: int,
                    row_ids: Optional[list[int]] = None) -> RolloutBatch:
    """A padded training micro-batch of rollout rows (``row_ids``: their places in the mini-batch, default
    0, 1, ...); ``loss_mask`` marks the response's label positions. Rows with ``routes`` (router replay) give
    ``routes`` [b, seq_length, slots, topk], ``NO_ROUTE`` past each row's end."""
    batch_size = len(rows)
    tokens = torch.full((batch_size, seq_length + 1), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((batch_size, seq_length), dtype=torch.float32)
    behav_logp = torch.zeros((batch_size, seq_length), dtype=torch.float32)
    advantages = torch.zeros(batch_size, dtype=torch.float32)
    for i, row in enumerate(rows):
        seq = row.prompt_ids + row.response_ids
        tokens[i, :len(seq)] = torch.tensor(seq)
        start, end = len(row.prompt_ids) - 1, len(seq) - 1  # label positions of the response tokens
        loss_mask[i, start:end] = row.loss_mask()
        behav_logp[i, start:end] = torch.tensor(row.logprobs, dtype=torch.float32)
        advantages[i] = row.advantage
    routes = None
    if rows and rows[0].routes is not None:
        routes = _collate_routes([row.routes for row in rows], seq_length=seq_length)
    return RolloutBatch(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(), loss_mask=loss_mask,
                        behav_logp=behav_logp, advantages=advantages,
                        position_ids=torch.arange(seq_length).unsqueeze(0).expand(batch_size, -1).contiguous(),
                        row_ids=torch.tensor(list(range(batch_size)) if row_ids is None else row_ids),
                        routes=routes).to_device()


def _collate_routes(routes: list[torch.Tensor], *, seq_length: int) -> torch.Tensor:
    from megatron_rl.models.router_replay import NO_ROUTE

    slots, topk = routes[0].shape[1:]
    out = torch.full((len(routes), seq_length, slots, topk), NO_ROUTE, dtype=routes[0].dtype)
    for i, row in enumerate(routes):
        out[i, :row.size(0)] = row
    return out


def rollout_rows(rollout: Rollout, *, mask_truncated: bool = False) -> list[RolloutRow]:
    """One training row per completion; with ``mask_truncated`` a completion cut at the length limit stays in
    the batch but not in the loss (DAPO's overlong filtering)."""
    return [RolloutRow(prompt_ids=rollout.prompt_ids[i], response_ids=rollout.response_ids[i],
                       logprobs=rollout.logprobs[i], advantage=float(rollout.advantages[i]),
                       in_loss=not (mask_truncated and rollout.truncated[i]),
                       response_mask=rollout.response_mask[i] if rollout.response_mask else None,
                       routes=rollout.routes[i] if rollout.routes else None)
            for i in range(len(rollout.response_ids))]


def store_logprobs(batches: list[RolloutBatch], key: str, values: list) -> None:
    """Each micro-batch's ``key`` (one of LOGPROB_KEYS): its entry of ``values``, a forward's per-batch results
    (none on the pipeline stages that compute no loss)."""
    if key not in LOGPROB_KEYS:
        raise KeyError(f"{key} is not one of {', '.join(LOGPROB_KEYS)}")
    for batch, value in zip(batches, values):
        setattr(batch, key, value)


def old_logprob_key(batch: RolloutBatch) -> str:
    """Where pi_old, the anchor of the clipped ratio, is: the trainer's recomputation (``old_logp``) when it made
    one, else the log-probs of the policy that sampled the rollout (``behav_logp``)."""
    return "old_logp" if batch.old_logp is not None else "behav_logp"


def old_logprobs(batch: RolloutBatch) -> torch.Tensor:
    """pi_old of a micro-batch (``old_logprob_key``)."""
    return batch[old_logprob_key(batch)]
