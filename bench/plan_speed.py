"""Time a full layout search for a 1T-parameter GPT on 16,384 H100s.

Run: ``.venv/bin/python bench/plan_speed.py``. The last line is one JSON object:
  search_s            median wall time of plan() (every legal layout, with the pruning that cannot change the
                      answer: weights-only memory check, first fitting recompute mode per layout and micro-batch)
  reference_s         median wall time of the same search with no pruning (every candidate estimated), timed side
                      by side on the same machine; speedup = reference_s / search_s
  considered          candidate layouts enumerated; evaluated = layouts whose memory and time were estimated
  grpo_search_s       per shipped GRPO config (configs/grpo_*.yaml): wall time of its plan's search, as
                      ``launch.py plan --config`` runs it (median of REPEATS); must stay under 3 s each
The model is Narayanan et al.'s GPT-1T (128 layers, hidden 25600, 160 heads, ffn 102400, vocab 51200), seq 2048,
global batch 4096 sequences, bf16.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.model_shape import shape_from_megatron_dict  # noqa: E402
from launcher.planner import plan  # noqa: E402
from launcher.planner.costs import Runtime, Workload  # noqa: E402
from launcher.planner.gpus import get_gpu  # noqa: E402
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


def grpo_search_times() -> dict[str, float | str]:
    """Median search seconds of every shipped GRPO config's plan (or the one-line reason it has none)."""
    from launcher.config.loader import given_keys, load_config
    from launcher.errors import ConfigError
    from launcher.job import load_shape, plan_job

    out: dict[str, float | str] = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "configs").glob("grpo_*.yaml")):
        cfg = load_config(str(path), [], allow_missing=True)
        shape = load_shape(cfg.model.name)
        given = given_keys(str(path), [])
        try:
            out[path.stem] = round(statistics.median(plan_job(cfg, shape, given=given).search_seconds
                                                     for _ in range(REPEATS)), 4)
        except ConfigError as exc:
            out[path.stem] = f"no plan: {str(exc)[:80]}"
    return out


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
    lay = result.layout
    print(f"GPT-1T ({shape.num_params() / 1e12:.2f}T params) on {GPUS} x {GPU_TYPE}, seq {shape.seq_length}, "
          f"global batch {GLOBAL_BATCH}")
    print(f"chosen: tp={lay.tp} pp={lay.pp} vpp={lay.vpp} cp={lay.cp} dp={lay.dp} mbs={lay.micro_batch_size} "
          f"recompute={lay.recompute}; MFU {100 * result.estimate.mfu:.1f}%, step {result.estimate.step_time_s:.2f} s")
    print(f"search {search_s * 1000:.1f} ms ({result.considered} candidates, {result.evaluated} estimated); "
          f"unpruned reference {reference_s * 1000:.1f} ms ({brute.evaluated} estimated); same answer: "
          f"{abs(best_brute.step_time_s - result.estimate.step_time_s) < 1e-9}")
    summary = {"model": "gpt-1t", "params": shape.num_params(), "gpus": GPUS, "gpu_type": GPU_TYPE,
               "search_s": round(search_s, 4), "considered": result.considered, "evaluated": result.evaluated,
               "reference_s": round(reference_s, 4), "reference_evaluated": brute.evaluated,
               "speedup": round(reference_s / search_s, 2),
               "same_answer": abs(best_brute.step_time_s - result.estimate.step_time_s) < 1e-9,
               "grpo_search_s": grpo_search_times(),
               "timing": f"median of {REPEATS} runs, wall clock, this machine"}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
