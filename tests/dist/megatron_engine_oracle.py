"""Oracle: the project's paged engine against Megatron Core's own ``DynamicInferenceEngine``, on the same weights.

Run: ``.venv/bin/python -m torch.distributed.run --nproc-per-node N tests/dist/megatron_engine_oracle.py --tp N
--out DIR`` (N = 1 or 2); every rank writes ``DIR/rank{R}.json`` for tests/test_megatron_engine_oracle.py.

The tiny Llama-like model (tiny-cpu: GQA, RoPE, RMSNorm, SwiGLU) is built by ``build_engine`` and trained two
steps on the pretrain task, as tests/dist/gen_check.py does. Then the same prompts (GRPO-like groups of one
prompt repeated, prompts of different lengths, one prompt sharing its first two blocks with another) are decoded
greedily by

* the project's engine (``megatron_rl.generation.generate``: its own block pool, a group's prompt prefilled once);
* Megatron's ``DynamicInferenceEngine`` (its ``DynamicInferenceContext`` with ``enable_prefix_caching=True``,
  ``GPTInferenceWrapper``, ``TextGenerationController``), top_k=1 and raw log-probs of the generated tokens;

both with the same block size, small enough that the prompts hold whole blocks to share. Also recorded: each
engine against one no-cache forward of the final sequences (the model's own forward and training attention), and
Megatron's prefix caching counters and kernel calls.

Megatron's engine is written for GPUs; the CPU patches it needs are here (``patch_megatron_engine_for_cpu``),
because the project never runs Megatron's engine: its attention kernels become the project's torch stand-ins for
flash-attn's (the same ones the project's engine runs on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
import types
from typing import Iterator

import torch

BLOCK_TOKENS = 8
"""Both engines' KV block size: Megatron's prefix caching shares whole blocks only, so the prompts below hold
several (flash-attn's 256-token rule binds the GPU kernels only, not the torch stand-ins)."""
NEW_TOKENS = 10
GROUP = 4
"""Completions per prompt (a GRPO group: the same prompt, consecutive rows)."""
PERTURBATION = 0.1
"""Standard deviation of the fixed noise added to every parameter after training (see ``main``)."""
PROMPT_LENGTHS = (21, 13, 6, 30)
"""Group prompts: 2, 1, 0 and 3 full blocks; a row of its own shares the 30-token prompt's first 2 blocks."""


def oracle_prompts(vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(distinct prompts, rows)``: every group prompt ``GROUP`` times in a row, then a prompt made of the last
    group prompt's first two blocks and 5 tokens of its own (shares 2 blocks with the group, not the third)."""
    gen = torch.Generator().manual_seed(2025)
    distinct = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    sibling = distinct[-1][:2 * BLOCK_TOKENS] + torch.randint(3, vocab_size, (5,), generator=gen).tolist()
    rows = [p for p in distinct for _ in range(GROUP)] + [sibling]
    return distinct + [sibling], rows


# ----------------------------------------------------------------------------------------------------------
# Megatron's DynamicInferenceEngine on the CPU (test-only patches, megatron-core 0.19.2).

def _without_pinning(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)
    return wrapper


KERNEL_CALLS = {"varlen": 0, "kvcache": 0}
"""Calls of the stand-in kernels from Megatron's attention (mixed/prefill steps, decode-only steps)."""


def _counted(name: str, kernel):
    @functools.wraps(kernel)
    def wrapper(*args, **kwargs):
        KERNEL_CALLS[name] += 1
        return kernel(*args, **kwargs)
    return wrapper


def patch_megatron_engine_for_cpu() -> list[str]:
    """Make Megatron's dynamic engine run on the CPU; returns what was patched. Apply after
    ``megatron_rl.runtime.cpu_compat`` (``initialize``), which already redirects ``device="cuda"`` tensors,
    ``torch.cuda`` streams/events/RNG and the like to the CPU."""
    from megatron.core.inference.contexts import dynamic_context
    from megatron.core.transformer import attention

    from megatron_rl.generation.paged import _merge_heads
    from megatron_rl.generation.paged_attention import reference_kvcache, reference_varlen

    applied = []
    # 1. flash-attn is not installed (it needs CUDA): Attention.flash_decode_and_prefill calls its two kernels by
    #    module-global name. Stand-ins with flash-attn's signatures and paged semantics: the project's torch
    #    references (checked against flash-attn on GPUs by bench/gpu_check.sh). FA3/FA4 are not installed either,
    #    so Megatron takes its FA2 calls.
    attention.flash_attn_varlen_func = _counted("varlen", reference_varlen)
    attention.flash_attn_with_kvcache = _counted("kvcache", reference_kvcache)
    applied.append("flash-attn kernels -> paged_attention.reference_varlen / reference_kvcache")
    # 2. Attention.forward asserts flash-attn >= 2.7.3 for dynamic batching (is_fa_min_version reads the installed
    #    flash-attn's version); the stand-ins implement that version's API.
    attention.is_fa_min_version = lambda *args, **kwargs: True
    applied.append("is_fa_min_version -> True")
    # 3. einops (not a dependency here) merges the heads of the dynamic path's output: one rearrange pattern.
    if attention.rearrange is None:
        attention.rearrange = _merge_heads
        applied.append("einops.rearrange -> heads merged by flatten")
    # 4. The Triton KV append kernel imports (Triton ships with the torch wheel) but asserts CUDA tensors; None
    #    selects Megatron's own torch indexing append (the path it takes for MLA latents).
    dynamic_context.triton_append_key_value_cache = None
    applied.append("triton_append_key_value_cache -> None (torch append)")
    # 5. The context and the controller allocate pinned host staging buffers (torch.empty / empty_like / full with
    #    pin_memory=True) at construction; pinning needs a CUDA driver. On the CPU they are ordinary host tensors.
    #    (The ``.pin_memory()`` calls of kv_cache_management_mode="offload" are not reached: the mode is "persist".)
    for name in ("empty", "empty_like", "full"):
        setattr(torch, name, _without_pinning(getattr(torch, name)))
    applied.append("pin_memory=True dropped from torch.empty / empty_like / full")
    # 6. See _current_device_is_cpu (applied around the controller's construction only).
    applied.append("torch.cuda.current_device -> 'cpu' while TextGenerationController is built")
    return applied


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    """The controller's sampling generator is ``torch.Generator(device=torch.cuda.current_device())``: the device
    index that cpu_compat answers (0) makes a CUDA generator, which needs a driver. While the controller is built,
    the current device is the CPU (its staging tensors, placed on the same device, land there anyway)."""
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = current


def megatron_generate(model, rows: list[list[int]], *, vocab_size: int, new_tokens: int) -> dict:
    """Greedy decoding of ``rows`` by Megatron's ``DynamicInferenceEngine`` with prefix caching on."""
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    model.eval()
    longest = max(len(r) for r in rows) + new_tokens
    context = DynamicInferenceContext(
        model_config=model.config,
        inference_config=InferenceConfig(
            block_size_tokens=BLOCK_TOKENS, buffer_size_gb=0.01, max_sequence_length=longest,
            max_requests=32, max_tokens=256, enable_prefix_caching=True, materialize_only_last_token_logits=True,
            unified_memory_level=0, logprobs_mode="raw_logprobs"))
    wrapper = GPTInferenceWrapper(model, context)
    tokenizer = types.SimpleNamespace(vocab_size=vocab_size, eod=-1, detokenize=lambda tokens, **kw: "")
    with _current_device_is_cpu():
        controller = TextGenerationController(inference_wrapped_model=wrapper, tokenizer=tokenizer)
    engine = DynamicInferenceEngine(controller, context)
    # greedy: top-k 1 (the torch sampler's argmax); log-probs are Megatron's raw ones (temperature 1, untempered
    # logits over the whole vocabulary), the same quantity as the project's policy log-probs
    params = SamplingParams(top_k=1, return_log_probs=True, skip_prompt_log_probs=True,
                            num_tokens_to_generate=new_tokens, termination_id=-1)
    started = time.perf_counter()
    with torch.inference_mode():
        records = engine.generate([list(r) for r in rows], params)
    seconds = time.perf_counter() - started
    finished = [record.merge() for record in records]
    return {
        "seconds": seconds,
        "tokens": [[int(t) for t in r.generated_tokens] for r in finished],
        "logprobs": [[float(x) for x in r.generated_log_probs] for r in finished],
        "status": [str(r.status) for r in finished],
        "num_cached_tokens": [int(r.num_cached_tokens) for r in finished],
        "prefix_cache_hits": int(engine._prefix_cache_hits),
        "prefix_cache_blocks_matched": int(engine._prefix_cache_blocks_matched),
        "prefill_tokens_skipped": int(engine._prefill_tokens_skipped),
        "prefill_tokens_computed": int(engine._prefill_tokens_computed),
        "block_size_tokens": int(context.block_size_tokens),
        "prefix_caching": bool(context.enable_prefix_caching),
        "kernel_calls": dict(KERNEL_CALLS),
    }


def no_cache_reference(model, rows: list[list[int]], responses: list[list[int]], vocab_size: int) -> dict:
    """One forward of the final sequences without any cache (the training forward; a causal model's logits at a
    position depend only on the tokens up to it): per response token the greedy choice, the log-prob of the token
    generated, and the margin between the two largest logits (how far greedy is from a tie)."""
    from gen_check import padded, response_slice

    tokens = padded(rows, responses)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(len(rows), -1)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, positions, None, runtime_gather_output=True)[:, :-1].float()
    lengths = [len(r) for r in responses]
    top2 = logits[..., :vocab_size].topk(2, dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    margins = response_slice(top2.values[..., 0] - top2.values[..., 1], rows, lengths)
    return {"argmax": [[int(t) for t in row] for row in response_slice(top2.indices[..., 0].double(), rows, lengths)],
            "logprobs": response_slice(logprobs, rows, lengths),
            "min_margin": min(m for row in margins for m in row)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    import megatron.core
    from megatron.core import parallel_state as ps

    from dist_common import progression_trainer, write_rank_result
    from gen_check import max_abs_diff
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.models import unwrap
    from megatron_rl.models.builder import padded_vocab_size
    from megatron_rl.runtime.distributed import initialize, job_dims
    from megatron_rl.trainers.common import job_engine
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape

    # The model of gen_check.py: tiny-cpu by build_engine, two optimizer steps of the pretrain task.
    cfg = load_config(overrides=[f"parallel.tp={args.tp}", "algorithm.name=pretrain", "parallel.micro_batch_size=1",
                                 "algorithm.global_batch_size=4", "run.seed=7", "optimizer.lr=0.01"])
    initialize(job_dims(tp=args.tp), seed=cfg.run.seed)
    shape = load_model_shape("tiny-cpu")
    vocab = shape.vocab_size
    engine = job_engine(cfg, shape, total_steps=10)
    train_step = progression_trainer(engine, micro_batch_size=cfg.parallel.micro_batch_size)
    for step in (1, 2):
        train_step(step)
    model = unwrap(engine.chunks[0])
    # Then a fixed perturbation: after two steps the model is nearly uniform (mean entropy 4.82 nats of 4.85) and
    # repeats tokens whatever came before; perturbed, its greedy tokens depend on the context, so a cache that
    # served the wrong keys would show. The same draws on every TP rank keep replicated parameters equal (the
    # shards of a TP=2 model get their own draws: TP=1 and TP=2 decode different weights).
    noise = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * PERTURBATION)

    distinct, rows = oracle_prompts(vocab)
    result: dict = {"tp": args.tp, "world": torch.distributed.get_world_size(), "dp": ps.get_data_parallel_world_size(),
                    "megatron_core": megatron.core.__version__, "vocab_size": vocab,
                    "padded_vocab_size": padded_vocab_size(vocab, args.tp), "block_tokens": BLOCK_TOKENS,
                    "new_tokens": NEW_TOKENS, "group": GROUP, "rows": rows, "distinct_prompts": len(distinct)}

    # The project's engine first: building Megatron's engine marks its InferenceMode active for good.
    started = time.perf_counter()
    ours = generate(engine.chunks, rows, EngineConfig(vocab_size=vocab, max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                      kv_block_tokens=BLOCK_TOKENS))
    result["project"] = {"seconds": time.perf_counter() - started, "tokens": ours.tokens, "logprobs": ours.logprobs,
                         "finish_reasons": ours.finish_reasons, "prefill_rows": ours.prefill_rows,
                         "decode_attention": ours.decode_attention, "block_tokens": ours.kv_block_tokens}

    result["patches"] = patch_megatron_engine_for_cpu()
    theirs = megatron_generate(model, rows, vocab_size=vocab, new_tokens=NEW_TOKENS)
    result["megatron"] = theirs

    # Each engine against the no-cache forward of its own final sequences (says which side moved, if they differ).
    for out in (result["project"], theirs):
        reference = no_cache_reference(model, rows, out["tokens"], vocab)
        out["no_cache_argmax_equal"] = reference["argmax"] == out["tokens"]
        out["vs_no_cache"] = max_abs_diff(out["logprobs"], reference["logprobs"])
        out["min_greedy_margin"] = reference["min_margin"]
    result["tokens_equal"] = ours.tokens == theirs["tokens"]
    if result["tokens_equal"]:
        result["logprob_diff"] = max_abs_diff(ours.logprobs, theirs["logprobs"])
    write_rank_result(args.out, result)


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
