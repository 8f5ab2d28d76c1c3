"""The async rollout worker's engine: one fed session for every order against one generate call per order.

Run: ``.venv/bin/python bench/rollout_session.py`` (options: ``--orders 8 --prompts 16 --group 4 --repeats 3
--threads 1 --block-tokens 8``). Single process, CPU, fp32, no network.

The small bench model of bench/generation.py (trained a few steps), reasoning RL's long tail: sampled at
temperature 1 up to 256 new tokens with the stop tokens of generation.py's ``longtail`` case (mean response about
48 tokens). ``--orders`` orders of ``--prompts`` prompts (8-24 tokens), ``--group`` completions each, arrive as
the trainers issue them at ``max_staleness`` 1: two are out at the start and one more each time an order's last
completion is back (training time taken as zero, the per-order worker's best case).

* reference, per order (the worker before, and any engine that generates a batch at a time): one ``generate``
  call per order, in turn; each call decodes until its longest completion ends.
* ours, a fed session (``megatron_rl.rollout.worker.OrderFeed``'s engine, ``generate(..., feed=...)``): the next
  order's prompts join at the engine's next question while the tail of the previous one decodes.

Both get the same KV budget: one order's rows at their longest (what a call without ``kv_memory_gib`` takes), and
the same tokens (asserted: each completion's draws depend on its order's seed, its place and its position only).
Reported: the seconds (medians over ``--repeats``, alternating), forwards, rows decoding per forward, and
``speedup`` = per-order seconds / session seconds on the last line's JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import CASES, longtail_stop_tokens, small_shape_file, trained_engine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_rl.spec.ports import free_port  # noqa: E402


class ArrivingOrders:
    """A Feed of ``orders`` (lists of prompts) arriving as at max_staleness 1: two at first, one more whenever an
    order is complete. ``done[order][request]`` = the completion's tokens."""

    def __init__(self, orders: list[list[list[int]]], seeds: list[int], group: int) -> None:
        self.orders, self.seeds, self.group = orders, seeds, group
        self.issued, self.handed = 2, 0
        self.done: list[dict[int, list[int]]] = [{} for _ in orders]

    def more(self, generating: bool, counters: dict) -> list:
        from megatron_rl.generation import GenerationStopped
        from megatron_rl.generation.feed import FedPrompt

        self.counters = counters
        if self.handed == len(self.orders) and not generating:
            raise GenerationStopped("every order is done")
        fed = []
        while self.handed < min(self.issued, len(self.orders)):
            o = self.handed
            fed += [FedPrompt(tokens=tuple(p), completions=self.group, seed=self.seeds[o], first_request=i * self.group,
                              tag=o) for i, p in enumerate(self.orders[o])]
            self.handed += 1
        return fed

    def finished(self, done) -> None:
        order = done.prompt.tag
        for j, tokens in enumerate(done.responses):
            self.done[order][done.prompt.first_request + j] = tokens
        if len(self.done[order]) == len(self.orders[order]) * self.group:
            self.issued += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--block-tokens", type=int, default=8)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(args.threads)
    from megatron_rl.generation import EngineConfig, GenerationStopped, generate
    from megatron_rl.runtime.distributed import initialize, job_dims, shutdown

    initialize(job_dims(), seed=3)
    new_tokens = CASES["longtail"].new_tokens
    with tempfile.TemporaryDirectory(prefix="rollout_session_bench_") as tmp:
        engine, shape = trained_engine(str(small_shape_file(Path(tmp))), args.train_steps)
    gen = torch.Generator().manual_seed(1)
    orders = [[torch.randint(3, shape.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 25, (args.prompts,), generator=gen)] for _ in range(args.orders)]
    seeds = [1000 + o for o in range(args.orders)]
    expand = lambda order: [p for p in order for _ in range(args.group)]  # noqa: E731
    config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=new_tokens, temperature=1.0,
                          kv_block_tokens=args.block_tokens)
    free = generate(engine.chunks, expand(orders[0]), config, seed=seeds[0])
    stops, _ = longtail_stop_tokens(free.tokens, new_tokens)
    config = dataclasses.replace(config, stop_token_ids=stops)
    budget = generate(engine.chunks, expand(orders[0]), config, seed=seeds[0]).kv_cache_bytes
    config = dataclasses.replace(config, kv_memory_gib=budget / 2**30)

    def per_order() -> dict:
        outs = [generate(engine.chunks, expand(order), config, seed=seed) for order, seed in zip(orders, seeds)]
        return {"tokens": [out.tokens for out in outs], "forwards": sum(out.forward_passes for out in outs),
                "generated": sum(sum(out.lengths) for out in outs)}

    def session() -> dict:
        feed = ArrivingOrders(orders, seeds, args.group)
        try:
            generate(engine.chunks, [], config, feed=feed)
        except GenerationStopped:
            pass
        tokens = [[feed.done[o][r] for r in range(len(orders[o]) * args.group)] for o in range(len(orders))]
        return {"tokens": tokens, "forwards": feed.counters["forwards"], "generated": feed.counters["sampled"]}

    contenders = {"per_order": per_order, "session": session}
    results = {name: fn() for name, fn in contenders.items()}
    assert results["session"]["tokens"] == results["per_order"]["tokens"], "the session's tokens differ"
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(args.repeats):
        for name in (list(contenders) if round_ % 2 == 0 else list(contenders)[::-1]):
            began = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - began)
    shutdown()
    lengths = sorted(len(t) for order in results["per_order"]["tokens"] for t in order)
    report = {name: {"s_median": statistics.median(times[name]), "s_all": times[name],
                     "forwards": results[name]["forwards"],
                     "rows_per_forward": results[name]["generated"] / results[name]["forwards"]}
              for name in contenders}
    speedup = report["per_order"]["s_median"] / report["session"]["s_median"]
    print(f"{args.orders} orders x {args.prompts} prompts x {args.group}; responses mean "
          f"{statistics.mean(lengths):.1f}, max {lengths[-1]} of {new_tokens}; KV budget {budget / 2**20:.2f} MiB")
    for name, r in report.items():
        print(f"{name:10} {r['s_median']:8.3f} s  {r['forwards']:6d} forwards  {r['rows_per_forward']:6.1f} rows/forward")
    print(json.dumps({**report, "speedup": speedup, "tokens_equal": True, "orders": args.orders,
                      "prompts": args.prompts, "group": args.group, "max_new_tokens": new_tokens,
                      "response_lengths": {"mean": statistics.mean(lengths), "max": lengths[-1],
                                           "tokens": sum(lengths)},
                      "kv_budget_bytes": budget, "threads": args.threads, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
