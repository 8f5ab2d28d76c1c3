"""Tokens/s of our colocated generation against Hugging Face ``transformers`` ``generate``, same weights.

Run: ``.venv/bin/python bench/generation.py`` (options: ``--cases tiny,small,long --batch 64 --repeats 7
--threads 1 --train-steps 20``). Single process, CPU, fp32, greedy, no network (HF_HUB_OFFLINE=1).

Cases, each with its own weights and prompts (``--batch`` prompts of 8 tokens):

* ``tiny``: the ``tiny-cpu`` preset (hidden 64, 2 layers), 32 new tokens per row, no stop token.
* ``small``: the small bench model of bench/grpo_step.py (hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 512),
  32 new tokens per row, no stop token.
* ``long``: the small model, up to 256 new tokens, with a stop token: the one token whose first greedy
  occurrence is spread over the most different positions, so rows end at mixed lengths (the lengths are
  reported). ``transformers`` keeps finished rows in its batch (padded) until the last one ends; we drop them.
* ``longtail`` (reasoning RL's shape): the small model, ``--longtail-prompts`` prompts of 8-24 tokens, each
  ``--group`` times (GRPO groups), sampled at temperature 1 up to 256 new tokens. The stop tokens are the model's
  most frequent sampled tokens, taken until the mean first stop comes at ``LONGTAIL_MEAN`` (48) or sooner: a
  roughly constant per-step stop chance, so the lengths are about geometric with mean at most 48, cut at 256
  (the mean, median, p90 and maximum are reported). ``transformers`` is forced (a logits processor) to emit our tokens, so both sides
  decode the same rows to the same lengths. It also reports the KV memory: ``kv_allocated_over_held``, at the
  moment the most KV memory is assigned to rows, that memory over the K/V the rows hold then (a prompt shared by
  a group counted once on both sides): the paged engine's blocks (``--block-tokens``, default 8: about a sixth of
  the mean response here, as 256-token blocks are of reasoning RL's 1-5k-token responses on GPUs), and, for
  comparison, what the static ``[rows, longest prompt + 256]`` cache the engine replaced would hold against the
  most it ever holds (arithmetic: that engine is deleted).

Both sides decode the same prompts with the same weights: the model is built by our ``build_engine`` (Megatron
DDP chunks, as in training), trained a few steps on the pretrain task so that its outputs are not near-uniform,
and copied into a ``LlamaForCausalLM`` (``hf_reference.megatron_to_hf``). The bench first asserts that both produce
the same tokens, then times the contenders alternately (ours, theirs, ...), ``--repeats`` rounds:

* ``ours``: ``generate`` as the trainers call it (the paged engine, megatron_rl/generation/engine.py);
* ``transformers``: ``generate`` with the KV cache.

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
from hf_reference import hf_generate, megatron_to_hf  # noqa: E402  (shared with the GPU check)
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


CASES = {"tiny": Case("tiny", 32, False), "small": Case("small", 32, False), "long": Case("small", 256, True),
         "longtail": Case("small", 256, True)}
LONGTAIL_MEAN = 48
"""Target mean response length of the longtail case (its maximum is 256)."""


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
    from megatron_rl.trainers.common import job_engine
    from megatron_rl.algorithms.lm_loss import lm_loss
    from megatron_rl.data.batches import collate_lm, progression_batch

    cfg = load_config(overrides=[f"model.name={model}", "algorithm.name=pretrain", "algorithm.global_batch_size=16",
                                 "optimizer.lr=0.01", "parallel.micro_batch_size=16", "run.seed=3"])
    shape = load_model_shape(model)
    engine = job_engine(cfg, shape, total_steps=max(train_steps, 1))
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
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.models import unwrap

    hf = megatron_to_hf(unwrap(engine.chunks[0]), shape, dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    prompt_tensor = torch.randint(3, shape.vocab_size, (args.batch, PROMPT_LEN), generator=gen)
    prompts = prompt_tensor.tolist()

    def ours_with(eos_id):
        config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=case.new_tokens, temperature=0.0,
                              eos_id=eos_id, kv_block_tokens=args.block_tokens)
        return generate(engine.chunks, prompts, config)

    eos_id = spread_stop_token(ours_with(None).tokens) if case.stops else None
    contenders = {
        "ours": lambda: ours_with(eos_id).tokens,
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
        "decode_attention": info.decode_attention,
        **{f"{contender}_s_median": medians[contender] for contender in contenders},
        **{f"{contender}_s_all": times[contender] for contender in contenders},
        "ours_tokens_per_s": tokens / medians["ours"], "transformers_tokens_per_s": tokens / medians["transformers"],
        "speedup": medians["transformers"] / medians["ours"],
        "speedup_per_round": {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]},
        "tokens_equal": True,
    }


def hf_forced(hf, prompts: list[list[int]], targets: list[list[int]], stops: list[int],
              new_tokens: int) -> list[list[int]]:
    """``transformers`` ``generate`` (left-padded prompts, KV cache) made to emit ``targets``: a logits processor
    leaves only each row's next target token; finished rows are padded until the last row ends, as ``generate``
    does."""
    from transformers import LogitsProcessor, LogitsProcessorList

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    forced = torch.full((len(prompts), new_tokens), stops[0], dtype=torch.long)
    for row, target in enumerate(targets):
        forced[row, :len(target)] = torch.tensor(target)

    class Forced(LogitsProcessor):
        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - width
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(1, forced[:, step:step + 1], 0.0)

    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                          eos_token_id=stops, use_cache=True, logits_processor=LogitsProcessorList([Forced()]))
    cut = [next((i + 1 for i, t in enumerate(row) if t in stops), len(row)) for row in out[:, width:].tolist()]
    return [row[:n] for row, n in zip(out[:, width:].tolist(), cut)]


def longtail_stop_tokens(rows: list[list[int]], new_tokens: int) -> tuple[list[int], float]:
    """Stop tokens for mixed lengths: the most frequent tokens of ``rows`` (sampled without a stop), added one by
    one until a row's first stop token comes, on average, at LONGTAIL_MEAN or sooner; and that mean length."""
    counts: dict[int, int] = {}
    for row in rows:
        for token in row:
            counts[token] = counts.get(token, 0) + 1
    chosen: list[int] = []
    mean = float(new_tokens)
    for token in sorted(counts, key=lambda t: (-counts[t], t)):
        chosen.append(token)
        stops = set(chosen)
        mean = statistics.mean(next((i + 1 for i, t in enumerate(row) if t in stops), new_tokens) for row in rows)
        if mean <= LONGTAIL_MEAN:
            break
    return chosen, mean


def run_longtail(case: Case, engine, shape, args) -> dict:
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.models import unwrap

    hf = megatron_to_hf(unwrap(engine.chunks[0]), shape, dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    distinct = [torch.randint(3, shape.vocab_size, (int(n),), generator=gen).tolist()
                for n in torch.randint(8, 25, (args.longtail_prompts,), generator=gen)]
    prompts = [p for p in distinct for _ in range(args.group)]

    def ours_with(stops):
        config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=case.new_tokens, temperature=1.0,
                              stop_token_ids=stops, kv_block_tokens=args.block_tokens)
        return generate(engine.chunks, prompts, config, seed=5)

    stops, _ = longtail_stop_tokens(ours_with([]).tokens, case.new_tokens)
    paged = ours_with(stops)
    reference = paged.tokens
    contenders = {
        "ours": lambda: ours_with(stops).tokens,
        "transformers": lambda: hf_forced(hf, prompts, reference, stops, case.new_tokens),
    }
    assert contenders["transformers"]() == reference, "longtail: transformers did not follow the forced tokens"
    times = {contender: [] for contender in contenders}
    for _ in range(args.repeats):
        for contender, fn in contenders.items():
            started = time.perf_counter()
            fn()
            times[contender].append(time.perf_counter() - started)
    medians = {contender: statistics.median(values) for contender, values in times.items()}
    ratios = sorted(t / o for t, o in zip(times["transformers"], times["ours"]))
    lengths = sorted(paged.lengths)
    tokens = sum(lengths)
    # KV memory. Paged: the blocks rows held at the peak over the positions they held then (shared prompt blocks
    # once), as the engine measured. Static (the engine it replaced, by arithmetic): a [rows, longest prompt + new]
    # cache over the most it would ever hold (every row's final length, each distinct prompt once).
    paged_ratio = paged.kv_peak_blocks * paged.kv_block_tokens / paged.kv_peak_held_tokens
    static_positions = len(prompts) * (max(map(len, prompts)) + case.new_tokens)
    static_held = sum(map(len, distinct)) + tokens
    return {
        "model": case.model, "rows": len(prompts), "prompts": len(distinct), "group": args.group,
        "prompt_lens": {"min": min(map(len, distinct)), "max": max(map(len, distinct))},
        "max_new_tokens": case.new_tokens, "temperature": 1.0, "stop_tokens": stops,
        "response_lengths": {"min": lengths[0], "median": statistics.median(lengths),
                             "mean": statistics.mean(lengths), "p90": lengths[int(0.9 * len(lengths))],
                             "max": lengths[-1], "tokens": tokens},
        "decode_attention": paged.decode_attention, "block_tokens": paged.kv_block_tokens,
        "kv_allocated_over_held": paged_ratio,
        "kv_peak_blocks": paged.kv_peak_blocks, "kv_peak_held_tokens": paged.kv_peak_held_tokens,
        "static_kv_allocated_over_held": static_positions / static_held,
        "static_kv_positions": static_positions, "static_kv_held_positions": static_held,
        **{f"{contender}_s_median": medians[contender] for contender in contenders},
        **{f"{contender}_s_all": times[contender] for contender in contenders},
        "ours_tokens_per_s": tokens / medians["ours"], "transformers_tokens_per_s": tokens / medians["transformers"],
        "speedup": medians["transformers"] / medians["ours"],
        "speedup_per_round": {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]},
        "tokens_equal": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="tiny,small,long,longtail", help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--block-tokens", type=int, default=8,
                        help="generation.kv_block_tokens of our engine (CPU: 8; GPUs need 256)")
    parser.add_argument("--longtail-prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt in the longtail case")
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
            run = run_longtail if name == "longtail" else lambda *a: run_case(name, *a)
            results[name] = run(CASES[name], *engines[model], args)
    shutdown()

    print(f"greedy, fp32, {args.threads} torch threads, {args.repeats} rounds, batch {args.batch}, prompt "
          f"{PROMPT_LEN}; medians (s)")
    print(f"{'case':9}{'ours':>9}{'HF':>9}   speedup (rounds: min..max)   lengths")
    for name, r in results.items():
        spread = r["speedup_per_round"]
        lengths = r["response_lengths"]
        print(f"{name:9}{r['ours_s_median']:9.4f}"
              f"{r['transformers_s_median']:9.4f}   {r['speedup']:.2f} ({spread['min']:.2f}..{spread['max']:.2f})"
              f"{'':14}{lengths['min']}..{lengths['max']}")
    if "longtail" in results:
        r = results["longtail"]
        print(f"longtail KV allocated / held: paged {r['kv_allocated_over_held']:.3f} (blocks of {r['block_tokens']}), "
              f"static {r['static_kv_allocated_over_held']:.3f}; mean response {r['response_lengths']['mean']:.1f} "
              f"of at most {r['max_new_tokens']}")
    print(json.dumps({"cases": results, "speedup": results[names[0]]["speedup"],
                      "speedups": {name: r["speedup"] for name, r in results.items()}, "threads": args.threads,
                      "repeats": args.repeats, "dtype": "fp32",
                      "decoding": "greedy; longtail sampled at temperature 1",
                      "kv_allocated_over_held": results.get("longtail", {}).get("kv_allocated_over_held"),
                      "transformers_version": transformers.__version__, "torch_version": torch.__version__}))


if __name__ == "__main__":
    main()
