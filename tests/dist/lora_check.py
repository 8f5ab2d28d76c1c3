"""LoRA engines at several layouts, in ONE torchrun job of 2 processes (Megatron's state is per process).

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/lora_check.py --out OUT_DIR

At TP1 x DP2, TP2 and TP2 with sequence parallelism (tiny-cpu, rank-4 adapters on every target): the log-probs
of fixed tokens with the adapters on and off before training (B = 0: equal), three optimizer steps of the
pretrain loss, the log-probs after training (on, off, and with every adapter merged into its base weight
shard, after a fourth step), the optimizer's state size against the adapters' parameter count, and a checkpoint (saved after the
three steps) that a fresh engine resumes from for a fourth step equal to the original engine's; and at TP1
the adapters' gradients against the chain rule through the merged weight; and with modules_to_save (untied at TP2,
tied at TP1 x DP2) what trains and the KL reference (``modules_to_save_check``). Every rank
writes OUT/rank{R}.json; tests/test_lora.py compares the layouts and exports the checkpoints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYOUTS = {"dp2": {}, "tp2": {"tp": 2}, "tp2sp": {"tp": 2, "sequence_parallel": True},
           # tiny-cpu-moe (4 routed experts, top-2): adapters on every expert's fc1 and fc2 and on attention; at
           # TP2 with SP the experts are split over the expert-TP group (etp 2), at TP2 x EP2 with SP each rank
           # holds two whole experts (etp 1)
           "moe_dp2": {"model": "tiny-cpu-moe"},
           "moe_tp2sp": {"model": "tiny-cpu-moe", "tp": 2, "sequence_parallel": True},
           "moe_tp2ep2sp": {"model": "tiny-cpu-moe", "tp": 2, "ep": 2, "sequence_parallel": True},
           # grouped experts (Megatron's TEGroupedMLP, here on the torch grouped linears): one adapter per expert
           # inside each grouped linear; started from moe_tp2ep2sp's untrained checkpoint (the same keys), they
           # train as the sequential experts do
           "moe_grouped_dp2": {"model": "tiny-cpu-moe", "grouped": True},
           "moe_grouped_tp2ep2sp": {"model": "tiny-cpu-moe", "tp": 2, "ep": 2, "sequence_parallel": True,
                                    "grouped": True}}
OVERRIDES = ["algorithm.name=pretrain", "model.lora={rank: 4, alpha: 8}", "optimizer.lr=2e-2",
             "optimizer.lr_warmup_steps=0", "optimizer.clip_grad=1.0", "run.steps=4"]


def optimizer_state_numel(optimizer) -> int:
    """Elements of Adam's exp_avg and exp_avg_sq this rank holds (the chained optimizers of MoE runs included)."""
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            total += sum(v.numel() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq"))
    return total


def run_layout(name: str, sizes: dict, out: Path) -> dict:
    import torch
    from megatron.core import parallel_state

    from dist_common import progression_trainer
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.models.lora import adapters, adapters_disabled, merge_adapters
    from megatron_rl.runtime import checkpoint as ckpt
    from dist_common import start_layout
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.trainers.common import job_engine

    sizes = dict(sizes)
    model = sizes.pop("model", "tiny-cpu")
    grouped = sizes.pop("grouped", False)
    start_layout(**{k: v for k, v in sizes.items() if k != "sequence_parallel"}, seed=1234)
    lora = ["model.lora={rank: 4, alpha: 8, targets: [linear_qkv, linear_proj, experts.linear_fc1, experts.linear_fc2]}"
            ] if model != "tiny-cpu" else []
    cfg = load_config(None, [*OVERRIDES, *lora, f"model.name={model}", f"runtime.moe_grouped_gemm={str(grouped).lower()}",
                             *(f"parallel.{k}={str(v).lower()}" for k, v in sizes.items())])
    shape = load_model_shape(model)
    engine = job_engine(cfg, shape)
    fresh_a = None
    if grouped:  # the sequential experts' untrained model (weights and adapters), through the same checkpoint keys
        fresh_a = [a.A.detach().clone() for a in adapters(engine.chunks)]
        ckpt.load_checkpoint(out / "ckpt_base_moe_tp2ep2sp", chunks=engine.chunks, load_optimizer=False)
        # each grouped expert's adapter drew A from its global expert's seed, as its sequential twin did
        fresh_a = max(float((a.A - before).abs().max()) for a, before in zip(adapters(engine.chunks), fresh_a))
    tokens = torch.randint(1, shape.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))

    def logprobs() -> list:
        return sequence_logprobs(engine.chunks, tokens).tolist()

    result = {"trainable_fraction": engine.trainable_fraction, "fresh_a_vs_sequential": fresh_a}
    if name == "moe_tp2ep2sp":  # the base model for the PEFT export (B is zero before training)
        ckpt.save_checkpoint(out / f"ckpt_base_{name}", step=0, chunks=engine.chunks, optimizer=engine.optimizer,
                             scheduler=engine.scheduler)
    with adapters_disabled(engine.chunks):
        result["init_off"] = logprobs()
    result["init_on"] = logprobs()
    train_step = progression_trainer(engine, micro_batch_size=2)
    result["steps"] = [train_step(step) for step in (1, 2, 3)]
    result["on"] = logprobs()
    with adapters_disabled(engine.chunks):
        result["off"] = logprobs()
    chunk = engine.chunks[0]
    result["trainable_numel"] = sum(p.numel() for p in chunk.parameters() if p.requires_grad)
    result["adapter_numel"] = sum(p.numel() for a in adapters(engine.chunks) for p in a.parameters())
    result["total_numel"] = sum(p.numel() for p in chunk.parameters())
    result["optimizer_state_numel"] = optimizer_state_numel(engine.optimizer)
    result["dp"] = parallel_state.get_data_parallel_world_size()
    result["edp"] = parallel_state.get_expert_data_parallel_world_size()
    result["expert_adapter_numel"] = sum(p.numel() for a in adapters(engine.chunks) if a.expert for p in a.parameters())
    folder = out / f"ckpt_{name}"
    ckpt.save_checkpoint(folder, step=3, chunks=engine.chunks, optimizer=engine.optimizer, scheduler=engine.scheduler)
    result["step4"] = train_step(4)
    fresh = job_engine(cfg, shape)
    ckpt.load_checkpoint(folder, chunks=fresh.chunks, optimizer=fresh.optimizer, scheduler=fresh.scheduler)
    result["resumed_step4"] = progression_trainer(fresh, micro_batch_size=2)(4)
    result["on4"] = logprobs()
    merge_adapters(chunk)  # the adapters merged into each base shard (W + B A alpha / r), run without them
    with adapters_disabled(engine.chunks):
        result["merged"] = logprobs()
    return result


def gradient_check() -> dict:
    """At TP1: the adapters' autograd gradients against the chain rule through the merged weight W' = W + s B A
    (dL/dB = s dL/dW' A^T, dL/dA = s B^T dL/dW'), on a model with random B (largest differences and sizes)."""
    import torch

    from megatron_rl.spec.config.schema import LoraConfig
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.models.builder import ModelOptions, build_gpt_model
    from megatron_rl.models.lora import adapters, adapters_disabled
    from dist_common import start_layout

    start_layout(seed=1234)
    model = build_gpt_model(load_model_shape("tiny-cpu"), ModelOptions(lora=LoraConfig(rank=4, alpha=8))).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for adapter in adapters([model]):
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=generator) * 0.1)
    tokens, labels = (torch.randint(1, 128, (2, 16), generator=generator) for _ in range(2))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    model(tokens, positions, None, labels=labels).sum().backward()
    linears = [m for m in model.modules() if hasattr(m, "lora") and hasattr(m, "weight")]
    autograd = [(m.lora.A.grad.clone(), m.lora.B.grad.clone()) for m in linears]
    with torch.no_grad():
        for m in linears:
            m.weight += m.lora.delta_weight()
            m.weight.requires_grad_(True)
    with adapters_disabled([model]):
        model(tokens, positions, None, labels=labels).sum().backward()
    diff = size = 0.0
    for m, (grad_a, grad_b) in zip(linears, autograd):
        expect_b = m.lora.scale * m.weight.grad @ m.lora.A.T
        expect_a = m.lora.scale * m.lora.B.T @ m.weight.grad
        diff = max(diff, float((grad_b - expect_b).abs().max()), float((grad_a - expect_a).abs().max()))
        size = max(size, float(expect_b.abs().max()), float(expect_a.abs().max()))
    return {"max_diff": diff, "max_grad": size, "linears": len(linears)}


SAVED = {"tp2": ({"tp": 2}, False), "tied": ({}, True)}


def modules_to_save_check(name: str, sizes: dict, tied: bool, out: Path) -> dict:
    """model.lora.modules_to_save = all three (untied at TP2: the vocab-sharded embedding and output layer; tied
    at TP1 x DP2: one shared weight): what trains, the optimizer state, and the KL reference (adapters off, the
    modules' kept weights swapped in) against the untrained base, before and after three steps and after a
    resume from the checkpoint and the reference folder."""
    import dataclasses

    import torch
    from megatron.core import parallel_state

    from dist_common import progression_trainer
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.models.lora import adapters, adapters_disabled, saved_parameters
    from megatron_rl.runtime import checkpoint as ckpt
    from dist_common import start_layout
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.trainers.common import job_engine

    start_layout(**sizes, seed=1234)
    cfg = load_config(None, [*(o for o in OVERRIDES if not o.startswith("model.lora")),
                             "model.lora={rank: 4, alpha: 8, modules_to_save: [embedding, output_layer, final_layernorm]}",
                             *(f"parallel.{k}={v}" for k, v in sizes.items())])
    shape = dataclasses.replace(load_model_shape("tiny-cpu"), tie_embeddings=tied)
    engine = job_engine(cfg, shape)
    tokens = torch.randint(1, shape.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))

    def logprobs(chunks) -> list:
        return sequence_logprobs(chunks, tokens).tolist()

    chunk = ckpt.unwrap(engine.chunks[0])
    saved = saved_parameters(engine.chunks)
    result = {"trainable_fraction": engine.trainable_fraction, "base": logprobs(engine.chunks),
              "saved_names": sorted(n for n, p in chunk.named_parameters() if id(p) in saved),
              "trainable_numel": sum(p.numel() for p in chunk.parameters() if p.requires_grad),
              "adapter_numel": sum(p.numel() for a in adapters(engine.chunks) for p in a.parameters()),
              "saved_numel": sum(p.numel() for p in saved.values()),
              "total_numel": sum(p.numel() for p in chunk.parameters()), "dp": parallel_state.get_data_parallel_world_size()}
    before = [p.detach().clone() for p in saved.values()]
    reference = engine.reference_model(out / f"reference_{name}")
    with adapters_disabled(reference):
        result["ref_step0"] = logprobs(reference)
    train_step = progression_trainer(engine, micro_batch_size=2)
    result["steps"] = [train_step(step) for step in (1, 2, 3)]
    result["saved_change"] = max(float((p.detach() - b).abs().max()) for p, b in zip(saved.values(), before))
    result["policy"] = logprobs(engine.chunks)
    with adapters_disabled(reference):
        result["ref_trained"] = logprobs(reference)
    for adapter in adapters(engine.chunks):  # adapters off, the trained modules kept: not the base
        adapter.enabled = False
    result["trained_modules_only"] = logprobs(engine.chunks)
    for adapter in adapters(engine.chunks):
        adapter.enabled = True
    result["policy_after_reference"] = logprobs(engine.chunks)
    result["optimizer_state_numel"] = optimizer_state_numel(engine.optimizer)
    folder = out / f"ckpt_saved_{name}"
    ckpt.save_checkpoint(folder, step=3, chunks=engine.chunks, optimizer=engine.optimizer, scheduler=engine.scheduler)
    fresh = job_engine(cfg, shape)
    ckpt.load_checkpoint(folder, chunks=fresh.chunks, optimizer=fresh.optimizer, scheduler=fresh.scheduler)
    resumed_reference = fresh.reference_model(out / f"reference_{name}")
    result["resumed_policy"] = logprobs(fresh.chunks)
    with adapters_disabled(resumed_reference):
        result["resumed_ref"] = logprobs(resumed_reference)
    return result


def main() -> None:
    import torch

    from dist_common import write_rank_result

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    results = {name: run_layout(name, sizes, out) for name, sizes in LAYOUTS.items()}
    saved = {name: modules_to_save_check(name, sizes, tied, out) for name, (sizes, tied) in SAVED.items()}
    write_rank_result(out, {**results, "gradient_check": gradient_check(), "modules_to_save": saved})
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
