"""Where a step's completions come from with split placement (``cluster.rollout_tasks > 0``): rollout workers
generate while the trainers step, with a bound on staleness (``algorithm.max_staleness = k``) and a correction for the behaviour policy.

    python launch.py --config configs/grpo_async_tiny.yaml      # 1 trainer + 1 rollout process on CPU

The loop is the RL trainer's (``megatron_rl.trainers.rl``); this source changes where a step's samples come from
and what happens after it:

- sample: take ``prompts_per_step`` groups from the rollout buffer (``megatron_rl.rollout.buffer``), each at
  most k versions older than the trainers' weights (staler ones are dropped and their prompts generated again;
  the trainers wait while too few are in), then score them here.
- train: the old log-probs are recomputed with the current weights (pi_prox, the proximal policy), and the
  loss weights each token by pi_prox / pi_behav against the log-probs the worker returned
  (``algorithm.off_policy_correction``: truncated IS or AReaL's decoupled PPO, ``megatron_rl.algorithms.policy_loss``).
- sync: publish the new weights (version = steps done) and issue more prompts; with the "wait" rule at most
  (k + 1) x prompts_per_step prompts are out at once (AReaL's bound), so k = 0 is synchronous: the workers
  generate each step's prompts with that step's weights.

Preemption: the buffer's ledger (ids issued, outstanding, consumed) is saved with the checkpoint; after a resume
the outstanding prompts are generated again and nothing consumed is taken twice. Each step logs
``prompts_lost`` and ``prompts_repeated`` (0 and 0), and ``run.dir/rollout/consumed.jsonl`` lists the prompt ids
each step trained on, for audit.

Transport (``megatron_rl.rollout.channel``): prompts and samples through the run folder; weights through it
too (``algorithm.weight_sync=files``) or over a gloo process group between the two worlds (``gloo``).

Test: ``.venv/bin/python -m pytest tests/test_async_grpo.py -q``
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path
from typing import Iterator

from megatron_rl.data.prompts import encode_prompt
from megatron_rl.rl.sampled import SampledBatch
from megatron_rl.rl.loss import OFF_POLICY_REPORTS
from megatron_rl.rollout.batch import Rollout
from megatron_rl.rollout.buffer import RolloutBuffer, Sample
from megatron_rl.rollout.channel import BRIDGE_BACKENDS, WORKER_WAIT_S, TrainerChannel, WeightBridge, broadcast
from megatron_rl.rollout.placement import Placement
from megatron_rl.runtime.checkpoint import fault_point
from megatron_rl.runtime.stops import Preempted
from megatron_rl.spec.parallel import reshards
from megatron_rl.spec.run_files import REQUEUE_EXIT_CODE

BUFFER_STATE = "rollout_buffer"
LEDGER_FILE = "consumed.jsonl"
TAKE_POLL_S = 0.05


class RolloutWorkers:
    """Samples from the rollout workers of ``placement`` (see the module docstring); ``run``: the ``RLRun`` it
    serves."""

    recomputes_old_logprobs = True
    """pi_prox: the weights the step starts from."""

    def __init__(self, run, placement: Placement) -> None:
        cfg = run.cfg
        self.run, self.cfg, self.ctx, self.algo = run, cfg, run.ctx, run.algo
        self.placement = placement
        weight_sync, bridge = self.algo.weight_sync, None
        if weight_sync in BRIDGE_BACKENDS:
            par = cfg.parallel
            bridge = WeightBridge.open(placement, backend=weight_sync,
                                       replicas=cfg.cluster.rollout_tasks // (par.tp * par.pp), timeout_s=WORKER_WAIT_S)
        if reshards(cfg.parallel):
            weight_sync = "resharded"  # the schema allows it with files only
        self.channel = TrainerChannel(placement.folder, placement.session, weight_sync=weight_sync, bridge=bridge,
                                      bucket_bytes=self.algo.weight_sync_bucket_mib * 2**20)
        self.buffer = RolloutBuffer(max_staleness=self.algo.max_staleness, batch_size=self.algo.prompts_per_step,
                                    stale_policy="wait")
        self.report_names = OFF_POLICY_REPORTS if self.algo.off_policy_correction != "none" else ()
        self.version = 0
        self.consumed: set[int] = set()
        self.repeated = 0
        self.sync_metrics: dict[str, float] = {}
        self.worker_stats: dict[str, float] = {}
        self._step_began = time.perf_counter()

    # ------------------------------------------------------------------ state
    def extra_state(self) -> dict:
        return {BUFFER_STATE: self.buffer.state_dict()}

    def after_resume(self, start: int, extra: dict) -> None:
        """The buffer's ledger as saved, the workers started on the weights of step ``start``, orders out."""
        if BUFFER_STATE in extra:
            self.buffer.load_state_dict(extra[BUFFER_STATE])
        self.version = start
        self.consumed = self._ledger_up_to(start)
        self.channel.start()
        self.sync_metrics = self.channel.publish(start, self.run.engine.chunks, base=True)
        self.issue()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """The rollout workers serve while the block runs; at its end they exit with the trainers' code."""
        code = 1
        try:
            yield
            code = 0
        except Preempted:
            code = REQUEUE_EXIT_CODE
            raise
        finally:
            self.channel.stop(code)

    # ------------------------------------------------------------------ sample
    def issue(self) -> None:
        """Trainer rank 0: orders of prompts_per_step prompts while the buffer has room for one."""
        if self.ctx.rank != 0:
            return
        per_order = self.algo.prompts_per_step
        while self.buffer.room >= per_order:
            ids = self.buffer.issue(per_order)
            prompts = [self.run.sampler.record_at(i) for i in ids]
            fields = [{"prompt": p.prompt, "source": p.source,
                       "prompt_ids": None if p.prompt_ids is None else list(p.prompt_ids),
                       # an environment's reset reads the whole record (the calculator scores against the answer)
                       **({"answer": p.answer, "metadata": p.metadata} if self.run.environments is not None else {})}
                      for p in prompts]
            seed = random.Random(f"rollout:{self.cfg.run.seed}:{ids[0]}").getrandbits(62)
            self.channel.issue(ids, fields, seed=seed)

    def sample(self, step: int) -> SampledBatch:
        self._step_began = time.perf_counter()
        with self.ctx.timer() as t_wait:
            taken = broadcast(self.take(self.algo.prompts_per_step, step) if self.ctx.rank == 0 else None)
        rollout = self.rollout_of(taken)
        with self.ctx.timer() as t_score:
            self.run.score(rollout)
        self.record_consumed(step, taken)
        return SampledBatch(drawn=rollout, kept=rollout, draws=1, sample_s=t_wait.seconds, score_s=t_score.seconds)

    def take(self, n: int, step: int) -> list[Sample]:
        """Rank 0: ``n`` samples within the staleness bound, moving the workers' samples into the buffer while it
        waits (and issuing the prompts of dropped samples again)."""
        deadline = time.monotonic() + self.cfg.parallel.timeout_s
        while True:
            samples, stats = self.channel.collect()
            if samples:  # read and deleted from the channel, held only here until the step's checkpoint
                fault_point("kill-during-sample-handoff", step)
            for key, value in stats.items():
                self.worker_stats[key] = self.worker_stats.get(key, 0.0) + value
            for sample in samples:
                self.buffer.put(sample)
            try:
                return self.buffer.take(n, self.version, timeout_s=TAKE_POLL_S)
            except TimeoutError:
                self.issue()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {n} samples from the rollout workers in {self.cfg.parallel.timeout_s} s "
                                       f"(parallel.timeout_s); see their logs in {self.cfg.run.dir}/logs") from None

    def rollout_of(self, taken: list[Sample]) -> Rollout:
        """The samples as one rollout (prompt-major), prompts and answers from this run's prompt stream."""
        group = self.algo.group_size
        records = [self.run.sampler.record_at(s.prompt_id) for s in taken for _ in range(group)]
        responses = [r for s in taken for r in s.payload["response_ids"]]
        if self.run.environments is not None:  # episodes (rollout/multi_turn.py WorkerEpisodes)
            joined = lambda key: [x for s in taken for x in s.payload[key]]  # noqa: E731
            return Rollout(prompt_ids=joined("prompt_token_ids"), response_ids=responses,
                           logprobs=joined("logprobs"), response_mask=joined("policy_mask"),
                           prompts=[r.prompt for r in records], completions=joined("completions"),
                           answers=[r.answer for r in records], truncated=joined("truncated"),
                           env_rewards=joined("env_rewards"), episodes=joined("episodes"),
                           seq_multiple=self.run.engine.sequence_multiple)
        return Rollout(prompt_ids=[encode_prompt(self.run.tokenizer, r) for r in records], response_ids=responses,
                       logprobs=[lp for s in taken for lp in s.payload["logprobs"]],
                       prompts=[r.prompt for r in records], completions=[self.run.tokenizer.decode(r) for r in responses],
                       answers=[r.answer for r in records],
                       truncated=[cut for s in taken for cut in s.payload["truncated"]],
                       seq_multiple=self.run.engine.sequence_multiple)

    # ------------------------------------------------------------------ sync
    def sync_weights(self, step: int) -> None:
        """Publish the weights after ``step`` as version ``step``; then more prompts may go out."""
        self.version = step
        self.sync_metrics = self.channel.publish(step, self.run.engine.chunks)
        self.issue()

    # ------------------------------------------------------------------ ledger and metrics
    def _ledger(self) -> Path:
        return self.placement.folder / LEDGER_FILE

    def _ledger_up_to(self, step: int) -> set[int]:
        """Rank 0: keep the ledger's lines of steps <= ``step`` (later ones were not saved); their prompt ids."""
        consumed: set[int] = set()
        if self.ctx.rank != 0 or not self._ledger().is_file():
            return consumed
        kept = []
        for line in self._ledger().read_text().splitlines():
            entry = json.loads(line)
            if entry["step"] <= step:
                kept.append(line)
                consumed.update(entry["prompt_ids"])
        self._ledger().write_text("".join(f"{line}\n" for line in kept))
        return consumed

    def record_consumed(self, step: int, taken: list[Sample]) -> None:
        if self.ctx.rank != 0:
            return
        ids = [s.prompt_id for s in taken]
        self.repeated += len(self.consumed.intersection(ids))
        self.consumed.update(ids)
        entry = {"step": step, "session": self.placement.session, "prompt_ids": ids,
                 "versions": [s.version for s in taken]}
        with open(self._ledger(), "a") as handle:
            handle.write(json.dumps(entry) + "\n")

    def step_metrics(self, metrics: dict, batch: SampledBatch) -> dict:
        """The run's metrics with the buffer's, the workers' times and throughput, and the weight sync's."""
        if self.ctx.rank != 0:
            return metrics
        lost = self.buffer.next_id - len(self.consumed) - len(self.buffer.outstanding_ids())
        stats, self.worker_stats = self.worker_stats, {}
        metrics.update(self.buffer.step_metrics())
        metrics.update({
            "generator_idle_s": stats.get("generator_idle_s", 0.0),
            "time_generate_s": stats.get("generate_s", 0.0),  # the workers' seconds, beside the trainers' wait
            "time_wait_s": batch.sample_s,
            "generate_tokens_per_s": stats.get("generated_tokens", 0.0) / max(stats.get("generate_s", 0.0), 1e-9),
            # rows decoding per engine step on the workers: their one session takes orders in as rows end
            "rollout_rows_per_step": stats.get("decode_rows", 0.0) / max(stats.get("decode_steps", 0.0), 1.0),
            "prompts_lost": float(lost), "prompts_repeated": float(self.repeated),
            **self.sync_metrics,
            **({"sample_sync_bytes": stats["sample_sync_bytes"]} if "sample_sync_bytes" in stats else {}),
            "step_time_s": time.perf_counter() - self._step_began,
        })
        return metrics
