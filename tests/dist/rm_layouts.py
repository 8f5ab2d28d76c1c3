"""Reward model across layouts, in ONE torchrun job of 2 processes (Megatron's state is per process).

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/rm_layouts.py OUT_DIR

Writes OUT_DIR/results.json (rank 0) with rewards of the same sequences computed:
- from the seed at TP=1 and at TP=2 (Megatron's CPU init is layout-independent);
- through RewardModelScorer from one saved RM checkpoint at TP=1 x DP=2, TP=2 and PP=2, with micro-batches of
  3 (right-padded rows of different lengths), of 1 (no padding) and packed by 30 tokens (rows one after another,
  each attending within itself);
- directly through the model, right-padded vs left-padded (with a causal+padding attention mask);
- two Bradley-Terry training steps (Engine, Megatron DDP + distributed optimizer) from the checkpoint's weights
  at TP=1 x DP=2, TP=2 and PP=2;
and the result of initialising an RM from a policy (GPT) checkpoint. tests/test_rm.py makes the assertions.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_rl.spec.model_shape import load_model_shape  # noqa: E402
from megatron_rl.data.tokenizer import CharTokenizer  # noqa: E402
from megatron_rl.models.builder import ModelOptions, build_model_chunks  # noqa: E402
from megatron_rl.models.reward_model import (  # noqa: E402
    build_reward_model_chunks,
    causal_padding_mask,
    last_token_index,
    load_reward_model_weights,
)
from megatron_rl.runtime import checkpoint as ckpt  # noqa: E402
from megatron_rl.runtime.distributed import current_dims, shutdown  # noqa: E402
from dist_common import start_layout  # noqa: E402

PROMPTS = ["last of 387=", "last of 12=", "first of 905=", "x", "last of 5550123=", "q="]
COMPLETIONS = ["7", "2", "9 and more text", "yz", "3", "??"]
SEED = 4321


def use_layout(tp: int = 1, pp: int = 1) -> None:
    start_layout(tp=tp, pp=pp, seed=SEED)


def seeded_rewards(shape, tp: int) -> list[float]:
    """Rewards of PROMPTS+COMPLETIONS from an RM built from SEED at this TP (PP=1), right-padded batch."""
    from megatron_rl.models.reward_model import right_padded_batch

    torch.manual_seed(SEED)
    model = build_reward_model_chunks(shape, ModelOptions(dims=current_dims()))[0].eval()
    tok = CharTokenizer()
    seqs = [tok.encode(p + c, add_bos=True) for p, c in zip(PROMPTS, COMPLETIONS)]
    batch = right_padded_batch(seqs, pad_id=tok.pad_id, length=max(map(len, seqs)))
    with torch.no_grad():
        return model(batch["tokens"], batch["position_ids"], None, last_index=batch["last_index"]).tolist()


def padding_rewards(model) -> dict:
    """The same rows right-padded (no mask) and left-padded (mask, positions from 0 at the first real token)."""
    tok = CharTokenizer()
    seqs = [tok.encode(p + c, add_bos=True) for p, c in zip(PROMPTS, COMPLETIONS)]
    length = max(map(len, seqs)) + 2
    right = torch.full((len(seqs), length), tok.pad_id)
    left = torch.full((len(seqs), length), tok.pad_id)
    right_mask = torch.zeros(len(seqs), length, dtype=torch.bool)
    left_mask = torch.zeros_like(right_mask)
    left_pos = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, ids in enumerate(seqs):
        right[i, :len(ids)] = torch.tensor(ids)
        right_mask[i, :len(ids)] = True
        left[i, length - len(ids):] = torch.tensor(ids)
        left_mask[i, length - len(ids):] = True
        left_pos[i, length - len(ids):] = torch.arange(len(ids))
    right_pos = torch.arange(length).expand(len(seqs), length)
    with torch.no_grad():
        out_right = model(right, right_pos, None, last_index=last_token_index(right_mask))
        out_left = model(left, left_pos, causal_padding_mask(left_mask), last_index=last_token_index(left_mask))
        single = [model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), None,
                        last_index=torch.tensor([len(ids) - 1])).item() for ids in seqs]
    return {"right": out_right.tolist(), "left": out_left.tolist(), "single": single}


def train_two_steps(shape, rm_dir: Path, tp: int, pp: int) -> dict:
    """Two RM optimizer steps on 4 fixed pairs from the weights in rm_dir: loss, grad norm, and metrics after."""
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.models.reward_model import reward_forward
    from megatron_rl.trainers.common import job_engine
    from megatron_rl.algorithms.reward_model import RM_REPORTS, preference_loss
    from megatron_rl.trainers.pairs import RewardPairBatcher
    from megatron_rl.data.preferences import PreferenceData

    cfg = load_config(None, ["algorithm.name=rm", f"parallel.tp={tp}", f"parallel.pp={pp}",
                             "algorithm.global_batch_size=4", "parallel.micro_batch_size=1", "optimizer.lr=1e-3",
                             "algorithm.rm_centering_coef=0.01"])
    engine = job_engine(cfg, shape, build_chunks=build_reward_model_chunks)
    assert load_reward_model_weights(rm_dir, engine.chunks)
    tok = CharTokenizer()
    seqs = [tok.encode(p + c, add_bos=True) for p, c in zip(PROMPTS, COMPLETIONS)]
    data = PreferenceData(chosen=seqs[:4], rejected=seqs[2:], name="fixed", num_read=4, num_truncated=0,
                          num_dropped=0)
    batcher = RewardPairBatcher(cfg, pad_id=tok.pad_id, max_length=32)

    def loss_fn(rewards, batch):
        return preference_loss(rewards, batch, margin=0.0, centering_coef=0.01)

    out = {}
    for step in (1, 2):
        batches, length = batcher.micro_batches(data, [0, 1, 2, 3], pad_to=1)
        metrics = engine.train_step(batches, loss_fn, seq_length=length, report_names=RM_REPORTS,
                                    forward_fn=reward_forward)
        out[f"loss{step}"], out[f"grad_norm{step}"] = metrics["loss"], metrics["grad_norm"]
    batches, length = batcher.micro_batches(data, [0, 1, 2, 3], pad_to=1)
    out["after"] = engine.forward_only(batches, loss_fn, seq_length=length, report_names=RM_REPORTS,
                                       forward_fn=reward_forward)
    return out


def main(out_dir: Path) -> None:
    from megatron_rl.rewards.reward_model_scorer import RewardModelScorer

    shape = load_model_shape("tiny-cpu")
    rank = int(os.environ["RANK"])
    results: dict = {}

    use_layout(tp=1)
    results["seed_tp1"] = seeded_rewards(shape, tp=1)
    torch.manual_seed(SEED + 1)
    rm = build_reward_model_chunks(shape, ModelOptions())
    with torch.no_grad():  # a non-trivial head so that rewards spread out
        rm[0].rm_head.weight.normal_(0.0, 0.5)
        rm[0].rm_head.bias.fill_(0.25)
    meta = {"version": 1, "shape": shape.to_dict(), "tokenizer": None, "max_length": 24}
    rm_dir = out_dir / "rm"
    ckpt.save_checkpoint(rm_dir, step=1, chunks=rm, extra={"reward_model": meta})
    results["padding"] = padding_rewards(rm[0].eval())

    policy = build_model_chunks(shape, ModelOptions())
    ckpt.save_checkpoint(out_dir / "policy", step=1, chunks=policy)
    fresh = build_reward_model_chunks(shape, ModelOptions())
    results["init_from_policy_head_loaded"] = load_reward_model_weights(out_dir / "policy", fresh)
    trunk_equal = all(torch.equal(a, b) for (name, a), (_, b) in
                      zip(fresh[0].state_dict().items(), policy[0].state_dict().items())
                      if name.startswith(("embedding.", "decoder.")) and torch.is_tensor(a))
    results["init_from_policy_trunk_equal"] = trunk_equal
    results["init_from_rm_head_loaded"] = load_reward_model_weights(rm_dir, fresh)
    results["init_from_rm_head_equal"] = torch.equal(fresh[0].rm_head.weight, rm[0].rm_head.weight)

    for name, tp, pp in (("tp1_dp2", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)):
        use_layout(tp=tp, pp=pp)
        if name == "tp2":
            results["seed_tp2"] = seeded_rewards(shape, tp=2)
        results[f"train_{name}"] = train_two_steps(shape, rm_dir, tp=tp, pp=pp)
        before = torch.get_rng_state()
        scorer = RewardModelScorer(str(rm_dir), micro_batch_size=3)
        results[f"rng_kept_{name}"] = torch.equal(before, torch.get_rng_state())
        results[f"scorer_{name}"] = scorer(PROMPTS, COMPLETIONS, [None] * len(PROMPTS))
        scorer.micro_batch_size = 1
        results[f"scorer_{name}_mbs1"] = scorer(PROMPTS, COMPLETIONS, [None] * len(PROMPTS))
        scorer.micro_batch_tokens = 30  # rows of 14, 13, 24, 4, 18 and 5 tokens packed by 30 over the DP ranks
        results[f"scorer_{name}_packed"] = scorer(PROMPTS, COMPLETIONS, [None] * len(PROMPTS))
        results[f"scorer_{name}_lengths"] = [len(ids) for ids in scorer.encode(PROMPTS, COMPLETIONS)]
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))
    shutdown()


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main(Path(sys.argv[1])))
