"""Time a full layout search for a 1T-parameter GPT on 16,384 H100s, and the search of every shipped post-training
config.

Run: ``.venv/bin/python bench/plan_speed.py``. The last line is one JSON object:
  search_s            median wall time of plan() (every legal layout, with the pruning that cannot change the
                      answer: weights-only memory check, first fitting recompute mode per layout and micro-batch,
                      a recompute mode that overflowed at a smaller micro-batch skipped, the time model run only
                      for layouts that fit)
  reference_s         median wall time of the same search with no pruning (every candidate estimated), timed side
                      by side on the same machine; speedup = reference_s / search_s
  considered          candidate layouts enumerated; evaluated = layouts whose memory was estimated (and time, if they fit)
  rl_search_s         per shipped post-training config (configs/*.yaml with algorithm grpo, ppo, dpo or eval):
                      wall time of its plan's search, as ``launch.py plan --config`` runs it (median of REPEATS),
                      or the one-line reason it has none; rl_evaluated: the layouts each search estimated;
                      rl_plan_cpu_s: CPU seconds of the whole plan_job call (runner-up included), which a loaded
                      shared machine inflates less than wall time (load_average_1min says how loaded)
  rl_target_s         the issue's bar for each of those searches (3 s); rl_speedup = rl_target_s / the slowest
                      (the reference here is the target: the previous implementation is not kept callable)
The model is Narayanan et al.'s GPT-1T (128 layers, hidden 25600, 160 heads, ffn 102400, vocab 51200), seq 2048,
global batch 4096 sequences, bf16.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.spec.model_shape import shape_from_megatron_dict  # noqa: E402
from launcher.planner import plan  # noqa: E402
from launcher.planner.costs import Runtime, Workload  # noqa: E402
from launcher.planner.gpus import get_gpu  # noqa: E402
from launcher.planner.report import layout_line  # noqa: E402
from launcher.planner.search import search  # noqa: E402

GPT_1T = dict(name="gpt-1t", family="gpt", num_layers=128, hidden_size=25600, ffn_hidden_size=102400,
              num_attention_heads=160, num_query_groups=160, kv_channels=160, vocab_size=51200, seq_length=2048,
              gated_linear_unit=False, normalization="LayerNorm", position_embedding_type="rope")
GPUS, GPU_TYPE, GLOBAL_BATCH, REPEATS = 16384, "h100-80gb", 4096, 5


def _median_time(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


RL_ALGORITHMS = ("grpo", "ppo", "dpo", "eval")
RL_TARGET_S = 3.0


def rl_search_times() -> tuple[dict[str, float | str], dict[str, int], dict[str, float]]:
    """Median search seconds of every shipped post-training config's plan (or the one-line reason it has none),
    the layouts each search estimated, and the CPU seconds of its whole plan_job call. Files that are not one
    job's config (pipelines) are skipped."""
    from omegaconf.errors import OmegaConfBaseException

    from megatron_rl.spec.config.loader import given_keys, load_config
    from megatron_rl.spec.errors import ConfigError
    from launcher.job import load_shape, plan_job

    seconds: dict[str, float | str] = {}
    evaluated: dict[str, int] = {}
    cpu_seconds: dict[str, float] = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")):
        try:
            cfg = load_config(str(path), [], allow_missing=True)
        except (ConfigError, OmegaConfBaseException):
            continue  # a pipeline of stages, not a job
        if cfg.algorithm.name not in RL_ALGORITHMS:
            continue
        shape = load_shape(cfg.model.name)
        given = given_keys(str(path), [])
        try:
            results, cpu = [], []
            for _ in range(REPEATS):
                start = time.process_time()
                results.append(plan_job(cfg, shape, given=given))
                cpu.append(time.process_time() - start)
        except ConfigError as exc:
            seconds[path.stem] = f"no plan: {str(exc)[:80]}"
            continue
        seconds[path.stem] = round(statistics.median(r.search_seconds for r in results), 4)
        evaluated[path.stem] = results[0].evaluated
        cpu_seconds[path.stem] = round(statistics.median(cpu), 4)
    return seconds, evaluated, cpu_seconds


def main() -> dict:
    """Run the benchmark; print a summary and the JSON line; return the JSON object."""
    shape = shape_from_megatron_dict(GPT_1T, name="gpt-1t", source="bench/plan_speed.py")
    result = plan(shape, num_gpus=GPUS, gpu_type=GPU_TYPE, global_batch_size=GLOBAL_BATCH)
    search_s = _median_time(lambda: plan(shape, num_gpus=GPUS, gpu_type=GPU_TYPE, global_batch_size=GLOBAL_BATCH))
    work = Workload(shape=shape, gpu=get_gpu(GPU_TYPE), num_gpus=GPUS, seq_length=shape.seq_length,
                    global_batch_size=GLOBAL_BATCH, runtime=Runtime())
    brute = search(work, keep_all=True, prune=False)
    reference_s = _median_time(lambda: search(Workload(shape=shape, gpu=get_gpu(GPU_TYPE), num_gpus=GPUS,
                                                       seq_length=shape.seq_length, global_batch_size=GLOBAL_BATCH),
                                              keep_all=True, prune=False))
    best_brute = min(brute.fitting, key=lambda e: e.step_time_s)
    rl_seconds, rl_evaluated, rl_cpu = rl_search_times()
    timed = [s for s in rl_seconds.values() if isinstance(s, float)]
    lay = result.layout
    print(f"GPT-1T ({shape.num_params() / 1e12:.2f}T params) on {GPUS} x {GPU_TYPE}, seq {shape.seq_length}, "
          f"global batch {GLOBAL_BATCH}")
    print(f"chosen: {layout_line(lay)}; MFU {100 * result.estimate.mfu:.1f}%, step {result.estimate.step_time_s:.2f} s")
    print(f"search {search_s * 1000:.1f} ms ({result.considered} candidates, {result.evaluated} estimated); "
          f"unpruned reference {reference_s * 1000:.1f} ms ({brute.evaluated} estimated); same answer: "
          f"{abs(best_brute.step_time_s - result.estimate.step_time_s) < 1e-9}")
    for name, took in rl_seconds.items():
        print(f"{name}: search {took if isinstance(took, str) else f'{took * 1000:.1f} ms'}"
              + (f" ({rl_evaluated[name]} estimated; target {RL_TARGET_S:.0f} s)" if name in rl_evaluated else ""))
    summary = {"model": "gpt-1t", "params": shape.num_params(), "gpus": GPUS, "gpu_type": GPU_TYPE,
               "search_s": round(search_s, 4), "considered": result.considered, "evaluated": result.evaluated,
               "reference_s": round(reference_s, 4), "reference_evaluated": brute.evaluated,
               "speedup": round(reference_s / search_s, 2),
               "same_answer": abs(best_brute.step_time_s - result.estimate.step_time_s) < 1e-9,
               "rl_search_s": rl_seconds, "rl_evaluated": rl_evaluated, "rl_plan_cpu_s": rl_cpu,
               "rl_target_s": RL_TARGET_S,
               "rl_speedup": round(RL_TARGET_S / max(timed), 2) if timed else None,
               "timing": f"median of {REPEATS} runs, wall clock, this machine",
               "load_average_1min": round(os.getloadavg()[0], 2)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
