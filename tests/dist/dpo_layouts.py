"""The DPO trainer's pieces at several layouts, in ONE torchrun job of 2 processes (Megatron's state is per process).

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/dpo_layouts.py --out OUT_DIR

At TP1 x DP2, TP2, PP2 and CP2 (tiny-cpu), and at DP2 and EP2 (tiny-cpu-moe), from the seeded init (layout
invariant): the reference pass over 32 synthetic pairs (``reference_sums``), three optimizer steps of the DPO
loss (sigmoid with label smoothing, plus the NLL term) and a held-out evaluation. Every rank writes
OUT/rank{R}.json; tests/test_dpo.py compares the layouts.
"""

from __future__ import annotations

import argparse

LAYOUTS = {"cp2": ("tiny-cpu", {"cp": 2}), "dp2": ("tiny-cpu", {}), "tp2": ("tiny-cpu", {"tp": 2}),
           "pp2": ("tiny-cpu", {"pp": 2}), "moe_dp2": ("tiny-cpu-moe", {}), "moe_ep2": ("tiny-cpu-moe", {"ep": 2})}
OVERRIDES = ["algorithm.global_batch_size=8", "parallel.micro_batch_size=2", "algorithm.dpo_beta=0.5",
             "algorithm.dpo_label_smoothing=0.1", "algorithm.dpo_sft_coef=0.3", "optimizer.lr=3e-3",
             "optimizer.lr_warmup_steps=0", "data.max_length=32"]
PAIRS = 32


def run_layout(model: str, sizes: dict) -> dict:

    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.algorithms.dpo import DPOLossConfig
    from megatron_rl.data.preferences import SequenceEncoder, synthetic_preference_records, tokenize_pairs
    from megatron_rl.data.tokenizer import CharTokenizer
    from dist_common import start_layout
    from megatron_rl.runtime.training import logits_forward
    from megatron_rl.trainers.common import job_engine
    from megatron_rl.trainers import dpo, pairs

    start_layout(**sizes, seed=1234)
    cfg = load_config(None, ["algorithm.name=dpo", f"model.name={model}", *OVERRIDES,
                             *(f"parallel.{key}={value}" for key, value in sizes.items())])
    shape = load_model_shape(model)
    engine = job_engine(cfg, shape)
    records = synthetic_preference_records("prefer_last_digit", split="train", num_pairs=PAIRS, seed=3)
    data = tokenize_pairs(records, SequenceEncoder(CharTokenizer()), max_length=32, truncation="truncate",
                          vocab_size=shape.vocab_size, name="fixed", response_starts=True)
    batcher = dpo.DPOPairBatcher(cfg, pad_id=0, max_length=32, multiple=engine.sequence_multiple)
    data = dpo.ReferencedPairs.of(data, dpo.reference_sums(engine, batcher, data, cfg))
    loss_fn = dpo.make_dpo_loss(DPOLossConfig.from_algorithm(cfg.algorithm))
    steps = []
    for step in (1, 2, 3):
        indices = pairs.pair_order(PAIRS, step=step, global_batch_size=8, seed=5)
        batches, length = batcher.micro_batches(data, indices, pad_to=1)
        steps.append(engine.train_step(batches, loss_fn, seq_length=length, report_names=dpo.REPORTS,
                                       forward_fn=logits_forward))
    held_out = pairs.evaluate(engine, batcher, data, cfg, loss_fn, forward_fn=logits_forward,
                              report_names=dpo.REPORTS)
    return {"reference": data.reference.tolist(), "steps": steps, "eval": held_out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from dist_common import write_rank_result

    write_rank_result(args.out, {name: run_layout(model, sizes) for name, (model, sizes) in LAYOUTS.items()})


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
