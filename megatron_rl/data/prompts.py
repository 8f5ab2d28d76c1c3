"""JSONL prompt datasets and a deterministic, resumable prompt sampler for GRPO rollouts.

Each line is a JSON object: `{"prompt": "...", "answer": ..., ...}`; the answer key is configurable and every
other key is kept as metadata. Blank lines are skipped. Bad input raises ConfigError naming file:line.

Sampling: epoch e visits the dataset in the order of a permutation drawn by `random.Random` seeded from
(seed, e); batches run on across epoch ends so every batch has batch_size prompts. Every rank that builds a
sampler with the same seed gets the same batches; `state_dict()` / `load_state_dict()` resume exactly.

Test: `.venv/bin/python -m pytest tests/test_prompt_data.py -q`
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from launcher.errors import ConfigError
from megatron_rl.data.jsonl import read_jsonl

SAMPLER_STATE_VERSION = 1


@dataclasses.dataclass(kw_only=True, frozen=True)
class PromptRecord:
    """One prompt of a dataset."""

    prompt: str
    """The prompt text, fed to the policy as is (no chat template)."""
    answer: Any
    """Reference answer for verifiers (None when the dataset has none and none is required)."""
    metadata: dict[str, Any]
    """Every other key of the JSON line."""
    source: str
    """Where it came from, as file:line."""


class PromptDataset(Sequence[PromptRecord]):
    """An in-memory list of PromptRecord with a content fingerprint (to detect changed data on resume)."""

    def __init__(self, records: Sequence[PromptRecord], *, fingerprint: str | None = None) -> None:
        if not records:
            raise ConfigError('prompt dataset is empty: give a JSONL file with at least one {"prompt": ...} line')
        self.records = list(records)
        if fingerprint is None:
            digest = hashlib.sha256()
            for record in self.records:
                digest.update(json.dumps([record.prompt, record.answer], default=str).encode())
            fingerprint = digest.hexdigest()[:16]
        self.fingerprint = fingerprint

    @classmethod
    def from_jsonl(
        cls,
        paths: str | Path | Sequence[str | Path],
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        require_answer: bool = True,
    ) -> PromptDataset:
        """Read one or more JSONL files, in order."""
        if isinstance(paths, (str, Path)):
            paths = [paths]
        records: list[PromptRecord] = []
        digest = hashlib.sha256()
        example = f'{{"{prompt_key}": ..., "{answer_key}": ...}}'
        for path in paths:
            for obj, where in read_jsonl(path, what="prompt file", example=example, digest=digest,
                                         fix="point the dataset path (data.train_path) at an existing JSONL file"):
                records.append(_parse_record(obj, where, prompt_key, answer_key, require_answer))
        if not records:
            raise ConfigError(f"prompt file(s) {', '.join(map(str, paths))} hold no prompts")
        return cls(records, fingerprint=digest.hexdigest()[:16])

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):  # type: ignore[override]
        return self.records[index]


def _parse_record(obj: dict, where: str, prompt_key: str, answer_key: str, require_answer: bool) -> PromptRecord:
    prompt = obj.get(prompt_key)
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError(
            f"{where}: no non-empty string field {prompt_key!r} (set the dataset's prompt_key to the prompt field)"
        )
    if answer_key not in obj and require_answer:
        raise ConfigError(
            f"{where}: no {answer_key!r} field (set the dataset's answer_key to the field holding the reference answer)"
        )
    metadata = {key: value for key, value in obj.items() if key not in (prompt_key, answer_key)}
    return PromptRecord(prompt=prompt, answer=obj.get(answer_key), metadata=metadata, source=where)


class PromptSampler:
    """Endless batches of prompts in a seeded order per epoch; resumable from (epoch, position)."""

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int, *, shuffle: bool = True) -> None:
        if batch_size < 1:
            raise ConfigError(f"prompt sampler: batch_size={batch_size} must be >= 1")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(f"prompt-sampler:{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next_indices(self) -> list[int]:
        """Dataset indices of the next batch (advances the sampler)."""
        indices: list[int] = []
        while len(indices) < self.batch_size:
            order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(indices), len(order) - self.position)
            indices.extend(order[self.position : self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch += 1
                self.position = 0
        return indices

    def next_batch(self) -> list[PromptRecord]:
        """The next batch_size prompts (advances the sampler)."""
        return [self.dataset[index] for index in self.next_indices()]

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        while True:
            yield self.next_batch()

    @property
    def consumed_samples(self) -> int:
        return self.epoch * len(self.dataset) + self.position

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": SAMPLER_STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": len(self.dataset),
            "fingerprint": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off; refuses a state from different data, seed or shuffle setting."""
        if state.get("version") != SAMPLER_STATE_VERSION:
            raise ConfigError(f"prompt sampler state version {state.get('version')!r} is not {SAMPLER_STATE_VERSION}")
        if state["num_samples"] != len(self.dataset) or state["fingerprint"] != self.dataset.fingerprint:
            raise ConfigError(
                f"the prompt data changed since the checkpoint ({state['num_samples']} prompts, fingerprint "
                f"{state['fingerprint']}; now {len(self.dataset)}, {self.dataset.fingerprint}): restore the original "
                "files or start a new run directory"
            )
        if state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ConfigError(
                f"the checkpoint's prompt sampler used seed={state['seed']}, shuffle={state['shuffle']}; the config "
                f"says seed={self.seed}, shuffle={self.shuffle}: set them back or start a new run directory"
            )
        if not 0 <= state["position"] < len(self.dataset) or state["epoch"] < 0:
            raise ValueError(f"prompt sampler state out of range: {state}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
