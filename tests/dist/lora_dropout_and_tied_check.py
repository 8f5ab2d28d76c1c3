"""LoRA dropout and tied embeddings under pipelining, in ONE torchrun job of 2 processes (tiny-cpu, rank-4 adapters).

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/lora_dropout_and_tied_check.py --out OUT

``dropout_check`` at TP1 x DP2 and TP2 (model.lora.dropout=0.25); ``tied_pipeline_check`` at PP1 x DP2 and PP2
(tied embeddings, modules_to_save [output_layer]), which also saves checkpoints for the exports. Every rank writes
OUT/rank{R}.json; tests/test_lora.py makes the assertions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_check import OVERRIDES  # noqa: E402


def use_layout(sizes: dict) -> None:

    from dist_common import start_layout

    start_layout(**{k: v for k, v in sizes.items() if k != "sequence_parallel"}, seed=1234)


def digest(tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


DROPOUT = {"dp2": {}, "tp2": {"tp": 2}}


def dropout_check(sizes: dict) -> dict:
    """model.lora.dropout=0.25: the log-probs in training mode with B = 0 against the base (adapters off), and with
    random B in eval mode (twice, and against every adapter merged into its base weight) and training mode (twice);
    one column (fc1) and one row (fc2) linear of layer 1 called on a fixed input: its eval output, one training
    draw, and the mean of 400 draws; then three training steps (the copies of each replicated adapter matrix
    hashed on every rank, to compare over TP); at TP1 the same step with full recompute (the masks replayed)."""
    import torch

    from dist_common import progression_trainer
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron.core import tensor_parallel
    from megatron_rl.models.lora import adapters, adapters_disabled
    from megatron_rl.runtime import checkpoint as ckpt
    from megatron_rl.trainers.common import job_engine

    use_layout(sizes)
    overrides = [*(o for o in OVERRIDES if not o.startswith("model.lora")), "model.lora={rank: 4, alpha: 8, dropout: 0.25}",
                 "parallel.micro_batch_size=2", *(f"parallel.{k}={v}" for k, v in sizes.items())]
    shape = load_model_shape("tiny-cpu")
    engine = job_engine(load_config(None, overrides), shape)
    tokens = torch.randint(1, shape.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))
    chunk = ckpt.unwrap(engine.chunks[0])

    positions = torch.arange(16).unsqueeze(0).expand(4, -1)

    def logprobs(training: bool) -> list:  # the model called directly (sequence_logprobs runs in eval mode)
        chunk.train(training)
        with torch.no_grad():
            return (-chunk(tokens[:, :-1], positions, None, labels=tokens[:, 1:])).tolist()

    result = {"zero_b_train": logprobs(True)}
    with adapters_disabled(engine.chunks):
        result["base_train"] = logprobs(True)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for adapter in adapters(engine.chunks):  # the same draws on every rank: replicated Bs stay equal over TP
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=generator) * 0.3)
    result.update(eval1=logprobs(False), eval2=logprobs(False), train1=logprobs(True), train2=logprobs(True))
    linears = [m for m in chunk.modules() if hasattr(m, "lora") and hasattr(m, "weight")]
    weights = [m.weight.detach().clone() for m in linears]
    with torch.no_grad():
        for m in linears:
            m.weight += m.lora.delta_weight()
    with adapters_disabled(engine.chunks):
        result["merged_eval"] = logprobs(False)
    with torch.no_grad():
        for m, weight in zip(linears, weights):
            m.weight.copy_(weight)
    result["linear_draws"] = {}
    mlp = chunk.decoder.layers[0].mlp
    for name, linear in (("column", mlp.linear_fc1), ("row", mlp.linear_fc2)):
        x = torch.randn(8, 2, linear.weight.shape[1], generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            chunk.eval()
            expected = linear(x)[0]
            chunk.train()
            draws = torch.stack([linear(x)[0] for _ in range(400)])
        result["linear_draws"][name] = {"single": float((draws[0] - expected).abs().max()),
                                        "mean": float((draws.mean(0) - expected).abs().max()),
                                        "scale": float(expected.abs().max())}
    chunk.train()
    train_step = progression_trainer(engine, micro_batch_size=2)
    if not sizes:  # one step with and without full recompute from the same weights and RNG states
        recomputed = job_engine(load_config(None, [*overrides, "parallel.recompute=full"]), shape)
        for ours, theirs in zip(adapters(recomputed.chunks), adapters(engine.chunks)):
            with torch.no_grad():
                ours.B.copy_(theirs.B)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        states, cpu = tracker.get_states(), torch.get_rng_state()
        result["recompute_step"] = progression_trainer(recomputed, micro_batch_size=2)(1)
        tracker.set_states(states)
        torch.set_rng_state(cpu)
    result["steps"] = [train_step(step) for step in (1, 2, 3)]
    result["replicated_digests"] = {
        name: digest(m.lora.A if m.lora.parallel == "column" else m.lora.B)
        for name, m in chunk.named_modules() if hasattr(m, "lora") and hasattr(m, "weight")}
    return result


TIED = {"pp1": {}, "pp2": {"pp": 2}}


def tied_pipeline_check(name: str, sizes: dict, out: Path, pp1_weight=None) -> dict:
    """Tied embeddings with modules_to_save [output_layer] (the one shared weight trains; under pipelining its
    first-stage original and its last-stage copy, whose grads Megatron all-reduces): the loss and grad norm of three
    steps, the log-probs, the KL reference against the base, the shared weight on this rank (hashed, and its largest
    difference from ``pp1_weight``, the PP1 run's), and checkpoints before (the base) and after training."""
    import dataclasses

    import torch

    from dist_common import progression_trainer
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.models.lora import adapters_disabled
    from megatron_rl.runtime import checkpoint as ckpt
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.trainers.common import job_engine

    use_layout(sizes)
    cfg = load_config(None, [*(o for o in OVERRIDES if not o.startswith("model.lora")),
                             "model.lora={rank: 4, alpha: 8, modules_to_save: [output_layer]}",
                             "parallel.micro_batch_size=2", *(f"parallel.{k}={v}" for k, v in sizes.items())])
    shape = dataclasses.replace(load_model_shape("tiny-cpu"), tie_embeddings=True)
    engine = job_engine(cfg, shape)
    tokens = torch.randint(1, shape.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))
    shared = ckpt.unwrap(engine.chunks[0]).shared_embedding_or_output_weight()
    initial = shared.detach().clone()
    result = {"trainable_fraction": engine.trainable_fraction, "base": sequence_logprobs(engine.chunks, tokens).tolist()}
    ckpt.save_checkpoint(out / f"ckpt_tied_{name}_base", step=0, chunks=engine.chunks)
    reference = engine.reference_model(out / f"reference_tied_{name}")
    train_step = progression_trainer(engine, micro_batch_size=2)
    result["steps"] = [train_step(step) for step in (1, 2, 3)]
    result["policy"] = sequence_logprobs(engine.chunks, tokens).tolist()
    with adapters_disabled(reference):
        result["ref_trained"] = sequence_logprobs(reference, tokens).tolist()
    result["shared_digest"] = digest(shared)
    result["shared_change"] = float((shared.detach() - initial).abs().max())
    if pp1_weight is not None:
        result["shared_diff_to_pp1"] = float((shared.detach() - pp1_weight).abs().max())
    ckpt.save_checkpoint(out / f"ckpt_tied_{name}", step=3, chunks=engine.chunks, optimizer=engine.optimizer,
                         scheduler=engine.scheduler)
    return result, shared.detach().clone()


def main() -> None:
    import torch

    from dist_common import write_rank_result

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    dropout = {name: dropout_check(sizes) for name, sizes in DROPOUT.items()}
    tied, pp1_weight = {}, None
    for name, sizes in TIED.items():
        tied[name], weight = tied_pipeline_check(name, sizes, out, pp1_weight)
        pp1_weight = pp1_weight if pp1_weight is not None else weight
    write_rank_result(out, {"dropout": dropout, "tied_pipeline": tied})
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
