"""Multi-turn rollouts whose environment steps take time: steps made in order between engine steps against steps
made in threads while the other rows decode (``environment.concurrent_steps``).

Run: ``.venv/bin/python bench/env_overlap.py`` (options: ``--prompts 16 --group 4 --turns 3 --step-ms 20
--concurrent 8 --repeats 3 --threads 1``). Single process, CPU, fp32, no network.

The small bench model of bench/generation.py (trained a few steps). ``--prompts`` prompts x ``--group`` episodes,
``--turns`` policy turns of up to 8 tokens each; after every turn but the last, the environment takes ``--step-ms``
milliseconds (a tool run, a sandbox start, a judge's call: simulated by a sleep, which releases the GIL as those
do) and replies with 4 tokens.

* reference (``environment.concurrent_steps=0``, and every engine that steps its environments between batched
  decode steps): each step runs when its turn ends, while every other row waits.
* ours (``concurrent_steps``): each step is handed to a thread pool; the engine keeps decoding the other rows and
  feeds a reply when it comes (``megatron_rl.generation.engine``: ``turn_ended`` returns a future).

The same tokens come out (asserted: a row's draws depend on its seed, place and position only). Reported: the
seconds (medians over ``--repeats``, alternating), forwards, and ``speedup`` = in-order seconds / overlapped
seconds on the last line's JSON object. On GPUs a decode step is shorter than here, so a step of a given length
holds more of them up: the figure that carries over is the waiting the overlap removes (``env_wait_s``: steps x
``--step-ms`` in order, against what the overlapped run spent beyond its decoding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import small_shape_file, trained_engine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_rl.spec.ports import free_port  # noqa: E402

TURN_TOKENS = 8
REPLY = [5, 6, 7, 8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-steps", type=int, default=20)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(args.threads)
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.runtime.distributed import initialize, job_dims, shutdown

    initialize(job_dims(), seed=3)
    with tempfile.TemporaryDirectory(prefix="env_overlap_bench_") as tmp:
        engine, shape = trained_engine(str(small_shape_file(Path(tmp))), args.train_steps)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, shape.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 25, (args.prompts,), generator=gen)]
    rows = [p for p in prompts for _ in range(args.group)]
    longest = args.turns * TURN_TOKENS + (args.turns - 1) * len(REPLY)
    config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=longest, max_turn_tokens=TURN_TOKENS,
                          temperature=1.0, kv_block_tokens=8)

    def run(concurrent: int) -> dict:
        turns: dict[int, int] = {}

        def step(index: int) -> list | None:
            time.sleep(args.step_ms / 1000)
            turns[index] = turns.get(index, 0) + 1
            return list(REPLY) if turns[index] < args.turns else None

        if concurrent == 0:
            out = generate(engine.chunks, rows, config, seed=11, turn_ended=lambda i, turn, finish: step(i))
        else:
            with ThreadPoolExecutor(max_workers=concurrent) as pool:
                out = generate(engine.chunks, rows, config, seed=11,
                               turn_ended=lambda i, turn, finish: pool.submit(step, i))
        return {"tokens": out.tokens, "forwards": out.forward_passes, "steps": sum(turns.values())}

    contenders = {"in_order": lambda: run(0), "overlapped": lambda: run(args.concurrent)}
    results = {name: fn() for name, fn in contenders.items()}
    assert results["overlapped"]["tokens"] == results["in_order"]["tokens"], "the overlapped episodes differ"
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(args.repeats):
        for name in (list(contenders) if round_ % 2 == 0 else list(contenders)[::-1]):
            began = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - began)
    shutdown()
    report = {name: {"s_median": statistics.median(times[name]), "s_all": times[name],
                     "forwards": results[name]["forwards"], "env_steps": results[name]["steps"]}
              for name in contenders}
    steps = results["in_order"]["steps"]
    in_order_wait = steps * args.step_ms / 1000
    decode_s = report["in_order"]["s_median"] - in_order_wait
    speedup = report["in_order"]["s_median"] / report["overlapped"]["s_median"]
    print(f"{args.prompts} prompts x {args.group} episodes, {args.turns} turns, {steps} environment steps of "
          f"{args.step_ms:g} ms")
    for name, r in report.items():
        print(f"{name:11} {r['s_median']:8.3f} s  {r['forwards']:6d} forwards")
    print(json.dumps({**report, "speedup": speedup, "tokens_equal": True, "env_wait_s": {
        "in_order": in_order_wait, "overlapped": max(0.0, report["overlapped"]["s_median"] - decode_s)},
        "prompts": args.prompts, "group": args.group, "turns": args.turns, "step_ms": args.step_ms,
        "concurrent": args.concurrent, "threads": args.threads, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
