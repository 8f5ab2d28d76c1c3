"""Tokens/s of our colocated generation against Hugging Face ``transformers`` ``generate``, same weights.

Run: ``.venv/bin/python bench/generation.py`` (options: ``--batch 64 --prompt-len 8 --new-tokens 32
--repeats 9 --threads 1 --train-steps 20``). Single process, CPU, fp32, greedy, no network (HF_HUB_OFFLINE=1).

Two more rows time our generation with ``fast_decode=False`` (decode steps through the ``GPTModel``
modules instead of the lean step of megatron_rl/generation/lean_decode.py) and with ``fast_attention=False``
(Megatron's attention and module path unchanged), to show what each layer of speed-up buys.

Both sides decode the same prompts with the same weights: the tiny Llama (``tiny-cpu``) is built by our
``build_engine`` (Megatron DDP chunks, as in training), trained a few steps on the pretrain task so that its
outputs are not near-uniform, and copied into a ``LlamaForCausalLM`` (fused QKV split per query group,
fc1 split into gate and up). The bench first asserts that both produce the same tokens, then times them
alternately (ours, theirs, ours, ...) and reports medians and minima. Both run in one process on the same
number of torch threads (default 1: both sides are bound by per-op Python overhead at this size, and one
thread avoids OpenMP spin-waits on a shared 2-core machine), under the same process-wide CPU patches of
``megatron_rl.runtime.cpu_compat``. The last line is one JSON object; ``speedup`` = transformers seconds /
our seconds (> 1: we are faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import hf_generate, megatron_to_hf  # noqa: E402  (shared with the GPU check)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launcher.ports import free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-steps", type=int, default=20)
    args = parser.parse_args()

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(args.threads)
    import transformers

    from launcher.config.loader import load_config
    from launcher.model_shape import load_model_shape
    from megatron_rl.generation import generate
    from megatron_rl.runtime.checkpoint import unwrap
    from megatron_rl.runtime.distributed import initialize, job_dims, shutdown
    from megatron_rl.runtime.training import build_engine
    from megatron_rl.trainers.pretrain import collate_lm, lm_loss, progression_batch

    cfg = load_config(overrides=["algorithm.name=pretrain", "algorithm.global_batch_size=16", "optimizer.lr=0.01",
                                 "parallel.micro_batch_size=16",
                                 "run.seed=3"])
    initialize(job_dims(), seed=cfg.run.seed)
    shape = load_model_shape("tiny-cpu")
    engine = build_engine(cfg, shape, total_steps=max(args.train_steps, 1))
    for step in range(1, args.train_steps + 1):
        rows = progression_batch(seed=3, step=step, batch_size=16, seq_length=32, vocab_size=shape.vocab_size)
        engine.train_step([collate_lm(rows)], lm_loss, seq_length=32, report_names=("loss",))
    hf = megatron_to_hf(unwrap(engine.chunks[0]), shape, dtype=torch.float32, device=torch.device("cpu"))

    gen = torch.Generator().manual_seed(0)
    prompt_tensor = torch.randint(3, shape.vocab_size, (args.batch, args.prompt_len), generator=gen)
    prompts = prompt_tensor.tolist()

    def ours(fast_attention: bool = True, fast_decode: bool = True):
        return generate(engine.chunks, prompts, vocab_size=shape.vocab_size, max_new_tokens=args.new_tokens,
                        temperature=0.0, fast_attention=fast_attention, fast_decode=fast_decode).tokens

    def ours_megatron_modules():
        return ours(fast_decode=False)

    def ours_megatron_attention():
        return ours(fast_attention=False)

    def theirs():
        return hf_generate(hf, prompt_tensor, args.new_tokens).tolist()

    ours_tokens, hf_tokens = ours(), theirs()
    differing = [b for b in range(args.batch) if ours_tokens[b] != hf_tokens[b]]
    assert not differing, f"rows {differing[:8]} differ: ours {ours_tokens[differing[0]]} hf {hf_tokens[differing[0]]}"
    assert ours_megatron_attention() == ours_tokens and ours_megatron_modules() == ours_tokens
    decode_path = generate(engine.chunks, prompts[:2], vocab_size=shape.vocab_size, max_new_tokens=2,
                           temperature=0.0).decode_path

    contenders = (("ours", ours), ("transformers", theirs), ("ours_megatron_modules", ours_megatron_modules),
                  ("ours_megatron_attention", ours_megatron_attention))
    times = {name: [] for name, _ in contenders}
    for _ in range(args.repeats):
        for name, fn in contenders:
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    tokens = args.batch * args.new_tokens
    medians = {name: statistics.median(values) for name, values in times.items()}
    ours_s, hf_s = medians["ours"], medians["transformers"]
    print(f"{'':26}{'median s':>10}{'min s':>9}{'tokens/s':>11}   batch {args.batch}, prompt {args.prompt_len}, "
          f"new {args.new_tokens}, greedy, fp32, {args.threads} threads, {args.repeats} repeats")
    for name, sec in medians.items():
        print(f"{name:26}{sec:10.4f}{min(times[name]):9.4f}{tokens / sec:11.0f}")
    print(f"speedup (transformers s / ours s): {hf_s / ours_s:.2f}; tokens equal: {not differing}")
    print(json.dumps({
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "threads": args.threads, "repeats": args.repeats, "dtype": "fp32", "decoding": "greedy",
        "ours_s_median": ours_s, "transformers_s_median": hf_s,
        "ours_tokens_per_s": tokens / ours_s, "transformers_tokens_per_s": tokens / hf_s,
        "decode_path": decode_path, "ours_megatron_modules_s_median": medians["ours_megatron_modules"],
        "ours_megatron_attention_s_median": medians["ours_megatron_attention"],
        "ours_s_all": times["ours"], "transformers_s_all": times["transformers"],
        "ours_megatron_modules_s_all": times["ours_megatron_modules"],
        "ours_megatron_attention_s_all": times["ours_megatron_attention"],
        "tokens_equal": not differing, "speedup": hf_s / ours_s,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__}))
    shutdown()


if __name__ == "__main__":
    main()
