"""Multi-turn rollouts: each completion is an episode of the policy with an environment (megatron_rl/environments).

``sample_episodes`` is ``sample_rollout`` for a job with an ``environment``: every completion of a prompt starts
an episode (``env.reset(record)`` gives the first messages, rendered like any prompt; a GRPO group shares the
prompt's KV blocks), and whenever a turn ends (a stop string such as ``</calc>``, end-of-sequence, or
``max_turn_tokens``) the engine hands it to the episode, whose reply is rendered through the chat format and fed
onto the row's own KV blocks (engine.py ``TurnEnded``). The environment steps run in
``environment.concurrent_steps`` threads while the other rows go on decoding. At tp > 1 or pp > 1 only the first
rank of the replica steps the environments (in its threads; the ranks agree at each engine step which replies came,
``StepThreads.settle``; the resets, and the steps with ``concurrent_steps`` 0, are shared in the engine's order,
``ReplicaShare``), and the rollout takes its episodes (the async worker's first rank sends them). With experts over
several workers the workers decode in lockstep, as in single-turn runs. The response is the whole conversation after
the prompt;
``Rollout.response_mask`` marks the policy's tokens (the only ones trained: the replies are context), the reward
is the environment's (the sum of its turns'), and ``completions`` hold each episode's last turn, which
``algorithm.rewards`` score as the final answer.

Test: ``.venv/bin/python -m pytest tests/test_multi_turn.py -q``
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from megatron_rl.data.chat import ChatFormat, Messages, as_messages, plain_text
from megatron_rl.data.prompts import PromptRecord, encode_prompt, prompt_record
from megatron_rl.generation.config import EngineConfig
from megatron_rl.environments import END_REASONS, Environment, Episode, EpisodeLimits, build_environment
from megatron_rl.environments.journal import EpisodeJournal, journal_path, prune_journals
from megatron_rl.environments.sandbox import hide_always
from megatron_rl.rollout.batch import Rollout
from megatron_rl.runtime import checkpoint as ckpt
from megatron_rl.runtime.training import data_parallel_share, gather_data_parallel
from megatron_rl.spec.errors import ConfigError


class Environments:
    """A job's environment (``environment:``): the factory of fresh environments and the episode limits. The run
    and checkpoint folders are hidden from every sandbox."""

    def __init__(self, env_cfg, *, hidden: list, run_dir: Optional[str] = None) -> None:
        """``env_cfg``: the job's ``environment`` section; ``hidden``: folders no sandbox may see."""
        hide_always(hidden)
        self.run_dir = run_dir
        """Where the training rollouts' episode journals go (None: no journal)."""
        self.make = build_environment(env_cfg.name, env_cfg.options)
        self.limits = EpisodeLimits(max_turns=env_cfg.max_turns, max_turn_tokens=env_cfg.max_turn_tokens,
                                    max_episode_tokens=env_cfg.max_episode_tokens,
                                    step_timeout_s=env_cfg.step_timeout_s)
        self.concurrent_steps = env_cfg.concurrent_steps
        self.reply_steps = env_cfg.reply_steps

    @classmethod
    def of(cls, env_cfg, *, run_dir: str, checkpoint_dir: str) -> Optional["Environments"]:
        """The job's environments (``env_cfg``: its environment section; its run and checkpoint folders hidden), or
        None without environment.name."""
        return None if env_cfg.name is None else cls(env_cfg, hidden=[run_dir, checkpoint_dir], run_dir=run_dir)

    def sample(self, chunks: list, prompts: list, *, step: Optional[int] = None, draw: int = 0,
               **options) -> Rollout:
        """``sample_episodes`` of ``prompts`` in fresh environments of this job, within its limits; a training
        rollout (``step``, its ``draw``-th) keeps this rank's episode journal, so a resumed step does not call its
        environments again for what they did before the stop."""
        journal = None
        if step is not None and self.run_dir is not None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            journal = journal_path(self.run_dir, step=step, draw=draw, rank=rank)
        return sample_episodes(chunks, prompts, make_env=self.make, limits=self.limits, journal=journal, step=step,
                               concurrent_steps=self.concurrent_steps, reply_steps=self.reply_steps, **options)

    def forget_through(self, step: Optional[int]) -> None:
        """Delete the episode journals of steps up to ``step`` (a checkpoint holds them)."""
        if step is not None and self.run_dir is not None:
            prune_journals(self.run_dir, upto=step)


def episode_metrics(episodes: list) -> dict:
    """Means over a rollout's episodes: turns, tool calls (an environment's ``info["tool_calls"]``), the share
    that called a tool at all, and the share of each way an episode ended."""
    if not episodes:
        return {}
    count = len(episodes)
    calls = [max((t.get("info", {}).get("tool_calls", 0) for t in e["turns"]), default=0) for e in episodes]
    ends = {reason: sum(e["end"] == reason for e in episodes) / count for reason in END_REASONS}
    return {"env_turns": sum(len(e["turns"]) for e in episodes) / count, "env_tool_calls": sum(calls) / count,
            "env_tool_call_rate": sum(c > 0 for c in calls) / count,
            **{f"env_end_{reason}": share for reason, share in ends.items() if share}}


def _given(record: PromptRecord):
    return record.given if record.given is not None else record.prompt


def env_record(record: PromptRecord) -> dict:
    """What ``env.reset`` reads: the prompt as the data gave it, the answer and every other field."""
    return {**record.metadata, "prompt": _given(record), "answer": record.answer}


class Conversation:
    """One episode's text as the policy sees it: the first prompt's ids, then each turn and rendered reply."""

    def __init__(self, chat: ChatFormat, record: PromptRecord, first: Messages) -> None:
        self.chat = chat
        given = _given(record)
        part = given if first == as_messages(given, "user") else first  # the data's own prompt, as without an env
        self.prompt_ids = encode_prompt(chat.tokenizer, prompt_record(chat, part, record.answer, record.metadata,
                                                                      record.source))
        self.messages = chat.conversation(first)

    def reply_ids(self, turn_text: str, reply: Messages, *, ended_with_eos: bool) -> list[int]:
        """The tokens that follow the policy's turn (its text ``turn_text``): what closes the turn unless the
        policy wrote it (end-of-sequence), the reply, then what opens the policy's next turn."""
        if not self.chat.chat_template:
            self.messages += [{"role": "assistant", "content": turn_text}, *reply]
            return self.chat.tokenizer.encode("\n" + plain_text(reply) + "assistant: ")
        held = self.chat.render(self.messages, add_generation_prompt=True, where="an environment's reply") + turn_text
        self.messages += [{"role": "assistant", "content": turn_text}, *reply]
        after = self.chat.render(self.messages, add_generation_prompt=True, where="an environment's reply")
        if not after.startswith(held):
            raise ConfigError("the tokenizer's chat template renders an earlier turn differently once a reply "
                              "follows (it rewrites history, e.g. drops reasoning): multi-turn rollouts need a "
                              "template whose conversation only grows; set data.chat_template=false or use another")
        delta = after[len(held):]
        eos = getattr(self.chat.tokenizer.hf, "eos_token", None)
        if ended_with_eos and eos and delta.startswith(eos):
            delta = delta[len(eos):]
        return self.chat.ids(delta)


class ReplicaShare:
    """``Episode``'s ``share`` in a rollout worker of several TP or PP ranks, which hold the same episodes and sample
    the same tokens: the first rank makes each environment call and broadcasts its outcome in the order all of them
    reach it (engine.py hands turns over at the same point of its walk on every rank). Inside ``alone()`` (a step in
    the first rank's threads, ``StepThreads``) the first rank makes the call by itself: the others make none."""

    def __init__(self, group, src: int) -> None:
        self.group, self.src = group, src
        self.leader = torch.distributed.get_rank() == src
        self._thread = threading.local()

    def __call__(self, call: Callable[[], dict]) -> dict:
        if getattr(self._thread, "alone", False):
            return call()
        return self.broadcast(call() if self.leader else None)

    def alone(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)``, its environment calls made here only."""
        self._thread.alone = True
        try:
            return fn(*args, **kwargs)
        finally:
            self._thread.alone = False

    def broadcast(self, value):
        """The first rank's ``value`` on every rank of the replica."""
        box = [value]
        torch.distributed.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


def model_parallel_share() -> tuple[Optional[ReplicaShare], bool]:
    """(share, whether this rank makes the environment calls): a ``ReplicaShare`` over the TP and PP ranks of this
    rollout worker (Megatron's model-parallel group; its first rank calls); at tp = pp = 1, (None, True)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() == 1:
        return None, True
    group = ps.get_model_parallel_group()
    share = ReplicaShare(group, min(torch.distributed.get_process_group_ranks(group)))
    return share, share.leader


def episode_turn(episode: Episode, conversation: Conversation, turn: list, finish: str, *,
                 step: Optional[int] = None) -> Optional[list]:
    """A policy turn (its tokens, and "stop" or "length") handed to its episode: the reply's tokens to feed, or None
    when the episode has ended. ``step``: the training step (fault point ``kill-between-turns``)."""
    tokenizer, limits = conversation.chat.tokenizer, episode.limits
    text = tokenizer.decode(turn)
    cut = None if finish == "stop" else "turn" if len(turn) >= limits.max_turn_tokens else "episode"
    reply = episode.advance(text, tokens=len(turn), cut=cut)
    ckpt.fault_point("kill-between-turns", step)
    if reply is None:
        return None
    ids = conversation.reply_ids(text, reply, ended_with_eos=turn[-1] == tokenizer.eos_id)
    return ids if episode.count_reply(len(ids)) else None


def episode_engine_config(config: EngineConfig, tokenizer, limits: EpisodeLimits, envs: list, *,
                          stop: Sequence[str], reply_steps: int) -> EngineConfig:
    """The engine's settings for episodes: ``config`` (the generation settings, ``engine_config``), with an
    episode's token limits, the environments' stop strings (tool calls) beside ``stop`` (generation.stop) and
    environment.reply_steps."""
    stops = sorted({s for env in envs for s in env.stop} | set(stop))
    return dataclasses.replace(config, max_new_tokens=limits.max_episode_tokens,
                               max_total_tokens=limits.max_episode_tokens, max_turn_tokens=limits.max_turn_tokens,
                               stop_sequences=[tokenizer.encode(s) for s in stops], reply_steps=reply_steps)


class StepThreads:
    """Where environment steps run: in ``concurrent`` threads beside generation (``run`` returns a future the
    engine waits on), or, with 0, at once (``run`` returns the reply). With a ``share`` (a replica of several
    ranks) only its first rank runs them, in its threads; every rank's engine gets a future that ``settle``
    completes, on all ranks at the same step, with the first rank's reply."""

    def __init__(self, concurrent: int, share: Optional[ReplicaShare] = None) -> None:
        self.share = share if concurrent else None
        threads = concurrent and (share is None or share.leader)
        self.pool = ThreadPoolExecutor(max_workers=concurrent, thread_name_prefix="env-step") if threads else None
        self.concurrent = concurrent
        self.made: dict = {}
        """The first rank's running steps: id of the future its engine holds -> the thread's future."""

    def run(self, fn: Callable, *args, **kwargs):
        if not self.concurrent:
            return fn(*args, **kwargs)
        if self.share is None:
            return self.pool.submit(fn, *args, **kwargs)
        shown = Future()
        if self.share.leader:
            self.made[id(shown)] = self.pool.submit(self.share.alone, fn, *args, **kwargs)
        return shown

    def settle(self, waiting: list, wait: bool) -> None:
        """The engine's ``settle_replies``: which of ``waiting`` (the same futures on every rank, in one order) are
        done is the first rank's word, broadcast; with ``wait``, it waits for one first."""
        done = None
        if self.share.leader:
            made = [self.made[id(future)] for future in waiting]
            if wait:
                futures.wait(made, return_when=futures.FIRST_COMPLETED)
            done = [(i, _outcome(step)) for i, step in enumerate(made) if step.done()]
        for i, (failed, reply) in self.share.broadcast(done):
            self.made.pop(id(waiting[i]), None)
            if failed:
                raise RuntimeError(f"an environment step failed on the replica's first rank: {reply}")
            waiting[i].set_result(reply)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)  # a step ends within environment.step_timeout_s


def _outcome(step: Future) -> tuple[bool, object]:
    """(whether it raised, its reply or the error) of a finished step."""
    error = step.exception()
    return (True, f"{type(error).__name__}: {error}") if error is not None else (False, step.result())


class WorkerEpisodes:
    """The async rollout worker's episodes (rollout/worker.py ``OrderFeed``): each prompt of an order starts a group
    of episodes in fresh environments, handed to the engine's session as a ``FedPrompt`` whose ``turns`` steps
    them; when the group has ended, ``payload`` gives the trainers what a colocated rollout holds (the first
    prompt's ids, the policy mask, the environments' rewards and each episode's log; at tp or pp > 1 the first rank,
    which steps the environments and sends the samples, holds them). Resumed runs issue a
    prompt again, so its environments are called again (no journal: the worker keeps no step's state)."""

    def __init__(self, envs: Environments, chat: ChatFormat, config: EngineConfig, *, stop: Sequence[str]) -> None:
        """``envs``: the job's (no journal); ``chat``: the prompts' format; ``config``: the generation settings
        (``engine_config``); ``stop``: generation.stop."""
        self.envs = envs
        self.chat = chat
        self.share, _ = model_parallel_share()
        self.steps = StepThreads(envs.concurrent_steps, self.share)
        self.config = episode_engine_config(config, chat.tokenizer, envs.limits, [envs.make()], stop=stop,
                                            reply_steps=envs.reply_steps)
        self.settle = self.steps.settle if self.steps.share is not None else None
        self.open: dict = {}

    def fed_prompt(self, record: PromptRecord, *, group: int, seed: int, first_request: int, tag):
        """The FedPrompt of ``group`` episodes of ``record``."""
        from megatron_rl.generation.feed import FedPrompt

        episodes = [Episode(self.envs.make(), self.envs.limits, share=self.share) for _ in range(group)]
        conversations = [Conversation(self.chat, record, e.start(env_record(record))) for e in episodes]
        if any(c.prompt_ids != conversations[0].prompt_ids for c in conversations):
            raise ConfigError("the environment's reset gave the episodes of one prompt different first messages: a "
                              "GRPO group shares its prompt, so make reset depend on the record alone")
        for episode, conversation in zip(episodes, conversations):
            episode.count_prompt(len(conversation.prompt_ids))
        self.open[tag] = (episodes, conversations)

        def turns(j: int, turn: list, finish: str):
            return self.steps.run(episode_turn, episodes[j], conversations[j], turn, finish)

        return FedPrompt(tokens=tuple(conversations[0].prompt_ids), completions=group, seed=seed,
                         first_request=first_request, tag=tag, turns=turns)

    def payload(self, tag, done) -> dict:
        """The ended group's sample payload (``done``: the engine's FinishedPrompt)."""
        episodes, conversations = self.open.pop(tag)
        return {"response_ids": done.responses, "logprobs": done.logprobs, "policy_mask": done.policy_masks,
                "truncated": [e.end_reason in ("turn_tokens", "episode_tokens") for e in episodes],
                "prompt_token_ids": [list(c.prompt_ids) for c in conversations],
                "completions": [e.turns[-1].text if e.turns else "" for e in episodes],
                "env_rewards": [e.reward for e in episodes], "episodes": [e.log() for e in episodes]}

    def close(self) -> None:
        self.steps.close()


def sample_episodes(chunks: list, prompts: list, *, config: EngineConfig, chat: ChatFormat, stop: Sequence[str],
                    make_env: Callable[[], Environment], limits: EpisodeLimits, concurrent_steps: int,
                    reply_steps: int, group: int, seed: int, seq_multiple: int,
                    stop_requested: Optional[Callable[[bool], tuple]] = None, journal: Optional[Path] = None,
                    step: Optional[int] = None) -> Rollout:
    """``group`` episodes of each prompt record (prompt-major), each rollout worker running its share; every rank
    gets the whole rollout with ``episodes`` (each one's log) and ``response_mask``. Inside a generation phase.
    ``config``: the generation settings (``engine_config``; with ``record_routes``, each episode's experts for
    router replay, the replies' positions included); ``chat``: the prompts' format; ``stop``: generation.stop;
    ``concurrent_steps``, ``reply_steps``: the environment section's. ``journal``: this rank's episode journal (environments/journal.py), whose calls made before a resume are
    replayed, not made again; ``step``: the training step (fault point ``kill-between-turns``)."""
    from megatron_rl.generation import data_parallel_seed, generate

    records = [p for p in prompts for _ in range(group)]
    mine_records = data_parallel_share(records, with_context_parallel=True)
    share, leader = model_parallel_share()
    book = EpisodeJournal(journal) if journal is not None and leader else None
    episodes, conversations = [], []
    for index, record in enumerate(mine_records):
        episode = Episode(make_env(), limits, journal=book, index=index, share=share)
        conversation = Conversation(chat, record, episode.start(env_record(record)))
        episode.count_prompt(len(conversation.prompt_ids))
        episodes.append(episode)
        conversations.append(conversation)
    steps = StepThreads(concurrent_steps, share)

    def turn_ended(index: int, turn: list, finish: str):
        return steps.run(episode_turn, episodes[index], conversations[index], turn, finish, step=step)

    try:
        out = generate(
            [ckpt.unwrap(c) for c in chunks], [c.prompt_ids for c in conversations],
            episode_engine_config(config, chat.tokenizer, limits, [e.env for e in episodes], stop=stop,
                                  reply_steps=reply_steps),
            turn_ended=turn_ended, seed=data_parallel_seed(seed), stop_requested=stop_requested,
            settle_replies=steps.settle if steps.share is not None else None)
    finally:
        steps.close()
        if book is not None:
            book.close()
    # the episodes as the first rank of the replica stepped them (the others hold its replies only)
    ended = [(e.end_reason in ("turn_tokens", "episode_tokens"), e.turns[-1].text if e.turns else "", e.reward,
              e.log()) for e in episodes]
    if share is not None:
        ended = share.broadcast(ended if leader else None)
    routes = out.routes or [None] * len(out.tokens)
    sampled = gather_data_parallel(
        [(c.prompt_ids, list(tokens), list(map(float, lp)), list(mask), *episode, route)
         for c, episode, tokens, lp, mask, route in zip(conversations, ended, out.tokens, out.logprobs,
                                                        out.policy_mask, routes)],
        with_context_parallel=True)
    return Rollout(prompt_ids=[s[0] for s in sampled], response_ids=[s[1] for s in sampled],
                   logprobs=[s[2] for s in sampled], response_mask=[s[3] for s in sampled],
                   prompts=[r.prompt for r in records], completions=[s[5] for s in sampled],
                   answers=[r.answer for r in records], truncated=[s[4] for s in sampled],
                   env_rewards=[s[6] for s in sampled], episodes=[s[7] for s in sampled],
                   routes=[s[8] for s in sampled] if out.routes is not None else [], seq_multiple=seq_multiple)
