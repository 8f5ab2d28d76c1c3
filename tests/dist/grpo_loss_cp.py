"""The GRPO trainer's Megatron loss (``make_grpo_loss``) on context-parallel parts of sequences equals the pure
loss (``grpo_loss``) of the whole sequences; every rank writes ``OUT/rank{R}.json`` for tests/test_grpo_layouts.py.

Run: ``.venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/grpo_loss_cp.py --out DIR``

Two CP ranks hold chunks (0, 3) and (1, 2) of every row (Megatron's load-balanced order, ``slice_batch_for_cp``),
with responses that cross chunk boundaries. As Megatron's schedule does, the loss sums and the denominators are
summed over the CP group (the data-parallel-with-CP reduction) and the gradients w.r.t. the logits too; for
each aggregation mode (and GSPO's sequence ratio, whose per-sequence sums cross the ranks) the loss and the
gradient must equal the pure whole-batch loss and its gradient.
"""

from __future__ import annotations

import argparse

import torch

BATCH, SEQ, VOCAB = 4, 16, 32
SPANS = ((2, 14), (5, 7), (9, 16), (0, 0))  # label positions of each row's response: across chunks, short, none


def whole_batch() -> dict:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.zeros(BATCH, SEQ)
    for row, (start, end) in enumerate(SPANS):
        mask[row, start:end] = 1.0
    true_logp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return {"logits": logits, "tokens": labels, "labels": labels, "loss_mask": mask,
            "position_ids": torch.arange(SEQ).expand(BATCH, -1).contiguous(),
            "behav_logp": true_logp + 0.3 * torch.randn(BATCH, SEQ, generator=gen),
            "ref_logp": true_logp + 0.2 * torch.randn(BATCH, SEQ, generator=gen),
            "advantages": torch.tensor([1.0, -0.5, 2.0, 0.7])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_rl.algorithms.policy_loss import GRPOLossConfig, grpo_loss
    from megatron_rl.models.cp_attention import slice_batch_for_cp
    from megatron_rl.rl.loss import make_grpo_loss
    from megatron_rl.rollout.batch import RolloutBatch
    from megatron_rl.runtime.distributed import initialize, job_dims
    from dist_common import write_rank_result

    initialize(job_dims(cp=2), seed=0)
    group = ps.get_context_parallel_group()
    result = {"cp_rank": ps.get_context_parallel_rank(), "modes": {}}
    cases = [(mode, "token") for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")]
    cases.append(("seq-mean-token-mean", "sequence"))  # GSPO: each sequence's ratio spans both ranks' chunks
    for mode, ratio in cases:
        config = GRPOLossConfig(eps_low=0.2, eps_high=0.28, kl_coef=0.1, kl_kind="k3", loss_agg_mode=mode,
                                max_response_len=8, importance_ratio=ratio)
        full = whole_batch()
        logits = full.pop("logits").requires_grad_(True)
        # the pure loss of the whole rows
        logp = torch.log_softmax(logits, -1).gather(-1, full["labels"].unsqueeze(-1)).squeeze(-1)
        expected, _ = grpo_loss(logp, full["behav_logp"], full["advantages"], full["loss_mask"], config=config,
                                ref_logp=full["ref_logp"])
        (expected_grad,) = torch.autograd.grad(expected, logits)
        # this CP rank's parts, through the trainer's Megatron loss function
        leaf = logits.detach().clone().requires_grad_(True)
        local = slice_batch_for_cp(RolloutBatch(**full, row_ids=torch.arange(BATCH)))  # the typed batch's own slice
        assert isinstance(local, RolloutBatch) and local.tokens.shape[1] == SEQ // 2
        local_logits = slice_batch_for_cp({"tokens": full["tokens"], "logits": leaf})["logits"]
        loss_sum, denominator, reports = make_grpo_loss(config)(local_logits, local)
        (grad,) = torch.autograd.grad(loss_sum, leaf)
        totals = torch.stack([loss_sum.detach().double(), denominator.double(),
                              reports["loss"][0].double(), reports["loss"][1].double()])
        torch.distributed.all_reduce(totals, group=group)
        torch.distributed.all_reduce(grad, group=group)
        grad = grad / totals[1]
        result["modes"][mode if ratio == "token" else f"{mode}, {ratio} ratio"] = {
            "expected": float(expected), "got": float(totals[0] / totals[1]),
            "reported": float(totals[2] / totals[3]), "denominator": float(totals[1]),
            "local_denominator": float(denominator), "max_grad_diff": float((grad - expected_grad).abs().max()),
            "grad_scale": float(expected_grad.abs().max())}
    write_rank_result(args.out, result)


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
