"""GRPO token-level loss: clipped policy ratio, KL to a reference, and the three loss aggregations.

All tensors are [batch, T] over response positions with a 0/1 `mask` (1 = a generated token that counts).
Pure torch; nothing here knows about tensor parallelism, so the log-probs passed in must already be full
(the trainer gets them from vocab-parallel logits with ``megatron_rl.models.logprobs``). The GRPO trainer's
Megatron loss function (``megatron_rl.rollout.batch.make_grpo_loss``) calls ``grpo_loss`` on every micro-batch.

Sign convention: every function returns a quantity to MINIMISE (the negated GRPO objective).

Test: `.venv/bin/python -m pytest tests/test_grpo_math.py -q`
"""

from __future__ import annotations

import dataclasses

import torch

from launcher.config.schema import IMPORTANCE_RATIOS, KL_ESTIMATORS, LOSS_AGGREGATIONS, AlgorithmConfig

Number = int | float | torch.Tensor


@dataclasses.dataclass(kw_only=True, frozen=True)
class GRPOLossConfig:
    """Knobs of the GRPO loss. The defaults and checks of the values a user sets live in the config schema
    (``AlgorithmConfig``); ``from_algorithm`` is how the trainer builds this."""

    eps_low: float
    """Lower clip: the ratio is clipped at 1 - eps_low."""
    eps_high: float
    """Upper clip: the ratio is clipped at 1 + eps_high (DAPO clip-higher uses 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 (verl uses 3): for A < 0 the per-token loss is capped at -A * c. None = off."""
    kl_coef: float
    """Weight of the per-token KL to the reference model; 0 switches the reference off."""
    kl_kind: str
    """KL estimator, one of the schema's KL_ESTIMATORS: k1 = logp - ref, k2 = (logp - ref)^2 / 2,
    k3 = exp(ref - logp) - (ref - logp) - 1."""
    kl_clamp: float | None = 10.0
    """Clamp of the per-token KL to [-kl_clamp, kl_clamp] (NeMo RL uses 10); None = no clamp."""
    kl_log_ratio_clamp: float | None = 20.0
    """Clamp of logp - ref before the KL estimator, so k3's exp cannot overflow (NeMo RL uses 20); None = off."""
    loss_agg_mode: str
    """One of the schema's LOSS_AGGREGATIONS: seq-mean-token-mean (DeepSeekMath), token-mean (DAPO) or
    seq-mean-token-sum-norm (Dr. GRPO)."""
    max_response_len: int | None = None
    """Constant normaliser for seq-mean-token-sum-norm (the generation length limit); required in that mode."""
    importance_ratio: str = "token"
    """One of the schema's IMPORTANCE_RATIOS: token (PPO/GRPO) or sequence (GSPO, ``sequence_log_ratio``)."""
    off_policy_correction: str = "none"
    """One of the schema's OFF_POLICY_CORRECTIONS: none, truncated_is or decoupled
    (``megatron_rl.algorithms.off_policy``); the last two need the behaviour log-probs."""
    is_cap: float = 2.0
    """The cap of the behaviour importance weight of off_policy_correction."""

    @classmethod
    def from_algorithm(cls, algo: AlgorithmConfig, *, max_response_len: int) -> "GRPOLossConfig":
        """The loss of a job's ``algorithm`` section (already checked by the schema)."""
        return cls(eps_low=algo.clip_eps_low, eps_high=algo.clip_eps_high, dual_clip=algo.dual_clip,
                   kl_coef=algo.kl_coef, kl_kind=algo.kl_estimator, loss_agg_mode=algo.loss_aggregation,
                   max_response_len=max_response_len, importance_ratio=algo.importance_ratio,
                   off_policy_correction=algo.off_policy_correction, is_cap=algo.is_cap)

    def __post_init__(self) -> None:
        if (self.kl_kind not in KL_ESTIMATORS or self.loss_agg_mode not in LOSS_AGGREGATIONS
                or self.importance_ratio not in IMPORTANCE_RATIOS):
            raise ValueError(f"kl_kind={self.kl_kind!r} / loss_agg_mode={self.loss_agg_mode!r} / importance_ratio="
                             f"{self.importance_ratio!r}: use one of {KL_ESTIMATORS} / {LOSS_AGGREGATIONS} / "
                             f"{IMPORTANCE_RATIOS}")
        from megatron_rl.algorithms.off_policy import OFF_POLICY_CORRECTIONS

        if self.off_policy_correction not in OFF_POLICY_CORRECTIONS or self.is_cap < 1:
            raise ValueError(f"off_policy_correction={self.off_policy_correction!r} / is_cap={self.is_cap}: use one of "
                             f"{OFF_POLICY_CORRECTIONS} / a cap >= 1")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and not self.max_response_len:
            raise ValueError("loss_agg_mode=seq-mean-token-sum-norm needs max_response_len")


def _check_shapes(mask: torch.Tensor, *tensors: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [batch, T], got shape {tuple(mask.shape)}")
    for tensor in tensors:
        if tensor.shape != mask.shape:
            raise ValueError(f"shape {tuple(tensor.shape)} does not match mask shape {tuple(mask.shape)}")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, *,
                       seq_lengths: torch.Tensor | None = None, sum_over_parts=None) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio, mean over each sequence's tokens of (logp - old_logp), as a
    [batch, T] tensor that repeats each sequence's value on its positions (differentiable in logp).

    When the rows hold parts of sequences (context parallelism), ``seq_lengths`` are the whole lengths and
    ``sum_over_parts`` sums a [batch] tensor over the parts (an autograd-aware all-reduce)."""
    mask = mask.to(logp.dtype)
    sums = ((logp - old_logp) * mask).sum(dim=-1)
    if sum_over_parts is not None:
        sums = sum_over_parts(sums)
    lengths = mask.sum(dim=-1) if seq_lengths is None else seq_lengths.to(logp.dtype)
    return (sums / lengths.clamp(min=1)).unsqueeze(-1).expand_as(logp)


def policy_ratio_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = 20.0,
    log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token negated clipped surrogate: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), [batch, T].

    advantages: [batch] (one per sequence) or [batch, T]. dual_clip c: where A < 0 the loss is further capped
    at -A c (verl's dual clip). log_ratio_clamp only guards exp() against overflow (the clip binds long before).
    log_ratio: the log importance ratio per position; default the token's own, logp - old_logp (GSPO passes
    ``sequence_log_ratio``, so every token of a sequence carries the sequence's ratio and clip).
    Stats (detached, over masked tokens): clip_fraction = share of tokens where the clipped branch was chosen
    (so its gradient is zero), dual_clip_fraction, ratio_min, ratio_max (1.0 when no token is masked in).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    _check_shapes(mask, logp, old_logp, advantages)
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp if log_ratio is None else log_ratio
    _check_shapes(mask, log_ratio)
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -advantages * dual_clip
        negative = advantages < 0
        dual_active = negative & (per_token > cap)
        per_token = torch.where(negative, torch.minimum(per_token, cap), per_token)

    with torch.no_grad():
        in_mask = mask > 0
        if in_mask.any():
            ratio_min, ratio_max = ratio[in_mask].min(), ratio[in_mask].max()
        else:
            ratio_min = ratio_max = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        stats = {
            "clip_fraction": _masked_mean(clip_active.to(mask.dtype), mask),
            "dual_clip_fraction": _masked_mean(dual_active.to(mask.dtype), mask),
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
        }
    return per_token, stats


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str = "k3",
    clamp: float | None = None,
    *,
    log_ratio_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate, same shape as logp.

    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1 (>= 0, Schulman's
    estimator used by DeepSeekMath). log_ratio_clamp limits logp - ref before the estimator; clamp limits the result.
    """
    log_ratio = logp - ref_logp
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind == "k3":
        kl = torch.exp(-log_ratio) + log_ratio - 1.0
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; use one of {KL_ESTIMATORS}")
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl


def local_normalisers(mask: torch.Tensor, seq_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of masked-in tokens, number of sequences with at least one) of this shard.

    Sum these over data-parallel ranks and micro-batches of one optimizer step to get the global_num_tokens /
    global_num_seqs that `aggregate` takes. With ``seq_lengths`` (whole-sequence lengths while ``mask`` holds
    part of each sequence, see `aggregate`) a sequence counts when its whole length is > 0; the token count
    stays this shard's own.
    """
    lengths = mask.to(torch.float32).sum(dim=-1)
    counted = lengths if seq_lengths is None else seq_lengths.to(torch.float32)
    return lengths.sum(), (counted > 0).sum().to(torch.float32)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    max_response_len: int | None = None,
    global_num_tokens: Number | None = None,
    global_num_seqs: Number | None = None,
    seq_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [batch, T] per-token loss to a scalar.

    - token-mean (DAPO): sum over all masked tokens / number of masked tokens.
    - seq-mean-token-mean (DeepSeekMath): mean over each sequence's tokens, then mean over sequences.
    - seq-mean-token-sum-norm (Dr. GRPO): sum over all masked tokens / (num sequences * max_response_len).
    A sequence counts only if it has at least one masked-in token (an all-padding row adds nothing).

    With global_num_tokens / global_num_seqs (totals over all data-parallel ranks and micro-batches of the
    optimizer step) the result is this shard's share of the global value: summing the results of all shards
    gives exactly the loss of the whole batch computed in one piece. Without them the local counts are used.

    seq_lengths: [batch] token counts of the WHOLE sequences when ``mask`` covers only part of each one (context
    parallelism: this rank's chunks of every sequence). seq-mean-token-mean then divides each sequence by its
    whole length, and the default counts come from it, so summing the results over the parts of the sequences
    gives the loss of the whole sequences. Default: ``mask.sum(-1)`` (the rows are whole).
    """
    _check_shapes(mask, per_token)
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    lengths = mask.sum(dim=-1) if seq_lengths is None else seq_lengths.to(per_token.dtype)
    if lengths.shape != mask.shape[:1]:
        raise ValueError(f"seq_lengths shape {tuple(lengths.shape)} must be [batch] = [{mask.shape[0]}]")
    local_num_seqs = (lengths > 0).sum().clamp(min=1)
    num_seqs = local_num_seqs if global_num_seqs is None else global_num_seqs
    if mode == "token-mean":
        num_tokens = lengths.sum().clamp(min=1) if global_num_tokens is None else global_num_tokens
        return masked.sum() / num_tokens
    if mode == "seq-mean-token-mean":
        seq_means = masked.sum(dim=-1) / lengths.clamp(min=1)
        return seq_means.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        if not max_response_len:
            raise ValueError("seq-mean-token-sum-norm needs max_response_len (the constant normaliser)")
        return masked.sum() / (num_seqs * max_response_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {LOSS_AGGREGATIONS}")


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: GRPOLossConfig,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    global_num_tokens: Number | None = None,
    global_num_seqs: Number | None = None,
    seq_lengths: torch.Tensor | None = None,
    sum_over_parts=None,
    behav_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss = aggregate(policy_ratio_loss + kl_coef * kl_penalty), and detached 0-dim metrics.

    With config.off_policy_correction (asynchronous GRPO) the ratio loss is ``off_policy.off_policy_ratio_loss``:
    old_logp is then the proximal policy (the trainer's recomputation) and behav_logp the log-probs of the
    policy that generated the tokens; its behav_* stats join the metrics.

    ref_logp may be None when config.kl_coef == 0; when given with kl_coef 0 the KL is still reported.
    entropy: optional per-token entropy [batch, T] (already computed by the caller), reported as a masked mean.
    Metrics: loss, pg_loss (aggregated like the loss), kl and entropy (masked token means; 0 when absent),
    clip_fraction, dual_clip_fraction, ratio_min, ratio_max, num_tokens, num_seqs (local counts, for weighting
    when metrics of several micro-batches or ranks are averaged; see `local_normalisers`).
    seq_lengths: whole-sequence lengths when the rows are parts of sequences (see `aggregate`); with them,
    sum_over_parts sums a per-sequence [batch] tensor over the parts (the GSPO sequence ratio needs it).
    """
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp (the frozen reference model's log-probs)")
    log_ratio = None
    if config.importance_ratio == "sequence":
        log_ratio = sequence_log_ratio(logp, old_logp, mask, seq_lengths=seq_lengths, sum_over_parts=sum_over_parts)
    if config.off_policy_correction != "none":
        from megatron_rl.algorithms.off_policy import off_policy_ratio_loss

        if behav_logp is None:
            raise ValueError(f"off_policy_correction={config.off_policy_correction} needs behav_logp")
        per_token_pg, stats = off_policy_ratio_loss(
            logp, old_logp, behav_logp, advantages, mask, correction=config.off_policy_correction,
            cap=config.is_cap, eps_low=config.eps_low, eps_high=config.eps_high, dual_clip=config.dual_clip,
            log_ratio=log_ratio)
    else:
        per_token_pg, stats = policy_ratio_loss(
            logp,
            old_logp,
            advantages,
            mask,
            eps_low=config.eps_low,
            eps_high=config.eps_high,
            dual_clip=config.dual_clip,
            log_ratio=log_ratio,
        )
    agg_kwargs = dict(
        max_response_len=config.max_response_len,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        seq_lengths=seq_lengths,
    )
    per_token = per_token_pg
    float_mask = mask.to(logp.dtype)
    kl_mean = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        _check_shapes(mask, ref_logp)
        per_token_kl = kl_penalty(
            logp, ref_logp, config.kl_kind, config.kl_clamp, log_ratio_clamp=config.kl_log_ratio_clamp
        )
        kl_mean = _masked_mean(per_token_kl.detach(), float_mask)
        if config.kl_coef > 0:
            per_token = per_token_pg + config.kl_coef * per_token_kl
    loss = aggregate(per_token, mask, config.loss_agg_mode, **agg_kwargs)

    with torch.no_grad():
        num_tokens, num_seqs = local_normalisers(mask, seq_lengths)
        metrics = {
            "loss": loss.detach(),
            "pg_loss": aggregate(per_token_pg.detach(), mask, config.loss_agg_mode, **agg_kwargs),
            "kl": kl_mean,
            "entropy": (
                _masked_mean(entropy.detach(), float_mask)
                if entropy is not None
                else torch.zeros((), dtype=logp.dtype, device=logp.device)
            ),
            **stats,
            "num_tokens": num_tokens,
            "num_seqs": num_seqs,
        }
    return loss, metrics
