"""The episode journal: every environment reset and step of a training rollout, written as it happens, so that a run
resumed in the middle of a step's episodes (preempted or killed between turns) replays what its environments already
did instead of doing it again.

One file per rollout draw and rank (``<run.dir>/episodes/step_00000012_draw0_rank1.jsonl``, private), a line per
call: the episode's index on this rank, the turn (0 = reset), the policy's text the step was given, the outcome
(the messages, reward, done and info; or the error or timeout) and the environment's state after it (pickled; None
when the environment cannot be pickled). A resumed step generates the same turns (exact resume: same seeds and
weights), and each ``(episode, turn)`` whose text matches is answered from the journal, the environment put back to
its recorded state, without calling it; the first turn that differs (a generation that did not repeat itself) is
stepped for real from the state before it, and the episode's older entries are dropped. Lines are flushed to the
operating system as they are written, which survives the process being killed or preempted; a node crash may lose
the last ones (their calls then run again). Journals of steps a checkpoint already holds are deleted
(``prune_journals``).

Environments whose state cannot be pickled are replayed from the journal's outcomes, but their own state is not
restored: a turn after the replayed ones then runs on a fresh environment.

Test: ``.venv/bin/python -m pytest tests/test_environments.py -q -k journal``
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import threading
from pathlib import Path
from typing import Any, Optional

from megatron_rl.environments.episode import Environment

JOURNAL_DIR = "episodes"
"""The run folder's subfolder of episode journals."""


def journal_path(run_dir: str | Path, *, step: int, draw: int, rank: int) -> Path:
    return Path(run_dir) / JOURNAL_DIR / f"step_{step:08d}_draw{draw}_rank{rank}.jsonl"


def prune_journals(run_dir: str | Path, *, upto: int) -> None:
    """Delete the journals of steps <= ``upto`` (held by a checkpoint: never generated again)."""
    folder = Path(run_dir) / JOURNAL_DIR
    if not folder.is_dir():
        return
    for path in folder.glob("step_*.jsonl"):
        match = re.match(r"step_(\d+)_", path.name)
        if match and int(match.group(1)) <= upto:
            path.unlink(missing_ok=True)


def _state(env: Environment) -> Optional[str]:
    try:
        return base64.b64encode(pickle.dumps(env)).decode("ascii")
    except Exception:  # noqa: BLE001 - an environment holding a lock, a socket, a process: its state is not kept
        return None


class EpisodeJournal:
    """The journal of one rollout draw on this rank: ``recorded(episode, turn, text)`` answers a call made before,
    ``write`` records a new one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[int, dict[int, dict]] = {}
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut by the kill: nothing after it was written
                turns = self.entries.setdefault(entry["episode"], {})
                if entry.get("diverged"):
                    for turn in [t for t in turns if t >= entry["turn"]]:
                        del turns[turn]
                else:
                    turns[entry["turn"]] = entry
        self.replayed = 0
        self._lock = threading.Lock()  # episodes step in threads (environment.concurrent_steps)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def recorded(self, episode: int, turn: int, text: str) -> Optional[dict]:
        """The entry of this call when the journal has one for the same text; None (and the episode's entries from
        this turn on are dropped) otherwise."""
        with self._lock:
            return self._recorded(episode, turn, text)

    def _recorded(self, episode: int, turn: int, text: str) -> Optional[dict]:
        entry = self.entries.get(episode, {}).get(turn)
        if entry is None:
            return None
        if entry["text"] != text:
            self._append({"episode": episode, "turn": turn, "diverged": True})
            for later in [t for t in self.entries[episode] if t >= turn]:
                del self.entries[episode][later]
            return None
        self.replayed += 1
        return entry

    def write(self, episode: int, turn: int, text: str, outcome: Any, env: Environment) -> None:
        """Record a call made now: its outcome (JSON) and the environment's state after it."""
        entry = {"episode": episode, "turn": turn, "text": text, "outcome": outcome, "state": _state(env)}
        with self._lock:
            self.entries.setdefault(episode, {})[turn] = entry
            self._append(entry)

    @staticmethod
    def restore(entry: dict, env: Environment) -> Environment:
        """The environment as it was after ``entry``'s call (``env`` itself when its state was not kept)."""
        return env if entry.get("state") is None else pickle.loads(base64.b64decode(entry["state"]))

    def _append(self, entry: dict) -> None:
        self._file.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
