"""Peak memory of a phase of one process: device memory on GPUs, resident memory (RSS) on CPU.

    with peak_memory_of(engine.peak_memory, "train"):
        ...                                   # engine.peak_memory["train"] = the most bytes held inside

On GPUs it is ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: tensors only, as the
planner counts them. On CPU it is the kernel's high-water mark of resident memory (``VmHWM``), reset by writing
5 to ``/proc/self/clear_refs`` (Linux >= 4.0); it includes the interpreter and libraries (hundreds of MB). Where
the reset is refused, the mark is the process's peak so far.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

GIB = 1024**3
PHASES = ("generate", "train")
"""Phases whose peaks the trainers log (``peak_memory_<phase>_gib`` in metrics.jsonl)."""


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@contextlib.contextmanager
def peak_memory_of(sink: dict[str, int], phase: str) -> Iterator[None]:
    """Record in ``sink[phase]`` the most memory held inside the block (the largest over repeated blocks)."""
    reset_peak()
    try:
        yield
    finally:
        sink[phase] = max(sink.get(phase, 0), peak_bytes())
