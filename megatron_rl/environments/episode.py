"""The environment interface, and an episode: one conversation of a policy with an environment, within limits.

An environment is a class (named by a registered name or a dotted path, built with its options once per episode):

    class MyEnv:
        stop = ("</calc>",)                  # strings that end a policy turn besides end-of-sequence (tool calls)
        def reset(self, record) -> list[dict]:        # the prompt record -> the first messages
        def step(self, assistant_text) -> StepResult: # the policy's turn -> (messages or None, reward, done, info)

``step`` returns the messages the environment says back (a tool's result, the user's next turn) or None when it
has nothing to add, the turn's reward (an episode's reward is the sum of its turns'), whether the episode is done,
and an info dict that goes to the sample log. ``Episode`` holds the limits (``EpisodeLimits``): the turns, the
tokens of one turn and of the whole episode, and seconds per step; an episode that hits one ends with that reason.
A step that raises ends the episode with reason "env_error" (the trainer goes on; the sample log shows the error).

Test: ``.venv/bin/python -m pytest tests/test_environments.py -q``
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Optional, Protocol, Sequence

Messages = list[dict]

END_REASONS = ("done", "no_reply", "max_turns", "turn_tokens", "episode_tokens", "step_timeout", "env_error")
"""Why an episode ended: the environment said done; it had nothing to say back; the turn limit; a turn reached
``max_turn_tokens`` without stopping; the conversation reached ``max_episode_tokens``; a step ran past
``step_timeout_s``; a step raised."""


class StepResult(NamedTuple):
    messages: Optional[Messages]
    """What the environment says back (roles "user", "tool" or "system"); None: nothing, the episode ends."""
    reward: float = 0.0
    done: bool = False
    info: dict = {}


class Environment(Protocol):
    stop: Sequence[str]

    def reset(self, record: Mapping[str, Any]) -> Messages: ...

    def step(self, assistant_text: str) -> StepResult: ...


@dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """How long one episode may run."""

    max_turns: int = 4
    """Policy turns in an episode."""
    max_turn_tokens: int = 64
    """Tokens the policy may generate in one turn."""
    max_episode_tokens: int = 512
    """Tokens of the whole conversation (prompt, turns and the environment's messages)."""
    step_timeout_s: float = 30.0
    """Seconds one ``step`` may take (its tools have their own, shorter limits)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_episode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"environment.{name} must be at least 1, got {getattr(self, name)}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"environment.step_timeout_s must be positive, got {self.step_timeout_s}")


@dataclass
class Turn:
    """One policy turn and what followed it."""

    text: str
    tokens: int
    reward: float = 0.0
    reply: Optional[Messages] = None
    info: dict = field(default_factory=dict)
    reply_fed: bool = True
    """False when the reply did not fit under ``max_episode_tokens`` and the episode ended before it."""


class Episode:
    """One environment instance driven turn by turn: ``start`` gives the first messages; ``advance`` takes a policy
    turn and gives what to append (None when the episode has ended, ``end_reason`` says why)."""

    def __init__(self, env: Environment, limits: EpisodeLimits, *, bounded: bool = True, journal=None,
                 index: int = 0, share: Optional[Callable[[Callable[[], dict]], dict]] = None) -> None:
        self.env = env
        self.limits = limits
        self._bounded = bounded
        self._journal = journal
        """An ``EpisodeJournal`` (journal.py) that records each call, and answers those made before a resume."""
        self._index = index
        """This episode's index in the journal."""
        self._share = share
        """``share(call)``: ``call()``'s outcome, made by one process and handed to the others that hold the same
        episode (the TP ranks of a rollout worker), so the environment runs once; None: made here."""
        self.turns: list[Turn] = []
        self.tokens = 0
        self.end_reason: Optional[str] = None
        self.error: Optional[str] = None

    @property
    def reward(self) -> float:
        return sum(turn.reward for turn in self.turns)

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    def start(self, record: Mapping[str, Any]) -> Messages:
        """The environment's first messages for ``record``."""
        outcome = self._journaled(0, json.dumps(record, sort_keys=True, default=str),
                                  lambda: {"messages": self.env.reset(record)})
        return outcome["messages"]

    def count_prompt(self, tokens: int) -> None:
        """The rendered first messages' length: the conversation's start."""
        self.tokens = tokens

    def advance(self, text: str, *, tokens: int, cut: Optional[str] = None) -> Optional[Messages]:
        """The policy's turn (``tokens`` long) -> the messages to append, or None when the episode is over.
        ``cut``: None when the turn ended by itself (a stop string, end-of-sequence), "turn" when generation cut it
        at ``max_turn_tokens``, "episode" when at ``max_episode_tokens`` (the turn is not stepped then)."""
        if self.done:
            raise RuntimeError("advance() on an episode that has ended")
        turn = Turn(text=text, tokens=tokens)
        self.turns.append(turn)
        self.tokens += tokens
        if cut is not None:
            return self._end({"turn": "turn_tokens", "episode": "episode_tokens"}[cut])
        outcome = self._journaled(len(self.turns), text, lambda: self._step_outcome(text))
        if "timeout" in outcome:
            return self._end("step_timeout")
        if "error" in outcome:
            self.error = outcome["error"]
            return self._end("env_error")
        messages, reward, done, info = _as_step_result(outcome["result"])
        turn.reward, turn.reply, turn.info = float(reward), messages, dict(info or {})
        if done:
            return self._end("done")
        if not messages:
            return self._end("no_reply")
        if len(self.turns) >= self.limits.max_turns:
            return self._end("max_turns")
        return messages

    def count_reply(self, tokens: int) -> bool:
        """Count the rendered reply's tokens; False (and the episode ends) when the conversation, with room for one
        more token of the policy, would pass ``max_episode_tokens``."""
        self.tokens += tokens
        if self.tokens + 1 > self.limits.max_episode_tokens:
            self.turns[-1].reply_fed = False
            self._end("episode_tokens")
            return False
        return True

    def _step_outcome(self, text: str) -> dict:
        """The step of ``text`` as the journal keeps it: its result, or how it failed."""
        try:
            return {"result": list(self._step(text))}
        except TimeoutError:
            return {"timeout": True}
        except Exception as error:  # noqa: BLE001 - an environment's bug ends its episode, not the job
            return {"error": f"{type(error).__name__}: {error}"}

    def _journaled(self, turn: int, text: str, call: Callable[[], dict]) -> dict:
        """``call()`` (the environment's reset or step), or its outcome from the journal when a run before a
        resume made it with the same text (the environment then put back to its state after it); shared."""
        if self._share is not None:
            return self._share(lambda: self._made(turn, text, call))
        return self._made(turn, text, call)

    def _made(self, turn: int, text: str, call: Callable[[], dict]) -> dict:
        if self._journal is None:
            return call()
        entry = self._journal.recorded(self._index, turn, text)
        if entry is not None:
            self.env = self._journal.restore(entry, self.env)
            return entry["outcome"]
        outcome = call()
        self._journal.write(self._index, turn, text, outcome, self.env)
        return outcome

    def _step(self, text: str) -> StepResult:
        if not self._bounded:
            return _as_step_result(self.env.step(text))
        return _as_step_result(call_within(self.env.step, text, seconds=self.limits.step_timeout_s))

    def _end(self, reason: str) -> None:
        assert reason in END_REASONS
        self.end_reason = reason
        return None

    def log(self) -> dict:
        """The episode for the sample log: each turn's text, tokens, reward and reply (``reply_fed`` false when it
        did not fit and the episode ended instead), and how it ended."""
        return {"turns": [{"text": t.text, "tokens": t.tokens, "reward": t.reward, "reply": t.reply,
                           **({"info": t.info} if t.info else {}),
                           **({} if t.reply_fed else {"reply_fed": False})} for t in self.turns],
                "reward": self.reward, "end": self.end_reason, **({"error": self.error} if self.error else {})}


def call_within(fn: Callable[[str], Any], arg: str, *, seconds: float) -> Any:
    """``fn(arg)`` on a daemon thread; TimeoutError after ``seconds`` (the thread is abandoned: Python cannot stop
    it, and a daemon thread never holds the process open at exit). Its exception is raised here."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(arg)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            box["error"] = error

    thread = threading.Thread(target=run, name="env-step", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"step took more than {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _as_step_result(value: Any) -> StepResult:
    if isinstance(value, StepResult):
        return value
    try:
        messages, reward, done, info = value
    except (TypeError, ValueError):
        raise TypeError(f"step() must return (messages or None, reward, done, info), got {value!r:.80}") from None
    return StepResult(messages, float(reward), bool(done), dict(info or {}))
