"""What a decode step costs the host, beside ``transformers`` ``generate``: the figures a GPU cares about.

Run: ``.venv/bin/python bench/engine_costs.py`` (options: ``--rows 64,256 --new-tokens 32 --repeats 3
--threads 1``). Single process, CPU, fp32, no network (HF_HUB_OFFLINE=1).

On a GPU the forward's kernels run while the host queues the next ones; what the host does between forwards (and
every time it waits on the device) is the floor of a decode step once CUDA graphs remove the launch cost. Both
sides decode the same prompts (8 tokens, ``--new-tokens`` each, greedy) on the small bench model (hidden 256, 4
layers; bench/generation.py's, same weights copied into a ``LlamaForCausalLM``), at each ``--rows``:

* ``host_us_per_step``: the median decode step's wall time outside the model forward (ours: the engine's step
  outside ``ModelRunner.forward``, scheduling, inputs, sampling and post-processing; theirs: ``generate``'s time
  per new token outside the model's ``forward``, its logits processing, stopping criteria and cache update);
* ``sample_us_per_step`` (ours): the part of that spent choosing tokens (on a GPU: kernels, not host time);
* ``forward_us_per_step``: the median decode step's model forward, for scale (on the CPU it is most of a step);
* ``syncs_per_step``: host reads per decode step (``megatron_rl.runtime.probes.host_syncs``: ``item``,
  ``tolist``, ``int()``, ``bool()``, ``nonzero``, boolean indexing), counted in a separate run;
* ``kernels``: the paged attention reference kernels' peak extra memory over the K/V (MLA: latent) bytes they
  read (``PeakBytes``) for a decode, a mixed and an MLA step at a GQA shape (32 heads over 8, dim 128) and
  DeepSeek's latent (576), 64 rows x 1,024 keys.

The last line is one JSON object; ``speedup`` = their host time per step / ours at the first ``--rows``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import PROMPT_LEN, small_shape_file, trained_engine  # noqa: E402
from hf_reference import hf_generate, megatron_to_hf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_rl.spec.ports import free_port  # noqa: E402


def ours(engine, shape, prompts: list, new_tokens: int, *, count_syncs: bool) -> dict:
    """One ``generate`` call, each decode step timed in parts (or its host reads counted)."""
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.generation.engine import Engine
    from megatron_rl.generation.runner import ModelRunner
    from megatron_rl.runtime.probes import host_syncs

    steps, parts = [], {"forward": 0.0, "sample": 0.0}
    step, forward, sample = Engine.step, ModelRunner.forward, ModelRunner.sample

    def timed(name, fn):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] += time.perf_counter() - started
        return run

    def measured_step(self) -> bool:
        parts.update(forward=0.0, sample=0.0)
        started = time.perf_counter()
        if count_syncs:
            with host_syncs() as reads:
                more = step(self)
        else:
            more, reads = step(self), []
        took = time.perf_counter() - started
        if more and self.parts[0].runner.context.is_decode_only():
            steps.append({"host": took - parts["forward"], "sample": parts["sample"], "forward": parts["forward"],
                          "syncs": len(reads)})
        return more

    Engine.step, ModelRunner.forward, ModelRunner.sample = (measured_step, timed("forward", forward),
                                                            timed("sample", sample))
    try:
        generate(engine.chunks, prompts, EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=new_tokens,
                                                      temperature=0.0, kv_block_tokens=8))
    finally:
        Engine.step, ModelRunner.forward, ModelRunner.sample = step, forward, sample
    return {"host_us_per_step": 1e6 * statistics.median(s["host"] for s in steps),
            "sample_us_per_step": 1e6 * statistics.median(s["sample"] for s in steps),
            "forward_us_per_step": 1e6 * statistics.median(s["forward"] for s in steps),
            "syncs_per_step": max(s["syncs"] for s in steps), "decode_steps": len(steps)}


def theirs(hf, prompts: torch.Tensor, new_tokens: int, *, count_syncs: bool) -> dict:
    """One greedy ``generate`` call: its time per new token outside the model forward (or its host reads)."""
    from megatron_rl.runtime.probes import host_syncs

    calls = []
    forward = hf.forward

    def timed_forward(*args, **kwargs):
        started = time.perf_counter()
        out = forward(*args, **kwargs)
        calls.append(time.perf_counter() - started)
        return out

    hf.forward = timed_forward
    try:
        started = time.perf_counter()
        if count_syncs:
            with host_syncs() as reads:
                hf_generate(hf, prompts, new_tokens)
        else:
            hf_generate(hf, prompts, new_tokens)
            reads = []
        total = time.perf_counter() - started
    finally:
        hf.forward = forward
    # the first call is the prefill; the others are decode steps
    return {"host_us_per_step": 1e6 * (total - sum(calls)) / len(calls), "syncs_per_step": len(reads) / len(calls),
            "forward_us_per_step": 1e6 * statistics.median(calls[1:]),
            "decode_steps": len(calls) - 1}


def kernel_peaks(rows: int = 64, keys: int = 1024) -> dict:
    """Peak extra memory / bytes read of each reference kernel (fp32, blocks of 16, shuffled)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_rl.generation.paged_attention import reference_kvcache, reference_mla, reference_varlen
    from megatron_rl.runtime.probes import PeakBytes

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, latent, block, q_mixed = 32, 8, 128, 576, 16, 16
    table = torch.randperm(rows * keys // block, generator=gen).view(rows, -1).to(torch.int32)
    lens = torch.full((rows,), keys, dtype=torch.int32)
    k_cache, v_cache = (torch.randn(table.numel(), block, kv_heads, dim, generator=gen) for _ in range(2))
    cache = torch.randn(table.numel(), block, 1, latent, generator=gen)
    cu_mixed = torch.arange(rows + 1, dtype=torch.int32) * q_mixed
    kv_read = 2 * k_cache.nbytes // k_cache.shape[0] * table.numel()  # K and V of every block in the tables
    calls = {
        "decode": (lambda: reference_kvcache(torch.randn(rows, 1, heads, dim), k_cache, v_cache, cache_seqlens=lens,
                                             block_table=table), kv_read),
        "mixed": (lambda: reference_varlen(torch.randn(rows * q_mixed, heads, dim), k_cache, v_cache, cu_mixed,
                                           torch.arange(rows + 1, dtype=torch.int32) * keys, q_mixed, keys,
                                           block_table=table), kv_read),
        "mla": (lambda: reference_mla(torch.randn(rows, 16, latent), cache, torch.arange(rows + 1, dtype=torch.int32),
                                      lens, 1, keys, block_table=table, head_dim_v=512, softmax_scale=0.1),
                cache.nbytes // cache.shape[0] * table.numel()),
    }
    found = {}
    for name, (call, read) in calls.items():
        with sdpa_kernel(SDPBackend.MATH), PeakBytes() as memory:
            call()
        found[name] = {"peak_extra_bytes": memory.peak, "kv_bytes_read": read, "over_kv": memory.peak / read}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-steps", type=int, default=5)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(args.threads)
    import transformers  # noqa: F401  (before Megatron's CPU patches, as bench/generation.py)

    from megatron_rl.models import unwrap
    from megatron_rl.runtime.distributed import initialize, job_dims, shutdown

    initialize(job_dims(), seed=3)
    results = {}
    with tempfile.TemporaryDirectory(prefix="engine_costs_") as tmp:
        engine, shape = trained_engine(str(small_shape_file(Path(tmp))), args.train_steps)
        hf = megatron_to_hf(unwrap(engine.chunks[0]), shape, dtype=torch.float32, device=torch.device("cpu"))
        for rows in [int(r) for r in args.rows.split(",")]:
            prompts = torch.randint(3, shape.vocab_size, (rows, PROMPT_LEN),
                                    generator=torch.Generator().manual_seed(rows))
            runs = {"ours": [ours(engine, shape, prompts.tolist(), args.new_tokens, count_syncs=False)
                             for _ in range(args.repeats)],
                    "transformers": [theirs(hf, prompts, args.new_tokens, count_syncs=False)
                                     for _ in range(args.repeats)]}
            case = {side: {key: statistics.median(run[key] for run in found) for key in found[0]}
                    for side, found in runs.items()}
            case["ours"]["syncs_per_step"] = ours(engine, shape, prompts.tolist(), args.new_tokens,
                                                  count_syncs=True)["syncs_per_step"]
            case["transformers"]["syncs_per_step"] = theirs(hf, prompts, args.new_tokens,
                                                            count_syncs=True)["syncs_per_step"]
            case["speedup"] = case["transformers"]["host_us_per_step"] / case["ours"]["host_us_per_step"]
            results[str(rows)] = case
    kernels = kernel_peaks()
    shutdown()
    print(f"decode steps, fp32, {args.threads} torch threads, median of {args.repeats}")
    print(f"{'rows':>5}{'ours host us':>14}{'(sampling)':>12}{'HF host us':>12}{'ours syncs':>12}{'HF syncs':>10}"
          f"{'ours fwd us':>13}{'HF fwd us':>11}")
    for rows, case in results.items():
        ours_case, theirs_case = case["ours"], case["transformers"]
        print(f"{rows:>5}{ours_case['host_us_per_step']:14.0f}{ours_case['sample_us_per_step']:12.0f}"
              f"{theirs_case['host_us_per_step']:12.0f}{ours_case['syncs_per_step']:12.0f}"
              f"{theirs_case['syncs_per_step']:10.1f}{ours_case['forward_us_per_step']:13.0f}"
              f"{theirs_case['forward_us_per_step']:11.0f}")
    for name, found in kernels.items():
        print(f"kernel {name}: peak extra {found['peak_extra_bytes'] / 2**20:.1f} MiB = {found['over_kv']:.2f} x "
              f"the {found['kv_bytes_read'] / 2**20:.1f} MiB of K/V it reads")
    print(json.dumps({"rows": results, "kernels": kernels, "speedup": results[next(iter(results))]["speedup"],
                      "threads": args.threads, "repeats": args.repeats, "new_tokens": args.new_tokens,
                      "dtype": "fp32", "torch": torch.__version__}))


if __name__ == "__main__":
    main()
