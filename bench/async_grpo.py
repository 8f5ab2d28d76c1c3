"""Synchronous colocated GRPO against asynchronous split-placement GRPO, the same task, side by side.

Run: ``.venv/bin/python bench/async_grpo.py`` (options: ``--steps 300 --repeats 1 --max-staleness 1
--new-tokens 4``). CPU, 2 local processes per run, no network.

- reference, synchronous colocated: ``configs/grpo_tiny.yaml`` (the default job): both processes generate, then
  both train (data-parallel 2).
- ours, asynchronous: ``configs/grpo_async_tiny.yaml``: 1 process trains while 1 generates with weights at most
  ``--max-staleness`` steps old (``cluster.rollout_tasks=1``, ``weight_sync=files``, decoupled PPO correction).

Both train on the same number of samples: ``--steps`` x 16 prompts x 8 completions, after the same 30-step SFT
warm-up, with the same seed, learning rate, KL and generation settings. The timed figure is the GRPO phase:
the sum of the steps' ``step_time_s`` (sync: generate + score + train; async: waiting for samples + score +
train + publishing the weights), i.e. the loop without its logging; the whole job's wall time (process start,
warm-up, checkpoints) is reported beside it. With ``--repeats`` > 1 the two alternate which goes first and the
medians are reported, with the spread.

Also reported: each run's final reward (mean over the last 10% of steps) and, for the async run, the histogram
of sample staleness (versions between the weights that generated a sample and those it trained), from its
ledger (``run.dir/rollout/consumed.jsonl``). The last line is one JSON object; ``speedup`` = sync seconds /
async seconds (> 1: async is faster).

Why it may be < 1 here: on 2 CPU cores the synchronous run already keeps both cores busy in both phases, while
the async run gives generation one core and training the other; it gains only when generation and training
are closer in cost than data parallelism's gain (and its trainer also recomputes the proximal log-probs, a
forward the fp32 synchronous run skips). On GPU clusters the case for async is the one AReaL measured (2.77x):
long, memory-bound generation overlapped with training instead of serialised with it.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_job(config: str, run_dir: Path, steps: int, extra: list[str]) -> dict:
    """One launch.py job; its GRPO-phase seconds, wall seconds, final reward and (async) staleness histogram."""
    cmd = [sys.executable, str(ROOT / "launch.py"), "--config", config, f"run.dir={run_dir}", f"run.steps={steps}",
           "logging.plot=false", *extra]
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m.get("phase", "train") == "train"]
    tail = train[-max(1, len(train) // 10):]
    result = {"grpo_s": sum(m["step_time_s"] for m in train), "wall_s": wall, "steps": len(train),
              "final_reward": sum(m["reward_mean"] for m in tail) / len(tail),
              "samples": sum(16 * 8 for _ in train)}
    ledger = run_dir / "rollout" / "consumed.jsonl"
    if ledger.is_file():
        histogram: collections.Counter[int] = collections.Counter()
        for line in ledger.read_text().splitlines():
            entry = json.loads(line)
            histogram.update(entry["step"] - 1 - version for version in entry["versions"])
        result["staleness_histogram"] = {str(k): v for k, v in sorted(histogram.items())}
        result["trainer_idle_s"] = sum(m["trainer_idle_s"] for m in train)
        result["generator_idle_s"] = sum(m["generator_idle_s"] for m in train)
    return result


def spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if len(values) > 1 else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=4, help="generation.max_new_tokens of both")
    args = parser.parse_args()
    common = [f"generation.max_new_tokens={args.new_tokens}"]
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for repeat in range(args.repeats):
            order = ["sync", "async"] if repeat % 2 == 0 else ["async", "sync"]
            for side in order:
                config = "configs/grpo_tiny.yaml" if side == "sync" else "configs/grpo_async_tiny.yaml"
                extra = common + ([f"algorithm.max_staleness={args.max_staleness}"] if side == "async" else [])
                result = run_job(config, Path(tmp) / f"{side}{repeat}", args.steps, extra)
                runs[side].append(result)
                print(f"{side:5s} repeat {repeat}: GRPO phase {result['grpo_s']:.1f} s, job {result['wall_s']:.1f} s, "
                      f"final reward {result['final_reward']:.3f}"
                      + (f", staleness {result['staleness_histogram']}" if "staleness_histogram" in result else ""),
                      flush=True)
    sync_s = statistics.median(r["grpo_s"] for r in runs["sync"])
    async_s = statistics.median(r["grpo_s"] for r in runs["async"])
    histogram: collections.Counter[str] = collections.Counter()
    for r in runs["async"]:
        histogram.update(r["staleness_histogram"])
    print(f"GRPO phase: sync {sync_s:.1f} s (spread {spread([r['grpo_s'] for r in runs['sync']])}), async "
          f"{async_s:.1f} s (spread {spread([r['grpo_s'] for r in runs['async']])}): speedup {sync_s / async_s:.2f}")
    print(json.dumps({
        "steps": args.steps, "repeats": args.repeats, "max_staleness": args.max_staleness,
        "new_tokens": args.new_tokens, "trained_samples": runs["sync"][0]["samples"],
        "sync_grpo_s": [round(r["grpo_s"], 3) for r in runs["sync"]],
        "async_grpo_s": [round(r["grpo_s"], 3) for r in runs["async"]],
        "sync_wall_s": [round(r["wall_s"], 2) for r in runs["sync"]],
        "async_wall_s": [round(r["wall_s"], 2) for r in runs["async"]],
        "sync_final_reward": [round(r["final_reward"], 4) for r in runs["sync"]],
        "async_final_reward": [round(r["final_reward"], 4) for r in runs["async"]],
        "async_trainer_idle_s": [round(r["trainer_idle_s"], 2) for r in runs["async"]],
        "async_generator_idle_s": [round(r["generator_idle_s"], 2) for r in runs["async"]],
        "staleness_histogram": dict(sorted(histogram.items())),
        "speedup": round(sync_s / async_s, 4),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
