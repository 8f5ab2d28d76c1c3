"""The GPU check's parts on the small exact model (bench/gpu_check.py runs them): fp32 exactness against the
training forward and ``transformers``, the attention kernels, the paged engine, packing, LoRA, MoE and router
replay. Each returns its figures and ``passed``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Optional

import torch

from hf_reference import (compare_logprobs, hf_generate, hf_logprobs, judge, megatron_to_hf, padded_sequences,
                          token_agreement)

REPO_ROOT = Path(__file__).resolve().parents[1]


def exactness_check(exact_yaml: str, device: torch.device) -> dict:
    """fp32 tiny tied Llama: KV-cache vs training-forward log-probs, and the same weights in transformers."""
    # IEEE fp32 matmuls for this part only: TF32 would round to 10 mantissa bits and hide nothing but noise
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return _exactness_check(exact_yaml, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_tf32


def _exactness_check(exact_yaml: str, device: torch.device) -> dict:
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.models.builder import ModelOptions, build_gpt_model

    shape = dataclasses.replace(load_model_shape(str(REPO_ROOT / exact_yaml)), tie_embeddings=True)
    model = build_gpt_model(shape, ModelOptions(dtype=torch.float32, init_seed=7))
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, shape.vocab_size, (8, 6), generator=gen).tolist()
    prompts[1] = prompts[1][:3]  # ragged prompts: decode feeds prompt tokens to the short rows
    config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=16, temperature=1.0)
    sampled = generate(model, prompts, config, seed=7)
    tokens = padded_sequences(prompts, sampled.tokens, device)
    ours = sequence_logprobs(model, tokens)
    hf = megatron_to_hf(model, shape, dtype=torch.float32, device=device)
    theirs = hf_logprobs(hf, tokens)
    lens = [len(p) for p in prompts]
    mask = torch.zeros_like(ours, dtype=torch.bool)
    for row, (start, response) in enumerate(zip(lens, sampled.tokens)):
        mask[row, start - 1:start - 1 + len(response)] = True
    hf_diff = (ours - theirs).abs()[mask]
    even = [p[:6] + [p[0]] * (6 - len(p)) for p in prompts]
    greedy = generate(model, even, dataclasses.replace(config, temperature=0.0)).tokens
    hf_greedy = hf_generate(hf, torch.tensor(even, device=device), 16).tolist()
    del hf
    return {
        "model": f"{shape.name} (tied embeddings), fp32",
        "kv_cache_vs_training_forward": judge(compare_logprobs(lens, sampled.tokens, sampled.logprobs, ours),
                                              dtype="fp32"),
        "transformers_vs_training_forward": judge({"tokens": int(hf_diff.numel()),
                                                   "max_abs_diff": float(hf_diff.max()),
                                                   "mean_abs_diff": float(hf_diff.mean())}, dtype="fp32"),
        "greedy_tokens_vs_transformers": token_agreement(greedy, hf_greedy),
    }


def attention_kernels_check(exact_yaml: str, device: torch.device) -> dict:
    """runtime.attention=flash against unfused on the same fp32 weights and tokens: TE's fused/flash backend
    against TE's unfused one on a GPU with TE (Megatron's attention_backend), torch's SDPA against Megatron's
    DotProductAttention without TE. TE reads the backend from NVTE_* variables, which each build sets; they are
    cleared around the part so the main model sets its own."""
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.models.builder import ModelOptions, build_gpt_model
    from megatron_rl.models import unwrap
    from megatron_rl.runtime.training import sequence_logprobs

    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    shape = load_model_shape(str(REPO_ROOT / exact_yaml))
    tokens = torch.randint(3, shape.vocab_size, (4, 32), generator=torch.Generator().manual_seed(5)).to(device)
    logprobs, modules = {}, {}
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for kernel in ("flash", "unfused"):
            for name in names:
                os.environ.pop(name, None)
            model = build_gpt_model(shape, ModelOptions(dtype=torch.float32, init_seed=7, attention=kernel))
            with torch.no_grad():
                logprobs[kernel] = sequence_logprobs(model, tokens)
            modules[kernel] = type(unwrap(model).decoder.layers[0].self_attention.core_attention).__name__
            del model
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
        for name in names:
            os.environ.pop(name, None)
    diff = (logprobs["flash"] - logprobs["unfused"]).abs()
    return {"model": f"{shape.name}, fp32", "core_attention": modules, "max_abs_diff": float(diff.max()),
            "passed": bool(diff.max() < 1e-4)}


def paged_engine_check(exact_yaml: str, device: torch.device) -> dict:
    """The paged engine (megatron_rl/generation/engine.py) on this device, fp32, for the exact dense model and the
    tiny MLA model: its log-probs against the training forward's, and its tokens under a KV budget small enough to
    evict against the unbounded pool's at the same seed (greedy, sampled); and the paged
    kernels this device runs (flash-attn's where installed, else the torch reference) against the reference on
    random paged K/V in bf16 (fp32 on the CPU) with 256-token blocks, GQA, and rows mixing prefill and decode. On a
    GPU it also reports the synchronisations CUDA sees per engine forward (unverified until a device runs it)."""
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.generation.paged_attention import kernels, reference_kvcache, reference_varlen
    from megatron_rl.models.builder import ModelOptions, build_gpt_model
    from megatron_rl.runtime.training import sequence_logprobs

    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    runs = {}
    try:
        for model_name in (str(REPO_ROOT / exact_yaml), "tiny-cpu-deepseek-v3"):
            shape = load_model_shape(model_name)
            model = build_gpt_model(shape, ModelOptions(dtype=torch.float32, init_seed=7))
            gen = torch.Generator().manual_seed(9)
            prompts = [p for p in torch.randint(3, shape.vocab_size, (6, 7), generator=gen).tolist() for _ in range(4)]
            for name, temperature, seed in (("greedy", 0.0, None), ("sampled", 1.0, 3)):
                config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=24, temperature=temperature,
                                      kv_block_tokens=256)
                paged = generate(model, prompts, config, seed=seed)
                budget_gib = 12 * paged.kv_cache_bytes / len(prompts) / 32 / 2**30
                small = generate(model, prompts, dataclasses.replace(config, kv_block_tokens=8,
                                                                     kv_memory_gib=budget_gib), seed=seed)
                rows = [p + t for p, t in zip(prompts, paged.tokens)]
                width = max(map(len, rows))
                with torch.no_grad():
                    full = sequence_logprobs(model, torch.tensor([r + [0] * (width - len(r)) for r in rows],
                                                                 device=device))
                runs[f"{shape.name}_{name}"] = {
                    "syncs_per_forward": _device_syncs_per_forward(model, prompts, config, seed, device),
                    "tokens_equal": small.tokens == paged.tokens, "evictions": small.evictions,
                    "kernels": paged.decode_attention,
                    "logprob_vs_training_forward": max(abs(full[b, len(p) - 1 + i].item() - x)
                                                       for b, (p, lp) in enumerate(zip(prompts, paged.logprobs))
                                                       for i, x in enumerate(lp))}
            del model
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    chosen = kernels(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block, heads, kv_heads, dim = 256, 8, 2, 64
    q_lens, kv_lens = [300, 1, 1, 40], [300, 700, 12, 300]
    gen = torch.Generator().manual_seed(4)
    blocks = sum(-(-n // block) for n in kv_lens) + 2
    k_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(device, dtype)
    order = torch.randperm(blocks, generator=gen).tolist()
    table = torch.zeros(len(kv_lens), max(-(-n // block) for n in kv_lens), dtype=torch.int32)
    used = 0
    for row, n in enumerate(kv_lens):
        count = -(-n // block)
        table[row, :count] = torch.tensor(order[used:used + count], dtype=torch.int32)
        used += count
    table = table.to(device)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(device, dtype)
    cu_q = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.cumsum(torch.tensor(kv_lens), 0).tolist()], dtype=torch.int32, device=device)
    ours = chosen.varlen(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(kv_lens), block_table=table).float()
    ref = reference_varlen(q.float(), k_cache.float(), v_cache.float(), cu_q, cu_k, max(q_lens), max(kv_lens),
                           block_table=table)
    dq = torch.randn(len(kv_lens), 1, heads, dim, generator=gen).to(device, dtype)
    seqlens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    ours_decode = chosen.kvcache(dq, k_cache, v_cache, cache_seqlens=seqlens, block_table=table).float()
    ref_decode = reference_kvcache(dq.float(), k_cache.float(), v_cache.float(), cache_seqlens=seqlens,
                                   block_table=table)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    varlen_diff, decode_diff = float((ours - ref).abs().max()), float((ours_decode - ref_decode).abs().max())
    return {"engine": runs, "kernels": chosen.name, "kernel_dtype": str(dtype).removeprefix("torch."),
            "varlen_max_abs_diff": varlen_diff, "kvcache_max_abs_diff": decode_diff,
            "flash_attn_verified": chosen.name == "flash-attn",
            "passed": all(r["tokens_equal"] and r["evictions"] > 0 and r["logprob_vs_training_forward"] < 1e-4
                          for r in runs.values()) and varlen_diff < tolerance and decode_diff < tolerance}


def _device_syncs_per_forward(model, prompts: list, config, seed, device: torch.device) -> Optional[float]:
    """The host-device synchronisations CUDA reports (``torch.cuda.set_sync_debug_mode``) per engine forward of a
    ``generate`` call (the engine's own: one a decode step, tests/dist/engine_syncs.py; Megatron's forward may add
    its own); None on a CPU."""
    from megatron_rl.generation import generate

    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = generate(model, prompts, config, seed=seed)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught) / out.forward_passes


def packing_check(exact_yaml: str, device: torch.device) -> dict:
    """Packed against padded training-forward log-probs on this device, fp32 (megatron_rl/rollout/packing.py):
    24 rows of 4..40 tokens, padded to the longest in one micro-batch against packed into micro-batches of at most
    64 tokens. The packed attention is what this install's layers take: a block-diagonal mask for Megatron's
    local or SDPA attention, THD (``PackedSeqParams``) for Transformer Engine's, which runs only where TE is
    installed (an NGC container)."""
    import random

    from megatron_rl.models.builder import ModelOptions, build_gpt_model
    from megatron_rl.rollout.batch import RolloutRow, collate_rollout
    from megatron_rl.rollout.packing import pack_minibatch, pack_rows
    from megatron_rl.runtime.training import forward_logprobs
    from megatron_rl.spec.model_shape import load_model_shape

    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        shape = load_model_shape(str(REPO_ROOT / exact_yaml))
        opts = ModelOptions(dtype=torch.float32, init_seed=7)
        model = build_gpt_model(shape, opts)
        rng = random.Random(4)
        rows = []
        for _ in range(24):
            prompt = [rng.randrange(3, shape.vocab_size) for _ in range(rng.randint(3, 8))]
            response = [rng.randrange(3, shape.vocab_size) for _ in range(rng.choice([1, 3, 8, 32]))]
            rows.append(RolloutRow(prompt_ids=prompt, response_ids=response, logprobs=[0.0] * len(response),
                                   advantage=0.0))
        lengths = [r.forward_tokens for r in rows]
        padded = collate_rollout(rows, seq_length=max(lengths), pad_id=0)
        packed, figures = pack_minibatch(rows, dp=1, dp_rank=0, token_budget=64, multiple=1, count_multiple=1,
                                         pad_id=0, thd=opts.takes_packed_sequences(shape))
        (bins,), _ = pack_rows(lengths, dp=1, token_budget=64)
        reference = forward_logprobs([model], [padded], seq_length=max(lengths))[0]
        got = forward_logprobs([model], packed, seq_length=packed[0]["tokens"].shape[1])
        diff = 0.0
        for indices, batch, values in zip(bins, packed, got):
            for j, i in enumerate(indices):
                width = lengths[i]
                mask = batch["loss_mask"][j, :width].bool()
                diff = max(diff, float((values[j, :width][mask] - reference[i, :width][mask]).abs().max()))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    return {"model": f"{shape.name}, fp32", "rows": len(rows), "micro_batches": len(packed),
            "packed_length": int(packed[0]["tokens"].shape[1]), "transformer_engine": opts.transformer_engine,
            "train_tokens_per_real_token": figures["train_tokens"] / figures["real_tokens"],
            "padded_tokens_per_real_token": len(rows) * max(lengths) / sum(lengths),
            "max_abs_diff": diff, "passed": diff < 1e-4}


def lora_check(exact_yaml: str, device: torch.device) -> dict:
    """model.lora on this device's layers (Transformer Engine's linears, LayerNorm-fused ones included, on a GPU
    with TE), fp32: zero-initialised adapters leave the base's log-probs unchanged, and with random B the
    adapters' forward equals the base with B A alpha / r merged into each weight. Twice: the exact model with the
    default targets, tiny-cpu-deepseek-v3 with every MLA projection (TE's TP-replicated ``TELinear`` down
    projections, its norm-fused up projections) and the shared expert, and tiny-cpu-moe's grouped experts (TE's
    grouped GEMM where TE runs, else the torch grouped linears) with one adapter per expert."""
    from megatron_rl.spec.config.schema import LoraConfig

    mla = LoraConfig(rank=4, targets=["linear_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                      "linear_kv_up_proj", "shared_experts.linear_fc1", "shared_experts.linear_fc2"])
    experts = LoraConfig(rank=4, targets=["linear_qkv", "experts.linear_fc1", "experts.linear_fc2"])
    checks = {"dense": _lora_numerics(str(REPO_ROOT / exact_yaml), LoraConfig(rank=4), device),
              "mla": _lora_numerics("tiny-cpu-deepseek-v3", mla, device),
              # grouped experts: TE's grouped GEMM where TE runs, else the torch grouped linears
              "moe_grouped": _lora_numerics("tiny-cpu-moe", experts, device, moe_grouped_gemm=True)}
    return {**checks, "passed": all(check["passed"] for check in checks.values())}


def _lora_numerics(model_name: str, lora, device: torch.device, moe_grouped_gemm=None) -> dict:
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.models.builder import ModelOptions, build_gpt_model
    from megatron_rl.models.lora import adapters, adapters_disabled, merge_adapters
    from megatron_rl.models import unwrap
    from megatron_rl.runtime.training import sequence_logprobs

    shape = load_model_shape(model_name)
    tokens = torch.randint(3, shape.vocab_size, (4, 32), generator=torch.Generator().manual_seed(6)).to(device)
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = build_gpt_model(shape, ModelOptions(dtype=torch.float32, init_seed=7, lora=lora,
                                                    moe_grouped_gemm=moe_grouped_gemm))
        chunks = [model]
        with torch.no_grad():
            at_init = sequence_logprobs(model, tokens)
            with adapters_disabled(chunks):
                base = sequence_logprobs(model, tokens)
            generator = torch.Generator().manual_seed(8)
            for adapter in adapters(chunks):
                adapter.B.copy_(torch.randn(adapter.B.shape, generator=generator).to(adapter.B) * 0.05)
            with_adapters = sequence_logprobs(model, tokens)
            merge_adapters(unwrap(model))
            with adapters_disabled(chunks):
                merged = sequence_logprobs(model, tokens)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    linears = sorted({type(module).__name__ for module in unwrap(model).modules() if hasattr(module, "lora")})
    init_diff = float((at_init - base).abs().max())
    merged_diff = float((with_adapters - merged).abs().max())
    moved = float((with_adapters - base).abs().max())
    return {"model": f"{shape.name}, fp32, rank 4", "adapted_linears": linears, "init_vs_base_max_abs_diff": init_diff,
            "adapters_vs_merged_max_abs_diff": merged_diff, "adapters_moved_logprobs": moved,
            "passed": bool(init_diff == 0.0 and merged_diff < 1e-4 < moved)}


def moe_check(run_dir: str, device: torch.device) -> dict:
    """The MoE path on this device, fp32: the tiny MoE preset (on a GPU with Transformer Engine: TE layers, grouped
    GEMM experts, the all-to-all dispatcher), two training steps, then KV-cache generation against the training
    forward. Layouts over several GPUs (EP, SP, CP) need more than the one GPU this check has."""
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.models import unwrap
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.trainers.common import job_engine
    from megatron_rl.algorithms.lm_loss import lm_loss
    from megatron_rl.data.batches import collate_lm, progression_batch

    cfg = load_config(None, ["model.name=tiny-cpu-moe", "model.dtype=fp32", "algorithm.name=pretrain",
                             "algorithm.global_batch_size=4", "parallel.micro_batch_size=4", f"run.dir={run_dir}/moe"])
    shape = load_model_shape("tiny-cpu-moe")
    engine = job_engine(cfg, shape, total_steps=2)
    losses = []
    for step in (1, 2):
        rows = progression_batch(seed=5, step=step, batch_size=4, seq_length=32, vocab_size=shape.vocab_size)
        losses.append(engine.train_step([collate_lm(rows)], lm_loss, seq_length=32, report_names=("loss",))["loss"])
    prompts = torch.randint(3, shape.vocab_size, (8, 6), generator=torch.Generator().manual_seed(3)).tolist()
    engine.train(False)
    config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=12, temperature=1.0)
    out = generate(engine.chunks, prompts, config, seed=3)
    reference = sequence_logprobs(engine.chunks, padded_sequences(prompts, out.tokens, device))
    mlp = unwrap(engine.chunks[0]).decoder.layers[-1].mlp
    return {"model": f"{shape.name}, fp32", "losses": losses, "experts": type(mlp.experts).__name__,
            "dispatcher": type(mlp.token_dispatcher).__name__,
            "kv_cache_vs_training_forward": judge(compare_logprobs([len(p) for p in prompts], out.tokens,
                                                                   out.logprobs, reference), dtype="fp32")}


def router_replay_check(run_dir: str, dtype: str) -> dict:
    """bench/router_replay.py's measurement on this device: one MoE rollout's log-ratio spread (generation against
    the training forward) with free routing and with the recorded routes replayed; and how many routes flipped."""
    import yaml

    from router_replay import BENCH_MOE, build, ratio_spread

    shape_yaml = Path(run_dir) / "bench-moe.yaml"
    shape_yaml.write_text(yaml.safe_dump(BENCH_MOE))
    engine, shape = build(str(shape_yaml), dtype, f"{run_dir}/router_replay")
    return {"model": f"{shape.name}, {dtype}", **ratio_spread(engine, shape, prompts=32, prompt_len=8, new_tokens=24)}
