"""Packed against padded GRPO micro-batches on one rank layout (torchrun, gloo, CPU): two engines with the same
weights, one fed micro_batch_size rows padded to the longest, the other the rows packed by tokens
(megatron_rl/rollout/packing.py). Each rank writes the largest log-prob difference per row (the old-log-prob
pass), the two optimizer steps' loss and grad norm, and the largest parameter difference after them.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist/packing_check.py --layouts tp2,pp2_vpp2 --out OUT

``OUT/rank{R}.json`` maps each layout to its results.
"""

from __future__ import annotations

import argparse
import dataclasses
import random

import torch


def rollout_rows(count: int, *, vocab: int, seed: int) -> list:
    """Rows (``RolloutRow``) of uneven prompt and response lengths (a long tail)."""
    from megatron_rl.rollout.batch import RolloutRow

    rng = random.Random(seed)
    rows = []
    for i in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        response = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 2, 3, 5, 8, 21]))]
        rows.append(RolloutRow(prompt_ids=prompt, response_ids=response,
                               logprobs=[-rng.uniform(0.5, 4.0) for _ in response], advantage=rng.uniform(-1.5, 1.5),
                               in_loss=i % 7 != 3))
    return rows


LAYOUTS = {"tp2": dict(tp=2), "pp2_vpp2": dict(pp=2, vpp=2, layers=4)}
"""Named layouts (``--layouts``), checked one after another in the same processes (Megatron's parallel state made
again)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from dist_common import write_rank_result

    write_rank_result(args.out, {name: check(**LAYOUTS[name]) for name in args.layouts.split(",")})


def check(*, tp: int = 1, pp: int = 1, vpp: int | None = None, layers: int | None = None, budget: int = 40) -> dict:
    from megatron.core import parallel_state as ps

    from dist_common import start_layout
    from megatron_rl.algorithms.policy_loss import GRPOLossConfig
    from megatron_rl.models import unwrap
    from megatron_rl.rl.loss import make_grpo_loss
    from megatron_rl.rollout.batch import collate_rollout, old_logprobs, store_logprobs
    from megatron_rl.rollout.packing import pack_minibatch, pack_rows
    from megatron_rl.runtime.training import data_parallel_slice, logits_forward
    from megatron_rl.trainers.common import job_engine
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape

    cfg = load_config(overrides=[f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.vpp={vpp or 'null'}",
                                 "algorithm.global_batch_size=24", "algorithm.prompts_per_step=6", "algorithm.group_size=4", "parallel.micro_batch_size=4", "run.seed=5",
                                 "optimizer.lr=0.01", "optimizer.adam_eps=1e-4", "algorithm.kl_coef=0", "algorithm.loss_aggregation=seq-mean-token-mean"])
    start_layout(tp=tp, pp=pp, vpp=vpp or 1, seed=cfg.run.seed)
    shape = load_model_shape("tiny-cpu")
    if layers:
        shape = dataclasses.replace(shape, num_layers=layers)
    padded_engine = job_engine(cfg, shape, total_steps=4)
    packed_engine = job_engine(cfg, shape, total_steps=4)
    for a, b in zip(padded_engine.chunks, packed_engine.chunks):
        unwrap(b).load_state_dict(unwrap(a).state_dict())

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = rollout_rows(cfg.algorithm.global_batch_size, vocab=shape.vocab_size, seed=3)
    multiple = padded_engine.sequence_multiple
    longest = max(r.forward_tokens for r in rows)
    seq_length = -(-longest // multiple) * multiple
    padded_ids = data_parallel_slice(list(range(len(rows))), micro_batch_size=4)  # each micro-batch's rows
    padded = [collate_rollout([rows[i] for i in ids], seq_length=seq_length, pad_id=0) for ids in padded_ids]
    count_multiple = pp if (vpp or 1) > 1 else 1
    thd = packed_engine.opts.takes_packed_sequences(shape)  # what the trainer passes: SDPA's per-sequence loop
    packed, figures = pack_minibatch(rows, dp=dp, dp_rank=dp_rank, token_budget=budget, multiple=multiple,
                                     count_multiple=count_multiple, pad_id=0, thd=thd)
    masked, _ = pack_minibatch(rows, dp=dp, dp_rank=dp_rank, token_budget=budget, multiple=multiple,
                               count_multiple=count_multiple, pad_id=0, thd=False)  # the block-diagonal mask
    per_rank, packed_length = pack_rows([r.forward_tokens for r in rows], dp=dp, token_budget=budget,
                                        multiple=multiple, count_multiple=count_multiple)
    packed_ids = [[i if i >= 0 else None for i in b] for b in per_rank[dp_rank]]

    store_logprobs(padded, "old_logp", padded_engine.policy_logprobs(padded, seq_length=seq_length))
    store_logprobs(packed, "old_logp", packed_engine.policy_logprobs(packed, seq_length=packed_length))
    store_logprobs(masked, "old_logp", packed_engine.policy_logprobs(masked, seq_length=packed_length))
    result = {"dp": dp, "dp_rank": dp_rank, "microbatches": len(packed), "packed_length": packed_length,
              "figures": figures, "rows_compared": 0, "max_logprob_diff": 0.0, "thd": thd,
              "mask_vs_thd_diff": max((float(((old_logprobs(m) - old_logprobs(p)).abs() * p["loss_mask"]).max())
                                       for m, p in zip(masked, packed)), default=0.0)}
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        logp_of = {}
        for ids, batch in zip(padded_ids, padded):
            for j, i in enumerate(ids):
                logp_of[i] = (old_logprobs(batch)[j], batch["loss_mask"][j])
        packed_here = set()
        for ids, batch in zip(packed_ids, packed):
            for j, i in enumerate(ids):
                if i is None:
                    continue
                packed_here.add(i)
                mask = batch["loss_mask"][j]
                width = mask.shape[0]
                ref, ref_mask = logp_of.get(i, (None, None)) if dp == 1 else (None, None)
                if ref is None:
                    continue
                assert torch.equal(ref_mask[:width], mask) and ref_mask[width:].sum() == 0
                diff = float(((old_logprobs(batch)[j] - ref[:width]).abs() * mask).max())
                result["max_logprob_diff"] = max(result["max_logprob_diff"], diff)
                result["rows_compared"] += 1

    loss_fn = make_grpo_loss(GRPOLossConfig.from_algorithm(cfg.algorithm, max_response_len=32))
    steps = []
    for _ in range(2):
        a = padded_engine.train_step(padded, loss_fn, seq_length=seq_length, report_names=("loss", "pg_loss", "ratio_min", "ratio_max"),
                                     forward_fn=logits_forward)
        b = packed_engine.train_step(packed, loss_fn, seq_length=packed_length, report_names=("loss", "pg_loss", "ratio_min", "ratio_max"),
                                     forward_fn=logits_forward)
        steps.append({"padded": a, "packed": b})
    result["steps"] = steps
    result["max_param_diff"] = max(float((p - q).abs().max()) for a, b in zip(padded_engine.chunks, packed_engine.chunks)
                                   for p, q in zip(unwrap(a).parameters(), unwrap(b).parameters()))
    return result


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
