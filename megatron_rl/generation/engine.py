"""The engine: continuous batching on the paged KV cache, on the training model's own modules.

Rooms, as in vLLM and nano-vllm:
* sequence.py: a row (``Sequence``) and what admission takes at once (``SequenceGroup``);
* block_manager.py: KV blocks per row (allocate, free, share a prompt's);
* scheduler.py: waiting and running rows, ``schedule()`` (a step's rows under the KV budget), ``preempt()``;
* runner.py: a step's inputs (one copy to the device), the forward, sampling;
* turns.py: the multi-turn hand-over; feed.py: a session's prompts (the async rollout worker's orders);
* paged.py / paged_attention.py / paged_mla.py / graphs.py: the cache, its kernels, decode graphs.

``Engine(config, chunks, ...)``: ``add(prompts)``, then ``run()``, which calls ``step()`` until no row is left:
schedule, forward, sample, post-process. A row takes a block when its tokens reach it and returns its blocks when
it ends; the next waiting prompt is admitted at once. A GRPO group's completions are admitted together: the
prompt is prefilled once, its full blocks shared. When a row needs a block and none is free, the newest row is
preempted and prefilled again later: a row is never cut short and the engine never runs out of memory.

Sampling. Every row draws from ``position_draws(seed, request, position)`` (sampling.py), which depends neither on
the batch around it nor on admission order, preemptions or pipeline parts; so the tokens do not depend on the KV
budget, and the TP ranks of a replica (which also share TP rank 0's choice) stay in step.

Sessions. With a ``Feed`` the run goes on until the feed ends it: every ``STOP_POLL_STEPS`` steps the feed hands in
more prompts, which join the part fed the fewest rows while earlier rows decode.

Stopping. With ``stop_requested``, the engine asks every ``STOP_POLL_STEPS`` steps, and a rank that has finished
keeps asking until no rank generates (a collective over ranks whose rollouts end at different steps). A yes
raises ``GenerationStopped`` on every rank at the same question.

Pipeline parallelism. The rows decode in ``pipeline_microbatches`` parts (pp by default), each an ``EnginePart``
with its own rooms and share of the KV budget, and successive steps overlap across the stages
(``_run_pipelined``): a part's next step enters stage 0 as soon as its tokens are chosen. Every stage replays each
part's admissions, preemptions and choices in the same order, so every stage knows each forward's rows.

Layouts: any TP, PP, virtual PP, DP, CP and SP (SP and CP are switched off for the call, layout.py), dense and
MoE, with route recording (router replay). When the experts span rollout workers, the workers step in lockstep
(layout.py ``Lockstep``), padding their steps to the most tokens any worker feeds.

Test: ``.venv/bin/python -m pytest tests/test_paged_engine.py tests/test_generation.py -q``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_rl.generation.block_manager import BlockManager
from megatron_rl.generation.config import EngineConfig
from megatron_rl.generation.feed import Feed, FeedSlots
from megatron_rl.generation.graphs import DecodeGraphs
from megatron_rl.generation.paged import BlockPool, PagedContext, attention_layers, megatron_paged_attention
from megatron_rl.generation.paged_attention import kernels as paged_kernels
from megatron_rl.generation.runner import ModelRunner
from megatron_rl.generation.sampling import SamplingParams, StepChoice
from megatron_rl.generation.scheduler import Scheduler
from megatron_rl.generation.sequence import Sequence, group_sequences, split_groups
from megatron_rl.generation.turns import SettleReplies, TurnEnded, TurnHandover
from megatron_rl.runtime.distributed import collective_device
from megatron_rl.spec.parallel import cuda_graph_error

STOP_POLL_STEPS = 16
"""Engine steps between two stop questions (each is a collective): a stop is seen within this many decode steps."""


class GenerationStopped(Exception):
    """``generate``'s ``stop_requested`` said yes: the rollout is abandoned (on every rank at the same question)."""


@dataclass(frozen=True, kw_only=True)
class PagedStats:
    """What the engine measured, for ``GenerationOutput``."""

    pool_bytes: int
    block_bytes: int
    block_tokens: int
    peak_blocks: int
    """The most blocks rows held at once."""
    peak_held_tokens: int
    """The K/V positions those blocks held at that moment (a block shared by a group counted once)."""
    evictions: int
    prefills: int
    """Rows whose forward fed more than one token (prompts, rows prefilled again after preemption, replies)."""
    fed_tokens: int
    """Tokens fed to forwards (padding rows of a lockstep left out)."""
    steps: int
    """Forwards run (PP=1), or pipelined steps (PP > 1)."""
    kernels: str
    routes: Optional[list] = None
    """With ``record_routes``: per row, ``[positions, slots, topk]`` int16 on the CPU."""
    graph_steps: int = 0
    """Decode steps run on a decode graph's buffers (graphs.py; replayed from a CUDA graph on a GPU)."""


@dataclass(frozen=True, kw_only=True)
class EngineHooks:
    """What the caller hands the engine to call back: the stop question, the multi-turn hand-over, a feed."""

    stop_requested: Optional[Callable[[bool], tuple]] = None
    """``stop_requested(generating) -> (stop, anyone generating)``: a collective, asked every STOP_POLL_STEPS."""
    turn_ended: Optional[TurnEnded] = None
    settle_replies: Optional[SettleReplies] = None
    feed: Optional[Feed] = None


class EnginePart:
    """Rows that decode on their own: the whole batch at PP=1, one of ``pipeline_microbatches`` under PP. Every
    rank replays a part's admissions, preemptions and choices in the same order, so every rank holds the same
    rows and feeds the same tokens."""

    def __init__(self, *, scheduler: Scheduler, runner: ModelRunner, turns: TurnHandover, stops: tuple,
                 max_turn_tokens: Optional[int]) -> None:
        self.scheduler, self.blocks, self.runner, self.turns = scheduler, scheduler.blocks, runner, turns
        self.stop_ids, self.stop_sequences = stops
        self.max_turn_tokens = max_turn_tokens
        self.step_rows = None
        self.fed_count = 0
        """Rows a feed added (a count every pipeline stage agrees on: rows end on the last stage a step before the
        others learn of it)."""
        self.live, self.in_flight, self.awaiting = True, False, False
        """Under PP: rows left; a step of it in the pipeline; its choice on its way from the last stage."""

    def add(self, groups: list) -> None:
        """A feed's groups join the queue (the decode graphs grow to their slots); a part that had run dry goes
        on."""
        rows = [row for group in groups for row in group.rows]
        self.runner.fit_graphs(1 + max(row.index for row in rows),
                               max(self.blocks.blocks_for(row.max_len) for row in rows))
        self.scheduler.add(groups)
        self.fed_count += len(rows)
        self.live = True

    def schedule(self) -> bool:
        """Hand ended turns over and take the replies that came, schedule the next step's rows and send its
        inputs. False when nothing is left to feed (on any worker of a lockstep). When only rows awaiting
        replies are left, it waits for one."""
        self.turns.turn_over()
        wait = False
        while True:
            self.turns.take_replies(self.scheduler.running, wait)
            step = self.scheduler.schedule(ready=lambda row: row.reply is None)
            if step.fed or not any(row.reply is not None for row in self.scheduler.running):
                break
            wait = True
        self.step_rows = step
        return self.runner.prepare(step, self.scheduler.has_work)

    def postprocess(self, choice: Optional[StepChoice]) -> None:
        """After the forward: the fed rows' K/V are cached and an admitted group's members get their copy of the
        prompt's last block; then the sampled rows take ``choice`` (None when none sampled), and the rows that
        ended return their blocks (or, at a turn's end, wait for the hand-over)."""
        for row in self.step_rows.fed:
            row.cached = len(row.tokens)
        for group in self.step_rows.admitted:
            members = group.rows[1:]
            self.blocks.copy_prompt_tail(group.lead, members)
            for row in members:
                row.cached = len(group.lead.tokens)
            if self.runner.recorder is not None:
                self.runner.recorder.copy_prefix(group.lead.index, [row.index for row in members],
                                                 len(group.lead.tokens))
        self.blocks.note_peak(self.scheduler.running)
        if choice is None:
            return
        self.scheduler.counters["sampled"] += len(self.runner.sampled)
        for row, token, policy_lp, sampling_lp in zip(self.runner.sampled, *choice.host_lists()):
            row.append_sampled(token, policy_lp, sampling_lp)
            reason = row.stop_reason(self.stop_ids, self.stop_sequences, self.max_turn_tokens)
            if reason is not None and self.turns.turns_of(row) is not None:
                row.turn_finish = reason
                self.turns.ended.append(row)
            elif reason is not None:
                row.finish = reason
                self.scheduler.finish(row)

    def close(self) -> None:
        if self.runner.graphs is not None:
            self.runner.graphs.close()
        self.blocks.pool.caches.clear()


class Engine:
    """Decodes prompts on the model ``chunks`` (this rank's) of one replica; see the module docstring. ``chain``
    (pipeline.py ``StageChain``) runs forwards across stages and hands TP rank 0's choice to every rank;
    ``lockstep`` (layout.py ``Lockstep``) steps the workers whose experts are shared; ``seed`` seeds the draws."""

    def __init__(self, config: EngineConfig, chunks: list, *, chain, lockstep, seed: int,
                 hooks: EngineHooks = EngineHooks()) -> None:
        self.config, self.chunks, self.chain, self.lockstep, self.seed, self.hooks = (
            config, chunks, chain, lockstep, seed, hooks)
        self.device = chain.device
        self.layers = attention_layers(chunks)
        if not self.layers:
            raise NotImplementedError("generation needs self-attention layers in the model chunks")
        self.dtype = chunks[0].config.params_dtype
        self._check_layout()
        self.params = SamplingParams(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
        self.block_bytes = BlockPool.block_bytes(self.layers, block_tokens=config.kv_block_tokens, dtype=self.dtype)
        self.counters = {"admitted": 0, "evictions": 0, "prefills": 0, "forwards": 0, "fed": 0, "sampled": 0,
                         "graph_steps": 0}
        self.rows: list = []
        self.parts: list = []
        self.budgets: list = []
        """Blocks per part (``_budgets``)."""
        self.steps = 0
        self.recorder = None
        self.slots = None if hooks.feed is None else FeedSlots(
            hooks.feed, self.rows, max_new_tokens=config.max_new_tokens, max_total_tokens=self.longest_allowed)

    @property
    def longest_allowed(self) -> int:
        return self.config.max_total_tokens or 1 << 62

    def _blocks_of(self, length: int) -> int:
        return -(-length // self.config.kv_block_tokens)

    def _check_layout(self) -> None:
        config, chain = self.config, self.chain
        if config.cuda_graphs:
            why = cuda_graph_error(moe=bool(self.chunks[0].config.num_moe_experts),
                                   mla=any(layer.latent for layer in self.layers.values()), pp=chain.pp_size,
                                   staged_tp=self.device.type == "cuda" and chain.tp_size > 1
                                   and torch.distributed.get_backend(chain.tp_group) == "gloo")
            if why is not None:
                raise NotImplementedError(why)
        if self.hooks.feed is not None and (config.record_routes or self.hooks.turn_ended is not None
                                            or self.lockstep.enabled):
            raise NotImplementedError("a fed session records no routes and runs no expert-parallel lockstep; its "
                                      "prompts bring their own turns (FedPrompt.turns)")

    # ------------------------------------------------------------------ the door
    def add(self, prompts) -> None:
        """The call's prompts (token lists), before ``run``; row i decodes with draws counter i."""
        for prompt in prompts:
            self.rows.append(Sequence.of_prompt(prompt, index=len(self.rows), max_new_tokens=self.config.max_new_tokens,
                                                max_total_tokens=self.longest_allowed, seed=self.seed,
                                                request=len(self.rows)))

    def run(self) -> tuple[list, PagedStats]:
        """Decode every row (a session: until the feed ends it); returns (rows in slot order, stats)."""
        self._open_parts(self._first_groups())
        kernels = paged_kernels(self.device, self.dtype)
        was_training = [chunk.training for chunk in self.chunks]
        for chunk in self.chunks:
            chunk.eval()
        try:
            # no_grad, not inference_mode: a module's state first made here (Transformer Engine's lazily made
            # buffers) would be an inference tensor, which the next training step may not update in place
            with torch.no_grad(), megatron_paged_attention(self.chunks, kernels):
                if self.chain.pp_size == 1:
                    while self.step():
                        pass
                else:
                    self._run_pipelined()
            self._wait_for_other_workers()
            routes = None if self.recorder is None else self.recorder.rows([len(row.tokens) - 1 for row in self.rows])
        finally:
            if self.recorder is not None:
                self.recorder.close()
            for part in self.parts:
                part.close()
            for chunk, flag in zip(self.chunks, was_training):
                chunk.train(flag)
        return self.rows, self._stats(kernels.name, routes)

    def step(self) -> bool:
        """One step of a single-stage engine: schedule, forward, sample, post-process. False when no row is left
        (a session's feed then asked for more first)."""
        part = self.parts[0]
        if not part.schedule():
            return self._feed_more(generating=False)
        logits = part.runner.forward(self.chunks[0])
        part.runner.take_routes()
        sampled = len(part.runner.sampled)
        part.postprocess(self.chain.share(self._sample(part, logits), sampled) if sampled else None)
        self.steps += 1
        self._poll()
        return True

    def _sample(self, part: EnginePart, logits: torch.Tensor) -> StepChoice:
        return part.runner.sample(logits, params=self.params, vocab_size=self.config.vocab_size)

    # ------------------------------------------------------------------ parts and their budgets
    def _first_groups(self) -> list:
        """The call's rows as admission groups; a session's first prompts (which size its pool, as a call's)."""
        if self.slots is None:
            return group_sequences(self.rows, share_prefill=self.config.share_prefill)
        if self.rows:
            raise ValueError("a fed session takes its prompts from the feed, not from prompts")
        first: list = []
        while not first:  # a replica may get no prompt of an order
            first = self.hooks.feed.more(False, self.counters)
        return [group for rows in self.slots.rows_of(first)
                for group in group_sequences(rows, share_prefill=self.config.share_prefill)]

    def _open_parts(self, groups: list) -> None:
        """Split the groups over the parts (an expert-parallel lockstep wants as many on every worker) and give
        each part its rooms and share of the KV budget."""
        chain = self.chain
        count = 1 if chain.pp_size == 1 else chain.microbatches if self.lockstep.enabled \
            else max(1, min(chain.microbatches, len(groups)))
        split = split_groups(groups, count)
        longest = max(row.max_len for row in self.rows)
        budgets = self._budgets(split, longest)
        if self.config.record_routes:
            from megatron_rl.models.router_replay import RouteRecorder

            self.recorder = RouteRecorder(self.chunks, batch=len(self.rows), total=longest, device=self.device)
        self.parts = [self._part(groups_of_part, budget, longest) for groups_of_part, budget in zip(split, budgets)]
        self.budgets = budgets

    def _budgets(self, split: list, longest: int) -> list:
        """Blocks per part: ``kv_memory_gib`` over the parts (under PP, what the fullest stage gets), or every
        row's at its longest."""
        memory = self.config.kv_memory_bytes
        if memory is None:  # a session's first prompts give its budget, as a call's would
            return [max(sum(self._blocks_of(row.max_len) for group in part for row in group.rows),
                        self._blocks_of(longest) if self.slots is not None else 0) for part in split]
        blocks = int(memory // len(split) // self.block_bytes)
        if self.chain.pp_size > 1:  # stages with fewer layers get as many blocks as the fullest: same admissions
            fewest = torch.full((1,), blocks, dtype=torch.long, device=collective_device(self.chain.pp_group))
            torch.distributed.all_reduce(fewest, op=torch.distributed.ReduceOp.MIN, group=self.chain.pp_group)
            blocks = int(fewest.item())
        if blocks < self._blocks_of(longest):
            raise ValueError(f"generation.kv_memory_gib={self.config.kv_memory_gib:.4g} holds {blocks} KV blocks of "
                             f"{self.config.kv_block_tokens} tokens" +
                             (f" per pipeline part ({len(split)})" if len(split) > 1 else "") +
                             f"; one completion of {longest} tokens needs {self._blocks_of(longest)}: "
                             f"raise generation.kv_memory_gib")
        return [blocks] * len(split)

    def _part(self, groups: list, budget: int, longest: int) -> EnginePart:
        """An engine part's rooms over a pool of ``budget`` blocks (and a scratch block for padding rows)."""
        config, hooks, chain = self.config, self.hooks, self.chain
        padded = self.lockstep.enabled or config.cuda_graphs
        pool = BlockPool(self.layers, num_blocks=budget + padded, block_tokens=config.kv_block_tokens,
                         dtype=self.dtype, device=self.device)
        scratch = pool.reserve() if padded else None  # one past the budget
        blocks = BlockManager(pool)
        scheduler = Scheduler(groups, blocks=blocks, budget=budget, max_concurrent=config.max_concurrent,
                              counters=self.counters,
                              finished_group=None if self.slots is None else self.slots.finished)
        positions = config.max_total_tokens if self.slots is not None else None
        context = PagedContext(pool, max_sequence_length=max(longest, positions or 0), device=self.device)
        graphs = DecodeGraphs(rows=len(self.rows), width=blocks.blocks_for(longest), device=self.device) \
            if config.cuda_graphs else None
        runner = ModelRunner(blocks=blocks, context=context, graphs=graphs, scratch=scratch, lockstep=self.lockstep,
                             recorder=self.recorder, counters=self.counters)
        turns = TurnHandover(hooks.turn_ended, settle_replies=hooks.settle_replies, end=scheduler.finish,
                             reply_steps=config.reply_steps,
                             replies_may_wait=(chain.pp_size == 1 and chain.tp_size == 1)
                             or hooks.settle_replies is not None)
        stops = (set(config.stop_ids), [list(s) for s in config.stop_sequences if len(s)])
        return EnginePart(scheduler=scheduler, runner=runner, turns=turns, stops=stops,
                          max_turn_tokens=config.max_turn_tokens)

    # ------------------------------------------------------------------ stops and a session's prompts
    def _poll(self) -> None:
        """After a step: the stop question, and a feed's next prompts, every STOP_POLL_STEPS steps."""
        if self.steps % STOP_POLL_STEPS:
            return
        if self.hooks.stop_requested is not None and self.hooks.stop_requested(True)[0]:
            raise GenerationStopped(f"stopped after {self.steps} engine steps")
        if self.slots is not None:
            self._admit_fed(self.hooks.feed.more(True, self.counters))

    def _feed_more(self, *, generating: bool) -> bool:
        """Nothing left to feed: True to go on (a feed's next prompts admitted), False when the run is done."""
        if self.slots is None:
            return False
        self._admit_fed(self.hooks.feed.more(generating, self.counters))
        return True

    def _admit_fed(self, prompts: list) -> None:
        """A feed's prompts join the part that was fed the fewest rows; each row must fit the part's whole pool."""
        block_tokens = self.config.kv_block_tokens
        for rows in self.slots.rows_of(prompts):
            need, most = self._blocks_of(rows[0].max_len), min(self.budgets)
            if need > most:
                raise ValueError(f"generation.kv_memory_gib holds {most} KV blocks of {block_tokens} tokens; a "
                                 f"completion of {rows[0].max_len} tokens needs {need}: raise generation.kv_memory_gib")
            for group in group_sequences(rows, share_prefill=self.config.share_prefill):
                min(self.parts, key=lambda part: part.fed_count).add([group])

    def _wait_for_other_workers(self) -> None:
        """A worker that finished keeps answering the stop question until no worker generates."""
        while self.hooks.stop_requested is not None:
            stop, anyone = self.hooks.stop_requested(False)
            if stop:
                raise GenerationStopped(f"stopped after {self.steps} engine steps (this worker had finished)")
            if not anyone:
                break

    def _stats(self, kernels: str, routes: Optional[list]) -> PagedStats:
        counters = self.counters
        return PagedStats(pool_bytes=sum(self.budgets) * self.block_bytes, block_bytes=self.block_bytes,
                          block_tokens=self.config.kv_block_tokens,
                          peak_blocks=sum(part.blocks.peak_blocks for part in self.parts),
                          peak_held_tokens=sum(part.blocks.peak_held for part in self.parts),
                          evictions=counters["evictions"], prefills=counters["prefills"], fed_tokens=counters["fed"],
                          steps=counters["forwards"] if len(self.parts) == 1 else self.steps, kernels=kernels,
                          routes=routes, graph_steps=counters["graph_steps"])

    # ------------------------------------------------------------------ pipeline parallelism
    def _run_pipelined(self) -> None:
        """Steps of the parts across the pipeline stages, successive steps overlapping (pipeline.py
        ``StageChain``): every rank walks (step, virtual stage, part); a part's step enters stage 0's first
        virtual stage once its previous choice is known there (the last stage sends each choice to every
        stage)."""
        chain, sends = self.chain, []
        try:
            while True:
                earlier, sends = sends, []
                fed_any = False
                for v in range(len(chain.chunks)):
                    for part in self.parts:
                        fed_any |= self._pipelined_stage(part, v, sends)
                for handle, _ in earlier:  # received by now: every rank has moved past the previous step
                    handle.wait()
                if not fed_any:
                    if self._feed_more(generating=False):
                        continue
                    return
                self.steps += 1
                try:
                    self._poll()
                except GenerationStopped:
                    # the last stage's choices of this step are on their way to the others: taken (and dropped)
                    # here, so its sends complete and no stale choice waits on a channel for a later call
                    for part in self.parts:
                        if part.awaiting:
                            chain.receive_choice(len(part.runner.sampled))
                            part.awaiting = False
                    raise
        finally:
            for handle, _ in sends:
                handle.wait()

    def _pipelined_stage(self, part: EnginePart, v: int, sends: list) -> bool:
        """Virtual stage ``v`` of ``part``'s step on this rank; whether the part is in the pipeline this step."""
        chain = self.chain
        if v == 0:
            if part.awaiting:
                part.postprocess(chain.receive_choice(len(part.runner.sampled)))
                part.awaiting = False
            part.in_flight = part.live and part.schedule()
            part.live = part.in_flight
        if not part.in_flight:
            return False
        runner = part.runner
        logits = chain.chunk_forward(v, runner.ids.unsqueeze(0), runner.positions.unsqueeze(0), sends,
                                     context=runner.context)
        runner.take_routes(chunk=v)
        if v < len(chain.chunks) - 1:
            return True
        if not runner.sampled:
            part.postprocess(None)
        elif chain.is_last_stage:
            part.postprocess(chain.send_choice(self._sample(part, logits), sends))
        else:
            part.awaiting = True
        return True
