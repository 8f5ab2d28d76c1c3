"""The GRPO `rm` reward (RewardModelScorer) on a LoRA-trained reward model, in a torchrun job of 2 processes.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/lora_rm_scorer.py --out OUT --rm-dir RM_RUN

Scores the held-out pairs of the rm run in RM_RUN (its config.yaml and checkpoints) at TP1 x DP2 and at TP2, and at
TP1 x DP2 also with the adapters off, and writes the pair metrics of each (accuracy, reward_margin, reward_chosen,
reward_rejected, as the rm trainer's eval computes them) to OUT/rank{R}.json; tests/test_evaluate.py compares them
with the trainer's last eval.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pair_metrics(rewards: list[float], pairs: int) -> dict:
    chosen, rejected = rewards[:pairs], rewards[pairs:]
    return {"accuracy": sum(c > r for c, r in zip(chosen, rejected)) / pairs,
            "reward_margin": sum(c - r for c, r in zip(chosen, rejected)) / pairs,
            "reward_chosen": sum(chosen) / pairs, "reward_rejected": sum(rejected) / pairs}


def main() -> None:
    import torch

    from dist_common import write_rank_result
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.models.lora import adapters, adapters_disabled
    from megatron_rl.rewards.reward_model_scorer import RewardModelScorer
    from dist_common import start_layout
    from megatron_rl.trainers import pairs

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rm-dir", required=True)
    args = parser.parse_args()
    run = Path(args.rm_dir)
    cfg = load_config(run / "config.yaml")
    result = {}
    for name, tp in (("dp2", 1), ("tp2", 2)):
        start_layout(tp=tp, seed=1234)
        scorer = RewardModelScorer(str(run / "checkpoints"), micro_batch_size=5)
        _, _, held_out = pairs.load_pairs(cfg, scorer.shape, max_length=scorer.max_length)
        seqs = held_out.chosen + held_out.rejected
        result[name] = {"adapters": len(list(adapters(scorer.chunks))), "pairs": len(held_out),
                        **pair_metrics(scorer.score_ids(seqs), len(held_out))}
        if tp == 1:
            with adapters_disabled(scorer.chunks):
                result["adapters_off"] = pair_metrics(scorer.score_ids(seqs), len(held_out))
    write_rank_result(Path(args.out), result)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
