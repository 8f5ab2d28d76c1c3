"""LoRA on tiny-cpu-deepseek-v3 (MLA attention with q-LoRA, a dense first layer, 8 routed experts + 1 shared
expert), in ONE torchrun job of 2 processes: adapters on every MLA projection (the TP-replicated q and kv down
projections, the column-parallel up projections, linear_proj), the dense layer's fc1/fc2, every routed expert's
fc1/fc2 and the shared expert's fc1/fc2, at TP1 x DP2 and TP2 x EP2 with SP: three optimizer steps,
then the log-probs of fixed tokens with the adapters on, off and merged into their base weights. The TP2 x EP2
layout also saves its checkpoint before training (OUT/ckpt_base: zero B, so its merged export is the base model)
and after (OUT/ckpt), for the Hugging Face and PEFT exports.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/lora_deepseek_check.py --out OUT_DIR

Every rank writes OUT/rank{R}.json; tests/test_lora.py compares the layouts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYOUTS = {"dp2": {}, "tp2ep2sp": {"tp": 2, "ep": 2, "sequence_parallel": True}}
"""TP2 with SP splitting experts over expert-TP is tiny-cpu-moe's case (tests/dist/lora_check.py)."""
TARGETS = ["linear_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
           "linear_fc1", "linear_fc2", "experts.linear_fc1", "experts.linear_fc2", "shared_experts.linear_fc1",
           "shared_experts.linear_fc2"]
OVERRIDES = ["algorithm.name=pretrain", f"model.lora={{rank: 4, alpha: 8, targets: [{', '.join(TARGETS)}]}}",
             "model.name=tiny-cpu-deepseek-v3", "optimizer.lr=2e-2", "optimizer.lr_warmup_steps=0",
             "optimizer.clip_grad=1.0", "run.steps=4"]


def run_layout(sizes: dict, out: Path, *, save: bool) -> dict:
    import torch

    from dist_common import progression_trainer
    from megatron_rl.models.lora import adapters, adapters_disabled, merge_adapters
    from megatron_rl.runtime import checkpoint as ckpt
    from dist_common import start_layout
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.trainers.common import job_engine
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape

    start_layout(**{k: v for k, v in sizes.items() if k != "sequence_parallel"}, seed=1234)
    cfg = load_config(None, [*OVERRIDES, *(f"parallel.{k}={str(v).lower()}" for k, v in sizes.items())])
    shape = load_model_shape("tiny-cpu-deepseek-v3")
    engine = job_engine(cfg, shape)
    tokens = torch.randint(1, shape.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))

    def logprobs() -> list:
        return sequence_logprobs(engine.chunks, tokens).tolist()

    chunk = engine.chunks[0]
    adapted = sorted({name.split(".lora.")[0].split(".", 3)[-1] for name, _ in chunk.named_parameters()
                      if ".lora." in name})
    train_step = progression_trainer(engine, micro_batch_size=2)

    def saved(folder: str, step: int) -> None:
        if save:
            ckpt.save_checkpoint(out / folder, step=step, chunks=engine.chunks, optimizer=engine.optimizer,
                                 scheduler=engine.scheduler)

    saved("ckpt_base", 0)
    result = {"trainable_fraction": engine.trainable_fraction, "adapted": adapted,
              "shared_adapters": sum(1 for name, _ in chunk.named_parameters()
                                     if ".shared_experts." in name and ".lora." in name),
              "steps": [train_step(step) for step in (1, 2, 3)], "on": logprobs()}
    with adapters_disabled(engine.chunks):
        result["off"] = logprobs()
    saved("ckpt", 3)
    result["kinds"] = sorted({a.parallel for a in adapters(engine.chunks)})
    merge_adapters(chunk)
    with adapters_disabled(engine.chunks):
        result["merged"] = logprobs()
    result["expert_adapters"] = sum(1 for a in adapters(engine.chunks) if a.expert)
    return result


def main() -> None:
    import torch

    from dist_common import write_rank_result

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    write_rank_result(out, {name: run_layout(sizes, out, save=name == "tp2ep2sp") for name, sizes in LAYOUTS.items()})
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
