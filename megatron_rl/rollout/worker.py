"""A split-placement rollout worker (``cluster.rollout_tasks``): the job's last processes run this instead of a
trainer. It holds a copy of the policy at the training layout's tp x pp, or at parallel.rollout_tp x rollout_pp
(then each version arrives as a distributed checkpoint that Megatron reshards as it loads), cp = ep = 1,
data-parallel over the rollout processes, and runs one generation session of the paged engine for the whole job
(``OrderFeed``): the trainers' orders of prompts join it as they come, while earlier rows still decode, each
replica decodes ``group_size`` completions of its share of every order's prompts, the newest weights the trainers
published are loaded between engine steps, and each prompt's completions go back as soon as all have ended,
tagged with the weights' version when the prompt came in.

    python launch.py --config configs/grpo_async_tiny.yaml      # 1 trainer + 1 rollout process on CPU

It scores nothing (the trainers do, beside their reward models) and writes no checkpoint: what a resumed run
needs is the trainers' (``megatron_rl.rollout.buffer`` state). It exits with the code the trainers' stop file
gives (0, or REQUEUE_EXIT_CODE after a preemption, so the job is requeued whole); stop signals are the
trainers' to act on, so it ignores them and keeps serving until that file comes.

Test: ``.venv/bin/python -m pytest tests/test_async_grpo.py -q``
"""

from __future__ import annotations

import time
from typing import Optional


from megatron_rl.generation import GenerationStopped
from megatron_rl.rollout.buffer import Sample
from megatron_rl.rollout.channel import WORKER_WAIT_S, WorkerChannel, any_rank


class TrainersStopped(GenerationStopped):
    """The trainers wrote their stop file: the worker's session ends with their exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the trainers stopped (exit code {code})")
        self.code = code


class OrderFeed:
    """The worker's engine feed (``megatron_rl.generation.engine.Feed``): one generation session runs for the
    whole job, and the trainers' orders join it while earlier rows still decode, so the batch stays full across
    GRPO steps instead of draining to each order's longest completion.

    At every question of the engine (every few steps while rows decode, and when none is left) it takes the
    orders that have come (waiting for one only when no replica has rows left), loads the newest weights the
    trainers published (all rows then go on under them, each token's log-prob that of the weights that chose it),
    hands in this replica's prompts (prompt i of an order goes to replica i mod replicas, ``group`` completions of
    it, drawn with the order's seed as a colocated rollout of the order would draw them) and sends the samples that
    ended since. A sample's version is the one loaded when its prompt came in: the oldest weights any of its tokens
    saw, which the trainers' staleness bound counts. With ``episodes`` (an environment's job) each prompt's
    completions are episodes (``WorkerEpisodes``), and their samples carry what the trainers need of them."""

    def __init__(self, channel: WorkerChannel, chunks: list, *, tokenizer, group: int, replica: int, replicas: int,
                 sends: bool, episodes=None) -> None:
        self.episodes = episodes
        self.channel, self.chunks, self.tokenizer, self.group = channel, chunks, tokenizer, group
        self.replica, self.replicas, self.sends = replica, replicas, sends
        self.version: Optional[int] = None
        self.orders = 0
        self.done: list[Sample] = []
        self.stats: dict[str, float] = {}
        self.counted = {"forwards": 0, "sampled": 0}
        self.clock = time.perf_counter()

    def more(self, generating: bool, counters: dict) -> list:
        from megatron_rl.data.prompts import PromptRecord, encode_prompt
        from megatron_rl.generation.feed import FedPrompt

        self._count(decode_steps=float(counters["forwards"] - self.counted["forwards"]),
                    decode_rows=float(counters["sampled"] - self.counted["sampled"]))
        self.counted = {key: counters[key] for key in self.counted}
        self._send()  # before waiting: the trainers' next order may wait for these
        # wait for an order only when no replica still decodes
        orders = self.channel.take_orders(wait=not any_rank(generating), timeout_s=WORKER_WAIT_S)
        if isinstance(orders, int):
            raise TrainersStopped(orders)
        self.version, sync = self.channel.load_newest(self.chunks, timeout_s=WORKER_WAIT_S)
        self._count(weight_load_s=sync["weight_sync_s"], weight_load_bytes=sync["weight_sync_bytes"],
                    orders=float(len(orders)))
        self.orders += len(orders)
        fed = []
        for order in orders:
            for i in range(self.replica, len(order.prompt_ids), self.replicas):
                p = order.prompts[i]
                record = PromptRecord(prompt=p["prompt"], answer=p.get("answer"), metadata=p.get("metadata") or {},
                                      source=p["source"],
                                      prompt_ids=None if p["prompt_ids"] is None else tuple(p["prompt_ids"]))
                tag = (order.prompt_ids[i], self.version)
                if self.episodes is not None:
                    fed.append(self.episodes.fed_prompt(record, group=self.group, seed=order.seed,
                                                        first_request=i * self.group, tag=tag))
                    continue
                fed.append(FedPrompt(tokens=tuple(encode_prompt(self.tokenizer, record)), completions=self.group,
                                     seed=order.seed, first_request=i * self.group, tag=tag))
        return fed

    def finished(self, done) -> None:
        payload = (self.episodes.payload(done.prompt.tag, done) if self.episodes is not None else
                   {"response_ids": done.responses, "logprobs": done.logprobs,
                    "truncated": [reason == "length" for reason in done.finish_reasons]})
        if not self.sends:
            return
        prompt_id, version = done.prompt.tag
        self.done.append(Sample(prompt_id=prompt_id, version=version, payload=payload))

    def _count(self, **stats: float) -> None:
        for key, value in stats.items():
            self.stats[key] = self.stats.get(key, 0.0) + value

    def _send(self) -> None:
        """The samples that ended since the last question, with the stats since then."""
        now = time.perf_counter()
        if self.sends and self.done:
            generated = float(sum(len(r) for sample in self.done for r in sample.payload["response_ids"]))
            self.channel.send(self.done, {**self.stats, "generated_tokens": generated,
                                          "generate_s": now - self.clock - self.channel.idle_s})
            self.done, self.stats, self.clock = [], {}, now

