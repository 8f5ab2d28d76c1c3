"""Prove the CUDA path on one GPU: a ~1B Llama in bf16 through generation, GRPO and training; one JSON line out.

Run on a GPU (after ``bench/gpu_check.sh`` installed the carried wheels and put the checkout first on
``PYTHONPATH``): ``python3 bench/gpu_check.py --out DIR``. Dry mode, CPU, tiny model, fp32, tiny batch, same code
path: ``.venv/bin/python bench/gpu_check.py --dry-run``. Normally started by ``bench/gpu_check.sh [--rehearse |
--dry-run]``; the rehearsal is tested by ``tests/test_gpu_check.py``.

What it measures, in one process (Megatron Core TP=1, PP=1, the runtime's own ``initialize``) but for part 7:

1. exactness: a tiny tied-embedding Llama in fp32 on the same device: KV-cache generation log-probs against
   the training forward (``sequence_logprobs``), and the same weights in ``transformers`` (log-probs and greedy
   tokens). Tolerance 1e-4 absolute (fp32; the CPU tests measure ~1e-6).
2. training MFU: ``Engine.train_step`` on next-token batches (mbs x seq, no recompute); model FLOPs from the
   planner's ``Workload.model_flops_per_token`` (fwd+bwd, GQA/SwiGLU aware, causal attention unhalved);
   MFU against the planner's bf16 peak for ``--gpu-type``; the planner's prediction for the same layout beside it.
3. colocated generation throughput: greedy decoding of a batch on the training engine's own weights
   (optimizer state resident) against ``transformers`` ``generate`` on a copy of the same weights; the KV-cache
   log-probs of that run against the training forward, and ``transformers``' teacher-forced log-probs.
4. router replay (bench/router_replay.py): a 32-expert top-4 MoE rollout in the main dtype, generation log-probs
   against the training forward with free routing and with the recorded routes replayed; replay must not widen
   the log-ratio spread.
4b. paged engine (megatron_rl/generation/engine.py) on this device: its log-probs against the training forward's
   and its tokens under a KV budget that evicts against an unbounded pool (greedy, sampled), for a dense model and
   the tiny multi-latent-attention model (latent blocks, paged_mla.py); and the paged attention kernels this device runs
   (flash-attn's where installed; else the torch reference, and flash-attn stays unverified) against the torch
   reference on random bf16 paged K/V with 256-token blocks.
4c. decode graphs (generation.cuda_graphs, megatron_rl/generation/graphs.py): on the main model, greedy decoding
   of an odd batch with CUDA graphs captured per row bucket, in two offload phases (captured again in each),
   against the same bucketed steps run eagerly (tokens equal, log-probs within 1e-3) and plain eager decoding
   (ms per engine step, peak memory, log-probs against the training forward), and the offload phases' bytes and
   seconds through the one host buffer, pinned on the GPU. The dry run captures nothing.
5. LoRA: adapters on this device's linears (TE's on a GPU with TE), MLA's and grouped experts' (TE's grouped
   GEMM with TE): zero-init equals the base, and the adapters' forward equals their merged weights.
6. GRPO: ``RLRun`` steps (generate, score, train) with their time split; before each train phase the
   rollout's KV-cache log-probs are checked against the training forward. bf16 tolerance: max |diff| <= 0.25
   nats and mean |diff| <= 0.02 nats (bf16 keeps 8 mantissa bits; decode and full-sequence GEMMs round
   differently).
7. gloo staging (``parallel.backend=gloo`` on GPUs, ``megatron_rl.runtime.gloo_staging``): two ranks started
   here train the tiny model at TP=2 in fp32 (TF32 off) for a few steps over gloo, every collective's CUDA
   tensors staged through pinned CPU buffers, against the same job over NCCL on 2+ GPUs; on one GPU (NCCL cannot
   put two ranks on one device) both gloo ranks share it and the reference is the same job on the CPU. Both start
   from the same weights (initialisation draws on the CPU on every device: ``models/builder.py``), which the part
   checks by a digest of rank 0's initial parameters. Reported: max |loss diff| and |grad-norm diff|, the staged
   ops and their call counts. Unverified on a GPU so far (the
   project's machines had none when it was written); the dry run compares the CPU test hook
   (``MEGATRON_RL_GLOO_STAGING=1``: CPU tensors staged through separate CPU buffers) with plain gloo, exactly.

Prints progress on stderr and, last on stdout, one JSON object with every figure; writes it to
``OUT/gpu_check.json`` (part 7's rank logs: ``OUT/gloo_staging_*_rank*.log``). Exit code 0 when every check
passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
try:  # the installed wheel on the GPU machine; the source tree (editable install or checkout) elsewhere
    import launcher  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO_ROOT))

import torch

from gpu_check_parts import (attention_kernels_check, exactness_check, lora_check, moe_check,  # noqa: E402
                             packing_check, paged_engine_check, router_replay_check)
from hf_reference import (compare_logprobs, hf_generate, hf_logprobs, judge, megatron_to_hf,  # noqa: E402
                          padded_sequences, token_agreement)
from megatron_rl.spec.ports import free_port

GLOO_TP2_STEPS = 3
GLOO_TP2_TOL = {"dry-run": 1e-6, "nccl": 1e-5, "cpu": 1e-4}
"""Part 7's tolerance on |loss| and |grad-norm| differences by reference: the same CPU job unstaged (identical
sums expected), NCCL on the same GPUs (fp32, TF32 off), the CPU (other kernels)."""


@dataclass(frozen=True, kw_only=True)
class CheckSizes:
    """Model and workload sizes of one check run."""

    model: str
    """Megatron-style model YAML (path relative to the repository root)."""
    dtype: str
    """Compute dtype of the main model: bf16 or fp32."""
    exact_model: str
    """Model YAML of the fp32 exactness check (built with tied embeddings)."""
    gen_batch: int
    """Sequences decoded at once in the throughput run."""
    gen_prompt_len: int
    """Prompt tokens per sequence in the throughput run."""
    gen_new_tokens: int
    """Tokens generated per sequence in the throughput run (no early stop)."""
    gen_repeats: int
    """Timed runs of each generator (after one untimed run each); the median is reported."""
    mfu_seq: int
    """Sequence length of the training-MFU steps."""
    mfu_micro_batch: int
    """Micro-batch size of the training-MFU steps."""
    mfu_global_batch: int
    """Sequences per training-MFU step."""
    mfu_warmup_steps: int
    """Untimed training steps first."""
    mfu_steps: int
    """Timed training steps."""
    grpo_prompts: int
    """GRPO prompts per step."""
    grpo_group: int
    """GRPO completions per prompt."""
    grpo_micro_batch: int
    """GRPO training micro-batch size."""
    grpo_new_tokens: int
    """GRPO max_new_tokens."""
    grpo_steps: int
    """GRPO steps; the first is reported as cold, the last as warm."""


GPU_SIZES = CheckSizes(
    model="bench/llama-1b.yaml", dtype="bf16", exact_model="configs/models/tiny-cpu.yaml",
    gen_batch=64, gen_prompt_len=32, gen_new_tokens=128, gen_repeats=3,
    mfu_seq=2048, mfu_micro_batch=4, mfu_global_batch=16, mfu_warmup_steps=2, mfu_steps=3,
    grpo_prompts=8, grpo_group=8, grpo_micro_batch=16, grpo_new_tokens=128, grpo_steps=2)
DRY_SIZES = CheckSizes(
    model="configs/models/tiny-cpu.yaml", dtype="fp32", exact_model="configs/models/tiny-cpu.yaml",
    gen_batch=4, gen_prompt_len=8, gen_new_tokens=8, gen_repeats=2,
    mfu_seq=64, mfu_micro_batch=2, mfu_global_batch=4, mfu_warmup_steps=1, mfu_steps=2,
    grpo_prompts=2, grpo_group=4, grpo_micro_batch=4, grpo_new_tokens=8, grpo_steps=2)


def say(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(result, seconds) with the device synchronised before and after."""
    sync()
    started = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - started


def training_mfu(engine, shape, sizes: CheckSizes, gpu_type: str) -> dict:
    """Timed next-token training steps on the engine; model FLOPs and MFU from the planner's cost model."""
    from launcher.planner.costs import Workload
    from launcher.planner.gpus import get_gpu
    from megatron_rl.runtime.phases import training_phase
    from megatron_rl.algorithms.lm_loss import lm_loss
    from megatron_rl.data.batches import collate_lm, progression_batch

    gpu = get_gpu(gpu_type)
    workload = Workload(shape=shape, gpu=gpu, num_gpus=1, seq_length=sizes.mfu_seq,
                        global_batch_size=sizes.mfu_global_batch)
    flops_per_token = workload.model_flops_per_token()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    with training_phase(engine):
        for step in range(sizes.mfu_warmup_steps + sizes.mfu_steps):
            rows = progression_batch(seed=11, step=step, batch_size=sizes.mfu_global_batch,
                                     seq_length=sizes.mfu_seq, vocab_size=shape.vocab_size)
            micro = [collate_lm(rows[i:i + sizes.mfu_micro_batch])
                     for i in range(0, sizes.mfu_global_batch, sizes.mfu_micro_batch)]
            metrics, seconds = timed(lambda: engine.train_step(micro, lm_loss, seq_length=sizes.mfu_seq,
                                                               report_names=("loss",)))
            losses.append(metrics["loss"])
            if step >= sizes.mfu_warmup_steps:
                times.append(seconds)
    step_s = statistics.median(times)
    tokens = sizes.mfu_global_batch * sizes.mfu_seq
    achieved = flops_per_token * tokens / step_s
    return {
        "seq_length": sizes.mfu_seq, "micro_batch_size": sizes.mfu_micro_batch,
        "global_batch_size": sizes.mfu_global_batch, "recompute": "none", "timed_steps": len(times),
        "step_time_s": step_s, "step_times_s": times, "tokens_per_s": tokens / step_s,
        "model_flops_per_token": flops_per_token,
        "flops_source": "launcher.planner.costs.Workload.model_flops_per_token (fwd+bwd = 3x fwd; "
                        "fwd = 2*(attention+MLP params) + 2*seq*heads*(dqk+dv) per layer + 2*hidden*vocab)",
        "achieved_tflops": achieved / 1e12, "peak_tflops": gpu.bf16_tflops, "peak_source": f"{gpu.name} bf16 dense",
        "mfu": achieved / (gpu.bf16_tflops * 1e12),
        "loss_first": losses[0], "loss_last": losses[-1],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }


def generation_throughput(engine, shape, sizes: CheckSizes, dtype: torch.dtype, device: torch.device) -> dict:
    """Greedy decoding on the training engine vs transformers generate on a copy of the weights."""
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.models import unwrap
    from megatron_rl.runtime.phases import generation_phase
    from megatron_rl.data.batches import progression_batch

    prompt_tensor = progression_batch(seed=5, step=0, batch_size=sizes.gen_batch,
                                      seq_length=sizes.gen_prompt_len - 1, vocab_size=shape.vocab_size)
    prompts = prompt_tensor.tolist()
    prompt_on_device = prompt_tensor.to(device)
    hf = megatron_to_hf(unwrap(engine.chunks[0]), shape, dtype=dtype, device=device)
    config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=sizes.gen_new_tokens, temperature=0.0)

    def ours():
        with generation_phase(engine):
            return generate(engine.chunks, prompts, config)

    def theirs():
        return hf_generate(hf, prompt_on_device, sizes.gen_new_tokens).tolist()

    (first, ours_first_s), (hf_tokens, hf_first_s) = timed(ours), timed(theirs)
    times: dict[str, list[float]] = {"ours": [], "transformers": []}
    for _ in range(sizes.gen_repeats):
        for name, fn in (("ours", ours), ("transformers", theirs)):
            times[name].append(timed(fn)[1])
    tokens = padded_sequences(prompts, first.tokens, device)
    with generation_phase(engine):
        reference = sequence_logprobs(engine.chunks, tokens)
    theirs_lp = hf_logprobs(hf, tokens)
    start = sizes.gen_prompt_len - 1
    hf_diff = (reference[:, start:] - theirs_lp[:, start:]).abs()
    attn = getattr(hf.config, "_attn_implementation", None)
    hf = None  # frees the copy's memory before the next check
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    new_tokens = sizes.gen_batch * sizes.gen_new_tokens
    ours_s, hf_s = statistics.median(times["ours"]), statistics.median(times["transformers"])
    return {
        "batch": sizes.gen_batch, "prompt_len": sizes.gen_prompt_len, "new_tokens": sizes.gen_new_tokens,
        "decoding": "greedy", "repeats": sizes.gen_repeats,
        "ours_s_median": ours_s, "ours_tokens_per_s": new_tokens / ours_s, "ours_s_all": times["ours"],
        "ours_first_call_s": ours_first_s, "forward_passes": first.forward_passes,
        "kv_cache_gib": first.kv_cache_bytes / 2**30,
        "transformers_s_median": hf_s, "transformers_tokens_per_s": new_tokens / hf_s,
        "transformers_s_all": times["transformers"], "transformers_first_call_s": hf_first_s,
        "transformers_attn_implementation": attn,
        "speedup_vs_transformers": hf_s / ours_s,
        "greedy_tokens_vs_transformers": token_agreement(first.tokens, hf_tokens),
        "kv_cache_vs_training_forward": judge(compare_logprobs([len(p) for p in prompts], first.tokens,
                                                               first.logprobs, reference), dtype=sizes.dtype),
        "transformers_vs_training_forward": {"tokens": int(hf_diff.numel()), "max_abs_diff": float(hf_diff.max()),
                                             "mean_abs_diff": float(hf_diff.mean())},
    }


def decode_graphs(engine, shape, sizes: CheckSizes, device: torch.device) -> dict:
    """generation.cuda_graphs (megatron_rl/generation/graphs.py) on the main model: greedy decoding of an odd batch
    (rows padded to the next bucket) with decode graphs, each call in its own offload phase (the optimizer's and
    the grads' storage leave and come back between them, and the call captures again); against the same bucketed
    steps run eagerly (the CPU path: the same kernels on the same shapes, so equal), and against plain eager
    decoding (time per engine step, peak memory; the log-probs against the training forward). The four phases'
    optimizer offload is reported too: bytes and seconds per phase, through one host buffer that must be pinned
    (``runtime/phases.host_buffer``: cudaHostRegister at its exact size)."""
    from unittest import mock

    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.generation.graphs import DecodeGraphs
    from megatron_rl.runtime.phases import generation_phase, offload_metrics
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.data.batches import progression_batch

    rows = max(3, sizes.gen_batch // 5 + 1)  # 13 on the GPU: bucket 16
    batch = progression_batch(seed=8, step=0, batch_size=rows, seq_length=sizes.gen_prompt_len - 1,
                              vocab_size=shape.vocab_size).tolist()
    prompts = [p[:len(p) - i % 5] for i, p in enumerate(batch)]  # uneven lengths: a mixed first step

    def run(cuda_graphs: bool) -> tuple:
        with generation_phase(engine, offload_optimizer=True):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=sizes.gen_new_tokens, temperature=0.0,
                                  cuda_graphs=cuda_graphs)
            out, seconds = timed(lambda: generate(engine.chunks, prompts, config))
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        return out, seconds, peak

    offload_metrics(engine)  # the figures of the four phases below only
    eager, eager_s, eager_peak = run(False)
    graphs, graphs_s, graphs_peak = run(True)
    again, again_s, _ = run(True)  # another phase: captured again
    with mock.patch.object(DecodeGraphs, "run", lambda self, bucket, forward: forward()):
        bucketed, bucketed_s, _ = run(True)
    tokens = padded_sequences(prompts, graphs.tokens, device)
    with generation_phase(engine):
        reference = sequence_logprobs(engine.chunks, tokens)
    vs_forward = judge(compare_logprobs([len(p) for p in prompts], graphs.tokens, graphs.logprobs, reference),
                       dtype=sizes.dtype)
    lp_diff = max(abs(a - b) for x, y in zip(graphs.logprobs, bucketed.logprobs) for a, b in zip(x, y))
    replay_equal = graphs.tokens == bucketed.tokens and lp_diff <= 1e-3 and again.tokens == graphs.tokens
    per_step = lambda out, seconds: 1e3 * seconds / out.forward_passes  # noqa: E731
    moved = offload_metrics(engine)
    host = engine.host_offload.host_buffer
    offload = {"phases": 4, "bytes_per_phase": moved["offload_bytes"] / 4,
               "offload_s_per_phase": moved["offload_s"] / 4, "restore_s_per_phase": moved["offload_restore_s"] / 4,
               "host_buffer_bytes": None if host is None else host.numel(),
               "host_buffer_pinned": None if host is None or device.type != "cuda" else bool(host.is_pinned())}
    return {
        "rows": rows, "new_tokens": sizes.gen_new_tokens, "captured": device.type == "cuda",
        "graph_steps": graphs.decode_graph_steps, "forward_passes": graphs.forward_passes,
        "replay_vs_bucketed_eager": {"tokens_equal": graphs.tokens == bucketed.tokens, "max_abs_logprob_diff": lp_diff},
        "second_phase_tokens_equal": again.tokens == graphs.tokens,
        "tokens_vs_eager": token_agreement(graphs.tokens, eager.tokens),
        "graphs_vs_training_forward": vs_forward,
        "ms_per_step": {"eager": per_step(eager, eager_s), "graphs_first_call": per_step(graphs, graphs_s),
                        "graphs": per_step(again, again_s), "bucketed_eager": per_step(bucketed, bucketed_s)},
        "speedup_vs_eager": eager_s / again_s,
        "peak_memory_gib": {"eager": eager_peak, "graphs": graphs_peak},
        "optimizer_offload": offload,
        "passed": bool(replay_equal and graphs.decode_graph_steps > 0 and vs_forward["passed"]
                       and moved["offload_bytes"] > 0 and offload["host_buffer_pinned"] is not False),
    }


def grpo_steps(run, sizes: CheckSizes, device: torch.device) -> dict:
    """GRPO steps (generate, score, train); the rollout log-prob check sits outside the timed phases."""
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.runtime.phases import generation_phase
    from megatron_rl.rl.sources import SampledBatch

    steps, checks = [], []
    for step in range(1, sizes.grpo_steps + 1):
        prompts = run.sampler.next_batch()
        rollout, t_gen = timed(lambda: run.generate(prompts))
        _, t_score = timed(lambda: run.score(rollout))
        tokens = padded_sequences(rollout.prompt_ids, rollout.response_ids, device)
        with generation_phase(run.engine):
            reference = sequence_logprobs(run.engine.chunks, tokens)
        checks.append(compare_logprobs([len(p) for p in rollout.prompt_ids], rollout.response_ids,
                                       rollout.logprobs, reference))
        train, t_train = timed(lambda: run.train_on(rollout, step))
        sampled = SampledBatch(drawn=rollout, kept=rollout, draws=1, sample_s=t_gen, score_s=t_score)
        metrics = run.step_metrics(sampled, train, t_train)
        steps.append({k: metrics[k] for k in (
            "time_generate_s", "time_score_s", "time_train_s", "step_time_s", "generate_tokens_per_s",
            "train_tokens_per_s", "response_length", "reward_mean", "loss", "first_ratio_min", "first_ratio_max")
            if k in metrics} | {"completions": len(rollout.response_ids), "train_seq_length": rollout.seq_length})
    merged = {"tokens": sum(c["tokens"] for c in checks),
              "max_abs_diff": max(c["max_abs_diff"] for c in checks),
              "mean_abs_diff": sum(c["mean_abs_diff"] * c["tokens"] for c in checks)
              / max(1, sum(c["tokens"] for c in checks))}
    return {"prompts_per_step": sizes.grpo_prompts, "group_size": sizes.grpo_group,
            "max_new_tokens": sizes.grpo_new_tokens, "temperature": 1.0, "steps": len(steps),
            "cold": steps[0], "warm": steps[-1],
            "kv_cache_vs_training_forward": judge(merged, dtype=sizes.dtype)}


def gloo_tp2_worker(backend: str, out: Path) -> int:
    """One rank of part 7's job: the tiny model at TP=2 in fp32, GLOO_TP2_STEPS next-token steps over ``backend``;
    rank 0 writes the losses, grad norms and gloo staging's call counts to ``out``."""
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.runtime import gloo_staging
    from megatron_rl.runtime.distributed import global_rank, initialize, job_dims, shutdown
    from megatron_rl.models import unwrap
    from megatron_rl.trainers.common import job_engine
    from megatron_rl.algorithms.lm_loss import lm_loss
    from megatron_rl.data.batches import collate_lm, progression_batch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory(prefix="gpu_check_gloo_tp2_") as run_dir:
        cfg = load_config(None, ["model.name=tiny-cpu", "model.dtype=fp32", "algorithm.name=pretrain",
                                 "algorithm.global_batch_size=4", "parallel.micro_batch_size=2", "parallel.tp=2",
                                 f"parallel.backend={backend}", f"run.dir={run_dir}"])
        shape = load_model_shape("tiny-cpu")
        initialize(job_dims(tp=2), seed=cfg.run.seed, backend=backend)
        try:
            engine = job_engine(cfg, shape, total_steps=GLOO_TP2_STEPS)
            initial = hashlib.sha256()
            for chunk in engine.chunks:
                for name, param in sorted(unwrap(chunk).named_parameters()):
                    initial.update(name.encode() + param.detach().cpu().numpy().tobytes())
            losses, grad_norms = [], []
            for step in range(1, GLOO_TP2_STEPS + 1):
                rows = progression_batch(seed=5, step=step, batch_size=4, seq_length=32, vocab_size=shape.vocab_size)
                metrics = engine.train_step([collate_lm(rows[:2]), collate_lm(rows[2:])], lm_loss, seq_length=32,
                                            report_names=("loss",))
                losses.append(metrics["loss"])
                grad_norms.append(metrics["grad_norm"])
            if global_rank() == 0:
                out.write_text(json.dumps({
                    "backend": backend, "device": "cuda" if torch.cuda.is_available() else "cpu",
                    "staging_installed": gloo_staging.is_installed(), "staged_calls": gloo_staging.staged_counts(),
                    "initial_weights_sha256": initial.hexdigest(), "losses": losses, "grad_norms": grad_norms}))
        finally:
            shutdown()
    return 0


def run_gloo_tp2_job(label: str, backend: str, out: Path, *, local_ranks: tuple[int, int],
                     env: dict[str, str]) -> dict:
    """Start the two ranks of ``gloo_tp2_worker`` (logs in OUT/gloo_staging_LABEL_rankR.log); rank 0's figures."""
    result_path = out / f"gloo_staging_{label}.json"
    common = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              "OMP_NUM_THREADS": "1", **env}
    procs = []
    try:
        for rank, local_rank in enumerate(local_ranks):
            with open(out / f"gloo_staging_{label}_rank{rank}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--gloo-tp2-worker", backend, "--out",
                     str(result_path)],
                    env={**common, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}, stdout=log,
                    stderr=subprocess.STDOUT))
        codes = [proc.wait(timeout=150) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if codes != [0, 0]:
        raise RuntimeError(f"gloo TP=2 job {label}: exit codes {codes} (see {out}/gloo_staging_{label}_rank*.log)")
    return json.loads(result_path.read_text())


def gloo_staging_check(out: Path, *, dry_run: bool) -> dict:
    """Part 7: TP=2 over gloo with staged CUDA tensors against NCCL (2+ GPUs), the CPU (one GPU), or in the dry run
    the CPU test hook against plain gloo."""
    from megatron_rl.runtime.gloo_staging import STAGE_EVERY_TENSOR_ENV

    gpus = torch.cuda.device_count()
    staged_env, reference_env = {STAGE_EVERY_TENSOR_ENV: "1" if dry_run else "0"}, {STAGE_EVERY_TENSOR_ENV: "0"}
    staged_ranks = reference_ranks = (0, 1)
    if dry_run:
        reference_kind = "dry-run"
    elif gpus >= 2:
        reference_kind = "nccl"
    else:  # both ranks on the one GPU (LOCAL_RANK picks the device); NCCL refuses two ranks on one device
        reference_kind, staged_ranks = "cpu", (0, 0)
        reference_env["CUDA_VISIBLE_DEVICES"] = ""
    staged = run_gloo_tp2_job("staged", "gloo", out, local_ranks=staged_ranks, env=staged_env)
    reference = run_gloo_tp2_job("reference", "nccl" if reference_kind == "nccl" else "gloo", out,
                                 local_ranks=reference_ranks, env=reference_env)
    loss_diff = max(abs(a - b) for a, b in zip(staged["losses"], reference["losses"], strict=True))
    norm_diff = max(abs(a - b) for a, b in zip(staged["grad_norms"], reference["grad_norms"], strict=True))
    tol = GLOO_TP2_TOL[reference_kind]
    staged_ops = sorted({site.split("@")[0] for site in staged["staged_calls"]})
    return {
        "layout": "tp=2 on 2 ranks, tiny-cpu fp32", "steps": GLOO_TP2_STEPS, "gpus": gpus,
        "staged": {k: staged[k] for k in ("backend", "device", "losses", "grad_norms")},
        "reference": {"kind": reference_kind,
                      **{k: reference[k] for k in ("backend", "device", "losses", "grad_norms")}},
        "max_abs_loss_diff": loss_diff, "max_abs_grad_norm_diff": norm_diff, "tolerance": tol,
        "staged_ops": staged_ops, "staged_calls_rank0": staged["staged_calls"],
        "initial_weights_equal": staged["initial_weights_sha256"] == reference["initial_weights_sha256"],
        "passed": bool(staged["staging_installed"] and not reference["staging_installed"]
                       and staged["initial_weights_sha256"] == reference["initial_weights_sha256"]
                       and {"all_reduce", "all_gather_into_tensor"} <= set(staged_ops)
                       and loss_diff <= tol and norm_diff <= tol),
    }


def planner_predictions(shape, model_yaml: str, sizes: CheckSizes, gpu_type: str, grpo: dict) -> dict:
    """The planner's single-GPU predictions for the measured training step and GRPO step."""
    from launcher.planner import GrpoSizing, Runtime, evaluate

    layout = f"tp=1,pp=1,mbs={sizes.mfu_micro_batch},recompute=none"
    common = dict(num_gpus=1, gpu_type=gpu_type, seq_length=sizes.mfu_seq,
                  global_batch_size=sizes.mfu_global_batch, mode="pretrain")
    default = evaluate(shape, layout, **common)
    unfused = evaluate(shape, layout, runtime=Runtime(flash_attention=False), **common)
    seq = grpo.get("warm", {}).get("train_seq_length", 16 + sizes.grpo_new_tokens - 1) + 1
    prompt_len = seq - sizes.grpo_new_tokens
    completions = sizes.grpo_prompts * sizes.grpo_group
    grpo_plan = evaluate(shape, f"tp=1,pp=1,mbs={sizes.grpo_micro_batch},recompute=none", num_gpus=1,
                         gpu_type=gpu_type, seq_length=seq, global_batch_size=completions,
                         mode="grpo", runtime=Runtime(flash_attention=False),
                         grpo=GrpoSizing(rollout_batch_size=completions, max_prompt_length=max(1, prompt_len),
                                         max_response_length=sizes.grpo_new_tokens, reference_model=False,
                                         kv_cache_released_for_training=True))
    def predicted(plan) -> dict:
        e = plan.estimate
        return {"step_time_s": e.step_time_s, "mfu": e.mfu, "tokens_per_s": e.tokens_per_s_per_gpu,
                "memory_total_gib": plan.memory["total"], "fits": plan.fits}

    return {
        "cli": f"python launch.py plan --model {model_yaml} --gpus 1 --gpu-type {gpu_type} --layout {layout} "
               f"--seq-len {sizes.mfu_seq} --global-batch-size {sizes.mfu_global_batch} --json",
        "training_default_runtime": {**predicted(default),
                                     "note": "planner default: flash attention (Transformer Engine)"},
        "training_unfused_attention": {**predicted(unfused),
                                       "note": "Runtime(flash_attention=False): what the local spec runs"},
        "grpo_step_unfused_attention": predicted(grpo_plan),
    }


# ------------------------------------------------------------------------------------------ main
def environment(device: torch.device) -> dict:
    import megatron.core

    from megatron_rl.models.builder import have_transformer_engine
    from megatron_rl.runtime import cpu_compat

    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    import launcher as launcher_pkg
    import megatron_rl

    return {
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "megatron_core": getattr(megatron.core, "__version__", None), "transformers": hf_version,
        "transformer_engine": have_transformer_engine(),
        "layer_spec": "transformer_engine" if have_transformer_engine() else "local",
        "cpu_redirection_active": cpu_compat.is_active(),
        "cpu_redirections": sum(cpu_compat.redirect_counts().values()),
        "package_path": str(Path(megatron_rl.__file__).parent.parent),
        "launcher_path": str(Path(launcher_pkg.__file__).parent),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
    }


def job_overrides(sizes: CheckSizes, run_dir: str) -> list[str]:
    completions = sizes.grpo_prompts * sizes.grpo_group
    return [f"model.name={REPO_ROOT / sizes.model}", f"model.dtype={sizes.dtype}", f"run.dir={run_dir}",
            "run.steps=100", "run.seed=1234", "algorithm.name=grpo",
            f"algorithm.prompts_per_step={sizes.grpo_prompts}", f"algorithm.group_size={sizes.grpo_group}",
            f"algorithm.global_batch_size={completions}", "algorithm.kl_coef=0.0", "algorithm.sft_warmup_steps=0",
            f"parallel.micro_batch_size={sizes.grpo_micro_batch}", f"generation.max_new_tokens={sizes.grpo_new_tokens}",
            "generation.temperature=1.0", "optimizer.lr=1.0e-4", "optimizer.lr_warmup_steps=0",
            "logging.console=quiet", "logging.tensorboard=false",
            "checkpoint.save_at_end=false", "checkpoint.resume=false"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, fp32, tiny batch")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="folder for the JSON")
    parser.add_argument("--gpu-type", default="h200-141gb", help="planner GPU type for MFU and predictions")
    parser.add_argument("--install-summary", default=None, help="gpu_check.sh: what step 1 installed")
    parser.add_argument("--install-rc", type=int, default=None, help="gpu_check.sh: step 1 exit code")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                        help="main model dtype (default: bf16 on the GPU, fp32 in the dry run)")
    parser.add_argument("--gloo-tp2-worker", choices=("gloo", "nccl"), default=None,
                        help="internal: one rank of part 7's TP=2 job over this backend, figures to --out (a file)")
    args = parser.parse_args(argv)
    if args.gloo_tp2_worker:
        return gloo_tp2_worker(args.gloo_tp2_worker, Path(args.out))
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    if args.dtype:
        sizes = dataclasses.replace(sizes, dtype=args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["MASTER_PORT"] = str(free_port())
    if not args.dry_run and not torch.cuda.is_available():
        say("CUDA is not available: run on a GPU, or pass --dry-run for the CPU check")
        return 2
    started = time.perf_counter()

    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.models import unwrap
    from megatron_rl.runtime.distributed import initialize, job_dims, shutdown
    from megatron_rl.trainers.common import TrainerContext
    from megatron_rl.trainers.rl import RLRun

    result: dict[str, Any] = {"mode": "dry-run" if args.dry_run else "gpu", "sizes": asdict(sizes)}
    if args.install_summary is not None or args.install_rc is not None:
        result["install"] = {"rc": args.install_rc, "summary": args.install_summary}
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    errors: list[str] = []

    def attempt(key: str, fn: Callable[[], Any]) -> Any:
        """One part of the check; its failure is recorded and the independent parts still run."""
        say(key)
        try:
            result[key] = fn()
        except StoppedBySigterm:
            raise
        except Exception as exc:
            traceback.print_exc()
            result[key] = {"error": f"{type(exc).__name__}: {exc}"}
            errors.append(key)
            return None
        return result[key]

    with tempfile.TemporaryDirectory(prefix="gpu_check_run_") as run_dir:
        try:
            cfg = load_config(None, job_overrides(sizes, run_dir))
            initialize(job_dims(), seed=cfg.run.seed)
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
            dtype = torch.bfloat16 if sizes.dtype == "bf16" else torch.float32
            result["environment"] = environment(device)
            say(f"environment: {json.dumps(result['environment'])}")
            attempt("exactness_fp32", lambda: exactness_check(sizes.exact_model, device))
            attempt("moe", lambda: moe_check(run_dir, device))
            attempt("attention_kernels", lambda: attention_kernels_check(sizes.exact_model, device))
            attempt("paged_engine", lambda: paged_engine_check(sizes.exact_model, device))
            attempt("packing", lambda: packing_check(sizes.exact_model, device))
            attempt("lora", lambda: lora_check(sizes.exact_model, device))
            attempt("router_replay", lambda: router_replay_check(run_dir, sizes.dtype))
            shape = load_model_shape(str(REPO_ROOT / sizes.model))
            holder: dict[str, Any] = {}

            def build() -> dict:
                holder["run"], build_s = timed(lambda: RLRun(cfg, shape, TrainerContext(cfg)))
                signal.signal(signal.SIGTERM, _stop_on_sigterm)  # TrainerContext installed its preemption flag
                params = sum(p.numel() for chunk in holder["run"].engine.chunks for p in chunk.parameters())
                return {"name": shape.name, "yaml": sizes.model, "dtype": sizes.dtype, "params": params,
                        "planner_params": shape.num_params(), "build_s": build_s,
                        "core_attention": type(unwrap(holder["run"].engine.chunks[0]).decoder.layers[0]
                                               .self_attention.core_attention).__name__}

            if attempt("model", build) is not None:
                engine = holder["run"].engine
                attempt("training", lambda: training_mfu(engine, shape, sizes, args.gpu_type))
                attempt("generation", lambda: generation_throughput(engine, shape, sizes, dtype, device))
                attempt("decode_graphs", lambda: decode_graphs(engine, shape, sizes, device))
                attempt("grpo", lambda: grpo_steps(holder["run"], sizes, device))
            attempt("planner", lambda: planner_predictions(shape, sizes.model, sizes, args.gpu_type,
                                                           result.get("grpo", {})))
            attempt("gloo_staging", lambda: gloo_staging_check(out, dry_run=args.dry_run))
            if torch.cuda.is_available():
                result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as exc:  # the JSON line must still come out, with what failed
            traceback.print_exc()
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            shutdown()
    if errors:
        result["failed_parts"] = errors
    result["checks"] = checks_of(result, dry_run=args.dry_run)
    result["passed"] = all(result["checks"].values()) and "error" not in result and not errors
    result["wall_s"] = time.perf_counter() - started
    line = json.dumps(result)
    (out / "gpu_check.json").write_text(line + "\n")
    print(line, flush=True)
    return 0 if result["passed"] else 1


class StoppedBySigterm(RuntimeError):
    """gpu_check.sh's timeout fired: the JSON still goes out with the figures measured so far."""


def _stop_on_sigterm(signum, frame) -> None:
    raise StoppedBySigterm("SIGTERM (time limit) before the check finished")


def checks_of(result: dict, *, dry_run: bool) -> dict[str, bool]:
    """Named pass/fail flags; the CPU redirection must be on in dry mode and off on a GPU."""
    env = result.get("environment", {})

    def flag(*path: str) -> bool:
        node: Any = result
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return False
            node = node[key]
        return bool(node)

    checks = {
        "cpu_redirection_as_expected": env.get("cpu_redirection_active") is dry_run
        and (dry_run or env.get("cpu_redirections") == 0),
        "exact_kv_cache_logprobs": flag("exactness_fp32", "kv_cache_vs_training_forward", "passed"),
        "exact_transformers_logprobs": flag("exactness_fp32", "transformers_vs_training_forward", "passed"),
        "generation_kv_cache_logprobs": flag("generation", "kv_cache_vs_training_forward", "passed"),
        "grpo_kv_cache_logprobs": flag("grpo", "kv_cache_vs_training_forward", "passed"),
        "moe_kv_cache_logprobs": flag("moe", "kv_cache_vs_training_forward", "passed"),
        "attention_kernels_agree": flag("attention_kernels", "passed"),
        "paged_engine_matches_training_forward": flag("paged_engine", "passed"),
        "decode_graphs_replay_equals_eager": flag("decode_graphs", "passed"),
        "packed_logprobs_equal_padded": flag("packing", "passed"),
        "lora_adapters_equal_merged_weights": flag("lora", "passed"),
        "gloo_staging_matches_reference": flag("gloo_staging", "passed"),
        "router_replay_narrows_ratio": flag("router_replay", "router_replay")
        and result["router_replay"]["router_replay"]["log_ratio_max_abs"]
        <= result["router_replay"]["free_routing"]["log_ratio_max_abs"] + 1e-6,
    }
    if result.get("install", {}).get("rc") is not None:
        checks["install"] = result["install"]["rc"] == 0
    return checks


if __name__ == "__main__":
    sys.exit(main())
