"""Print a run's logs, and follow them as they grow (``tail -f``) until the run ends; or its latest samples.

    python launch.py logs RUN_DIR [--follow] [--rank N]
    python launch.py logs RUN_DIR --samples          # the completions of the latest step in samples.jsonl

Local runs: ``logs/rank<N>.log`` (stdout and stderr of the rank). Slurm runs, the latest job: its batch log
(prefixed ``[batch]``), then rank N's stdout and stderr (``[stderr]``); a requeued job appends to the same files.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from launcher.runs.folder import RunFolder, open_run
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.run_files import SAMPLES_FILE

FOLLOW_POLL_S = 0.5


class LogTail:
    """New complete lines of a file that may not exist yet."""

    def __init__(self, path: Path, prefix: str = "") -> None:
        self.path, self.prefix, self.offset, self.partial = path, prefix, 0, b""

    def read_new(self) -> str:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return ""
        self.offset += len(data)
        data = self.partial + data
        complete, _, self.partial = data.rpartition(b"\n")
        if not complete:
            return ""
        return "".join(f"{self.prefix}{line}\n" for line in complete.decode(errors="replace").split("\n"))


def rank_tails(run: RunFolder, rank: int) -> list[LogTail]:
    """The files ``logs`` prints for ``rank``, in order; ConfigError when the rank has no log."""
    paths = run.rank_logs(rank)
    if not paths:
        ranks = run.ranks_with_logs()
        have = f"ranks with logs: {', '.join(map(str, ranks))}; give --rank {ranks[0]}" if ranks else \
            "no rank has written a log yet (a pending job? see `launch.py status`)"
        raise ConfigError(f"logs: rank {rank} has no log in {run.path} ({have})")
    prefixes = {"batch": "[batch] ", "stderr": "[stderr] "}
    return [LogTail(path, prefixes.get(kind, "")) for kind, path in paths]


def print_logs(path: Path, *, rank: int = 0, follow: bool = False, out: TextIO = sys.stdout) -> int:
    """Print rank ``rank``'s logs; with ``follow``, keep printing new lines until the run ends."""
    run = open_run(path, command="logs")
    tails = rank_tails(run, rank)
    for tail in tails:
        out.write(tail.read_new())
    out.flush()
    if follow:
        follow_tails(tails, still_running=run.is_running, out=out)
    return 0


def follow_tails(tails: list[LogTail], *, still_running: Callable[[], bool], out: TextIO,
                 poll_s: float = FOLLOW_POLL_S) -> None:
    """Print new lines of ``tails`` every ``poll_s`` seconds while ``still_running()``, and once after."""
    running = True
    while running:
        running = still_running()
        for tail in tails:
            out.write(tail.read_new())
        out.flush()
        if running:
            time.sleep(poll_s)


def print_samples(path: Path, *, out: TextIO = sys.stdout) -> int:
    """Print the completions of the latest step in the run's samples.jsonl (``logging.sample_every``)."""
    run = open_run(path, command="logs")
    samples_path = run.path / SAMPLES_FILE
    lines = samples_path.read_text(encoding="utf-8").splitlines() if samples_path.is_file() else []
    try:
        records = [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as error:
        raise ConfigError(f"logs --samples: {samples_path} is not JSON lines ({error})") from None
    if not records:
        raise ConfigError(f"logs --samples: {run.path} has no samples yet (GRPO and PPO write them every "
                          "logging.sample_every steps; 0 turns them off)")
    step = records[-1]["step"]
    latest = [record for record in records if record.get("step") == step]
    out.write(f"step {step}: {len(latest)} of its completions ({samples_path})\n")
    for index, record in enumerate(latest, 1):
        per_fn = ", ".join(f"{name} {value:g}" for name, value in record.get("rewards", {}).items())
        reward = "?" if record.get("reward") is None else f"{record['reward']:g}"
        advantage = "" if record.get("advantage") is None else f"  advantage {record['advantage']:+.3f}"
        cut = ", cut at the length limit" if record.get("truncated") else ""
        out.write(f"[{index}] reward {reward}{f' ({per_fn})' if per_fn else ''}{advantage}  "
                  f"{record.get('response_tokens', '?')} tokens{cut}\n")
        for key in ("prompt", "completion", "answer"):
            text = str(record.get(key, "")).replace("\n", "\n" + " " * 16)
            out.write(f"    {key + ':':<12}{text}\n")
    out.flush()
    return 0
