"""Tokens/s of our colocated generation against Hugging Face ``transformers`` ``generate``, same weights.

Run: ``.venv/bin/python bench/generation.py`` (options: ``--cases tiny,small,long --batch 64 --repeats 7
--threads 1 --train-steps 20``). Single process, CPU, fp32, greedy, no network (HF_HUB_OFFLINE=1).

Cases, each with its own weights and prompts (``--batch`` prompts of 8 tokens):

* ``tiny``: the ``tiny-cpu`` preset (hidden 64, 2 layers), 32 new tokens per row, no stop token.
* ``small``: the small bench model of bench/grpo_step.py (hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 512),
  32 new tokens per row, no stop token.
* ``long``: the small model, up to 256 new tokens, with a stop token: the one token whose first greedy
  occurrence is spread over the most different positions, so rows end at mixed lengths (the lengths are
  reported). ``transformers`` keeps finished rows in its batch (padded) until the last one ends; we drop them
  (compaction, megatron_rl/generation/decoding.py).

Both sides decode the same prompts with the same weights: the model is built by our ``build_engine`` (Megatron
DDP chunks, as in training), trained a few steps on the pretrain task so that its outputs are not near-uniform,
and copied into a ``LlamaForCausalLM`` (``gpu_check.megatron_to_hf``). The bench first asserts that both produce
the same tokens, then times the contenders alternately (ours, theirs, ...), ``--repeats`` rounds:

* ``ours``: ``generate`` as the trainers call it;
* ``ours_static``: ``share_prefill=False, compact=False`` (every row prefilled and fed to the end);
* ``ours_modules``: ``fast_decode=False`` (decode steps through the ``GPTModel`` modules instead of the lean step
  of megatron_rl/generation/lean_decode.py: what that path buys);
* ``transformers``: ``generate`` with the KV cache, greedy.

Both run in one process on the same number of torch threads (default 1: both sides are bound by per-op Python
overhead at these sizes, and one thread avoids OpenMP spin-waits on a shared 2-core machine), under the same
process-wide CPU patches of ``megatron_rl.runtime.cpu_compat``. Each case reports medians and minima, and the
speedup with its spread: the median of the per-round ratios and their minimum and maximum. The last line is
one JSON object; ``speedup`` = transformers seconds / our seconds (medians, first case), ``speedups`` per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import hf_generate, megatron_to_hf  # noqa: E402  (shared with the GPU check)
from grpo_step import SMALL_SHAPE_YAML  # noqa: E402  (the same small model)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_rl.spec.ports import free_port  # noqa: E402

PROMPT_LEN = 8


@dataclass(frozen=True)
class Case:
    model: str
    """tiny or small."""
    new_tokens: int
    stops: bool
    """Stop at a chosen token (mixed response lengths) instead of generating exactly new_tokens."""


CASES = {"tiny": Case("tiny", 32, False), "small": Case("small", 32, False), "long": Case("small", 256, True)}


def small_shape_file(folder: Path) -> Path:
    """bench/grpo_step.py's small model, with room for 8 + 256 positions."""
    import yaml

    spec = yaml.safe_load(SMALL_SHAPE_YAML)
    spec.update(max_position_embeddings=512, seq_length=512)
    path = folder / "small-cpu-bench.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def trained_engine(model: str, train_steps: int):
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.runtime.training import build_engine
    from megatron_rl.trainers.pretrain import collate_lm, lm_loss, progression_batch

    cfg = load_config(overrides=[f"model.name={model}", "algorithm.name=pretrain", "algorithm.global_batch_size=16",
                                 "optimizer.lr=0.01", "parallel.micro_batch_size=16", "run.seed=3"])
    shape = load_model_shape(model)
    engine = build_engine(cfg, shape, total_steps=max(train_steps, 1))
    for step in range(1, train_steps + 1):
        rows = progression_batch(seed=3, step=step, batch_size=16, seq_length=32, vocab_size=shape.vocab_size)
        engine.train_step([collate_lm(rows)], lm_loss, seq_length=32, report_names=("loss",))
    return engine, shape


def spread_stop_token(rows: list[list[int]]) -> int:
    """The token whose first occurrence in ``rows`` falls on the most different positions (then the smallest)."""
    firsts: dict[int, set[int]] = {}
    for row in rows:
        seen = set()
        for i, token in enumerate(row):
            if token not in seen:
                seen.add(token)
                firsts.setdefault(token, set()).add(i)
    return min(firsts, key=lambda token: (-len(firsts[token]), token))


def until_stop(row: list[int], eos_id: int | None) -> list[int]:
    return row[:row.index(eos_id) + 1] if eos_id is not None and eos_id in row else row


def run_case(name: str, case: Case, engine, shape, args) -> dict:
    from megatron_rl.generation import generate
    from megatron_rl.models import unwrap

    hf = megatron_to_hf(unwrap(engine.chunks[0]), shape, dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    prompt_tensor = torch.randint(3, shape.vocab_size, (args.batch, PROMPT_LEN), generator=gen)
    prompts = prompt_tensor.tolist()

    def ours_with(eos_id, **options):
        return generate(engine.chunks, prompts, vocab_size=shape.vocab_size, max_new_tokens=case.new_tokens,
                        temperature=0.0, eos_id=eos_id, **options)

    eos_id = spread_stop_token(ours_with(None).tokens) if case.stops else None
    contenders = {
        "ours": lambda: ours_with(eos_id).tokens,
        "ours_static": lambda: ours_with(eos_id, share_prefill=False, compact=False).tokens,
        "ours_modules": lambda: ours_with(eos_id, fast_decode=False).tokens,
        "transformers": lambda: [until_stop(row, eos_id) for row in hf_generate(hf, prompt_tensor, case.new_tokens,
                                                                                 eos_id).tolist()],
    }
    reference = contenders["ours"]()
    for other, fn in contenders.items():
        tokens = fn()
        differing = [b for b in range(args.batch) if tokens[b] != reference[b]]
        assert not differing, (f"{name}: {other} rows {differing[:8]} differ from ours: {tokens[differing[0]]} vs "
                               f"{reference[differing[0]]}")
    lengths = sorted(len(row) for row in reference)
    info = ours_with(eos_id)
    times = {contender: [] for contender in contenders}
    for _ in range(args.repeats):
        for contender, fn in contenders.items():
            started = time.perf_counter()
            fn()
            times[contender].append(time.perf_counter() - started)
    medians = {contender: statistics.median(values) for contender, values in times.items()}
    ratios = sorted(t / o for t, o in zip(times["transformers"], times["ours"]))
    tokens = sum(lengths)
    return {
        "model": case.model, "batch": args.batch, "prompt_len": PROMPT_LEN, "max_new_tokens": case.new_tokens,
        "stop_token": eos_id, "response_lengths": {"min": lengths[0], "median": statistics.median(lengths),
                                                   "max": lengths[-1], "tokens": tokens},
        "compactions": info.compactions, "decode_path": info.decode_path,
        **{f"{contender}_s_median": medians[contender] for contender in contenders},
        **{f"{contender}_s_all": times[contender] for contender in contenders},
        "ours_tokens_per_s": tokens / medians["ours"], "transformers_tokens_per_s": tokens / medians["transformers"],
        "speedup": medians["transformers"] / medians["ours"],
        "speedup_per_round": {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]},
        "lean_decode_gain": medians["ours_modules"] / medians["ours"],
        "compaction_gain": medians["ours_static"] / medians["ours"],
        "tokens_equal": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="tiny,small,long", help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-steps", type=int, default=20)
    args = parser.parse_args()
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not names or any(c not in CASES for c in names):
        parser.error(f"--cases takes a comma list of {', '.join(CASES)}")

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(args.threads)
    import transformers

    from megatron_rl.runtime.distributed import initialize, job_dims, shutdown

    initialize(job_dims(), seed=3)
    results = {}
    with tempfile.TemporaryDirectory(prefix="generation_bench_") as tmp:
        models = {"tiny": "tiny-cpu", "small": str(small_shape_file(Path(tmp)))}
        engines = {}
        for name in names:
            model = CASES[name].model
            if model not in engines:
                engines[model] = trained_engine(models[model], args.train_steps)
            results[name] = run_case(name, CASES[name], *engines[model], args)
    shutdown()

    print(f"greedy, fp32, {args.threads} torch threads, {args.repeats} rounds, batch {args.batch}, prompt "
          f"{PROMPT_LEN}; medians (s)")
    print(f"{'case':7}{'ours':>9}{'static':>9}{'modules':>9}{'HF':>9}   speedup (rounds: min..max)   lengths")
    for name, r in results.items():
        spread = r["speedup_per_round"]
        lengths = r["response_lengths"]
        print(f"{name:7}{r['ours_s_median']:9.4f}{r['ours_static_s_median']:9.4f}{r['ours_modules_s_median']:9.4f}"
              f"{r['transformers_s_median']:9.4f}   {r['speedup']:.2f} ({spread['min']:.2f}..{spread['max']:.2f})"
              f"{'':14}{lengths['min']}..{lengths['max']}")
    print(json.dumps({"cases": results, "speedup": results[names[0]]["speedup"],
                      "speedups": {name: r["speedup"] for name, r in results.items()}, "threads": args.threads,
                      "repeats": args.repeats, "dtype": "fp32", "decoding": "greedy",
                      "transformers_version": transformers.__version__, "torch_version": torch.__version__}))


if __name__ == "__main__":
    main()
