"""What an RL step reports of its rollout, its training and its times (metrics.jsonl, one line a step)."""

from __future__ import annotations

import torch

from megatron_rl.rl.sampled import SampledBatch
from megatron_rl.rollout.multi_turn import episode_metrics
from megatron_rl.rollout.colocated import correct_answers


def rl_step_metrics(batch: SampledBatch, train: dict, t_train: float, *, group_size: int, dynamic_sampling: bool,
                    offload: dict) -> dict:
    """Reward, accuracy and lengths of every completion drawn; the training metrics ``train``; times and
    throughput; the optimizer offload's bytes and times over the step's generation phases (``offload``)."""
    rollout, t_gen, t_score = batch.drawn, batch.sample_s, batch.score_s
    rewards = rollout.rewards
    lengths = torch.tensor([len(r) for r in rollout.response_ids], dtype=torch.float32)
    correct = correct_answers(rollout)
    gen_tokens = float(lengths.sum())
    train_tokens = gen_tokens + sum(len(p) for p in rollout.prompt_ids)
    return {
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "accuracy": float(correct.float().mean()), "response_length": float(lengths.mean()),
        **{f"reward_{name}": float(torch.tensor(v).mean()) for name, v in rollout.per_fn.items()},
        "truncated_fraction": sum(rollout.truncated) / len(rollout.truncated),
        **episode_metrics(rollout.episodes),
        **({"sampling_draws": float(batch.draws), "groups_kept": len(batch.kept.response_ids) / group_size}
           if dynamic_sampling else {}),
        **train,
        # (token, MoE layer) routes the training forwards replayed, on this rank's pipeline stage
        **({"replayed_routes": float(sum(r.shape[0] * r.shape[1] for r in batch.kept.routes))}
           if batch.kept.routes else {}),
        "generate_tokens_per_s": gen_tokens / max(t_gen, 1e-9),
        "train_tokens_per_s": train_tokens / max(t_train, 1e-9),
        "time_generate_s": t_gen, "time_score_s": t_score, "time_train_s": t_train,
        "step_time_s": t_gen + t_score + t_train,
        **offload,
    }
