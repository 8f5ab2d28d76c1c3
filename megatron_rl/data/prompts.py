"""GRPO prompt datasets from any supported data file, and a deterministic, resumable prompt sampler for rollouts.

Files: JSONL, JSON, Parquet, Arrow or a ``datasets.save_to_disk`` folder (``megatron_rl.data.records``). Each
record holds the prompt text under ``data.prompt_key`` ("prompt") or a chat prompt, a list of
``{"role", "content"}`` messages, under ``data.messages_key`` ("messages"); the reference answer under
``data.answer_key`` ("answer"); every other field is kept as metadata. With ``data.chat_template=true`` the prompt
is the tokenizer's chat template with the generation prompt (``data.system_prompt`` first), and its token ids
come with the record (``encode_prompt``). Bad input raises a one-line ConfigError naming file:line (JSONL) or the
file and its columns.

Sampling: epoch e visits the dataset in the order of a permutation drawn by `random.Random` seeded from
(seed, e); batches run on across epoch ends so every batch has batch_size prompts. Every rank that builds a
sampler with the same seed gets the same batches; `state_dict()` / `load_state_dict()` resume exactly.

Test: `.venv/bin/python -m pytest tests/test_prompt_data.py tests/test_data_formats.py -q`
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

from megatron_rl.data.chat import ChatFormat, check_messages
from megatron_rl.data.records import FORMATS, RecordFile, read_records
from megatron_rl.spec.errors import ConfigError

SAMPLER_STATE_VERSION = 1


@dataclasses.dataclass(kw_only=True, frozen=True)
class PromptRecord:
    """One prompt of a dataset."""

    prompt: str
    """The text the policy continues: the prompt as is, or rendered by the chat format (``megatron_rl.data.chat``)."""
    answer: Any
    """Reference answer for verifiers (None when the dataset has none and none is required)."""
    metadata: dict[str, Any]
    """Every other field of the record."""
    source: str
    """Where it came from: file:line (JSONL), "file row i", or synthetic:<task>:test:<i>."""
    prompt_ids: Optional[tuple[int, ...]] = None
    """The chat template's token ids of ``prompt`` (data.chat_template=true); None: encode ``prompt`` with BOS."""
    given: Any = None
    """The prompt as the data gave it (text or messages), for encoders that render it themselves (SFT warm-up)."""


class PromptDataset(Sequence[PromptRecord]):
    """An in-memory list of PromptRecord with a content fingerprint (to detect changed data on resume)."""

    def __init__(self, records: Sequence[PromptRecord], *, fingerprint: str | None = None) -> None:
        if not records:
            raise ConfigError("prompt dataset is empty: give a data file with at least one prompt")
        self.records = list(records)
        if fingerprint is None:
            digest = hashlib.sha256()
            for record in self.records:
                digest.update(json.dumps([record.prompt, record.answer], default=str).encode())
            fingerprint = digest.hexdigest()[:16]
        self.fingerprint = fingerprint

    @classmethod
    def from_files(
        cls,
        paths: str | Path | Sequence[str | Path],
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        messages_key: str = "messages",
        require_answer: bool = True,
        chat: Optional[ChatFormat] = None,
    ) -> PromptDataset:
        """Read one or more data files (any of records.FORMATS), in order; ``chat`` renders the prompts (None:
        text as is, messages as plain lines)."""
        if isinstance(paths, (str, Path)):
            paths = [paths]
        records: list[PromptRecord] = []
        digest = hashlib.sha256()
        keys = (prompt_key, answer_key, messages_key)
        for path in paths:
            data = read_records(path, what="prompt file", example=f'{{"{prompt_key}": ..., "{answer_key}": ...}}',
                                digest=digest, fix=f"point data.train_path / data.eval_path at {FORMATS}")
            for obj, where in data.rows:
                records.append(_parse_record(data, obj, where, keys, require_answer, chat))
        if not records:
            raise ConfigError(f"prompt file(s) {', '.join(map(str, paths))} hold no prompts")
        return cls(records, fingerprint=digest.hexdigest()[:16])

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):  # type: ignore[override]
        return self.records[index]


def _parse_record(data: RecordFile, obj: dict, where: str, keys: tuple[str, str, str], require_answer: bool,
                  chat: Optional[ChatFormat]) -> PromptRecord:
    prompt_key, answer_key, messages_key = keys
    text, messages = obj.get(prompt_key), obj.get(messages_key)
    if text is not None and messages is not None:
        raise ConfigError(f"{where}: give the prompt as {prompt_key!r} or as {messages_key!r}, not both")
    if text is None and messages is None:
        raise data.missing(obj, where, prompt_key, "set data.prompt_key to the prompt field (or data.messages_key "
                                                   "to a chat field)")
    if messages is not None:
        prompt = check_messages(messages, messages_key, where)
    elif not isinstance(text, str) or not text:
        raise ConfigError(f"{where}: {prompt_key!r} must be a non-empty string (set data.prompt_key to the prompt "
                          "field)")
    else:
        prompt = text
    if answer_key not in obj and require_answer:
        raise data.missing(obj, where, answer_key, "set data.answer_key to the field holding the reference answer")
    metadata = {key: value for key, value in obj.items() if key not in keys}
    return prompt_record(chat if chat is not None else ChatFormat(None), prompt, obj.get(answer_key), metadata,
                          where)


def prompt_record(chat: ChatFormat, prompt, answer: Any, metadata: dict, source: str) -> PromptRecord:
    text = chat.prompt_text(prompt, where=source)
    return PromptRecord(prompt=text, answer=answer, metadata=metadata, source=source,
                        prompt_ids=tuple(chat.ids(text)) if chat.chat_template else None, given=prompt)


def load_prompts(data_cfg, path: str | Path, tokenizer, *, require_answer: bool = True) -> PromptDataset:
    """The prompts of ``path`` with the field mapping and chat format of ``data_cfg`` (the job's DataConfig)."""
    return PromptDataset.from_files(path, prompt_key=data_cfg.prompt_key, answer_key=data_cfg.answer_key,
                                    messages_key=data_cfg.messages_key, require_answer=require_answer,
                                    chat=ChatFormat.from_config(data_cfg, tokenizer))


def load_eval_prompts(data, tokenizer, *, seed: int) -> Optional[PromptDataset]:
    """Held-out prompts for evaluation: ``data.eval_path``; else, for a synthetic ``data.task`` (no train_path),
    each of its test problems once (disjoint from the training problems of ``seed``); else None.

    ``data``: the job's data section; ``tokenizer``: what ``megatron_rl.data.tokenizer.load_tokenizer`` returns."""
    from megatron_rl.data.synthetic import TASKS, split_problems

    if data.eval_path is not None:
        return load_prompts(data, data.eval_path, tokenizer)
    if data.train_path is not None or data.task not in TASKS:
        return None
    chat = ChatFormat.from_config(data, tokenizer)
    _, problems = split_problems(data.task, seed=seed)
    records = [prompt_record(chat, problem["prompt"], problem["answer"], {"task": data.task},
                              f"synthetic:{data.task}:test:{i}") for i, problem in enumerate(problems)]
    return PromptDataset(records) if records else None


def load_prompt_data(data, tokenizer, *, seed: int, run_dir: Path,
                     write_once: Callable[[Callable[[], Any]], Any]) -> tuple[PromptDataset, list[dict]]:
    """(PromptDataset, SFT warm-up examples) of the data section ``data``: data.train_path (any format of
    megatron_rl.data.records, with its field mapping and chat format), or the synthetic data.task, which
    ``write_once`` (the job's ``on_rank_zero``) writes under ``run_dir``/data. The warm-up examples are
    data.warmup_task's correct answers, else the training data's."""
    from megatron_rl.data.sft import read_sft_records
    from megatron_rl.data.synthetic import TASKS, write_synthetic_dataset

    if data.warmup_task is not None and data.warmup_task not in TASKS:
        raise ConfigError(f"data.warmup_task={data.warmup_task!r} is not a synthetic task ({', '.join(TASKS)}); "
                          "or set it to null")
    if data.train_path:
        dataset = load_prompts(data, data.train_path, tokenizer)
        sft = [{"prompt": r.given, "completion": str(r.answer)} for r in dataset]
        return dataset, warmup_records(data.warmup_task, seed=seed) or sft
    if data.task not in TASKS:
        raise ConfigError(f"data.task={data.task!r} is not a synthetic task ({', '.join(TASKS)}); "
                          "or set data.train_path to a data file")
    data_dir = Path(run_dir) / "data"
    write_once(lambda: write_synthetic_dataset(data_dir, task=data.task, seed=seed, sft_answers="random"))
    dataset = load_prompts(data, data_dir / "train.jsonl", tokenizer)
    return dataset, warmup_records(data.warmup_task, seed=seed) or read_sft_records(data_dir / "sft.jsonl")


def warmup_records(task: Optional[str], *, seed: int) -> list[dict]:
    """Correct prompt/completion pairs of the synthetic ``task`` (data.warmup_task), or [] when it is None."""
    from megatron_rl.data.synthetic import sft_records, split_problems

    if task is None:
        return []
    problems, _ = split_problems(task, seed=seed)
    return sft_records(problems, task=task, answers="correct")


def encode_prompt(tokenizer, record: PromptRecord) -> list[int]:
    """The token ids a policy continues for ``record``: the chat template's ids, or BOS + the prompt text."""
    if record.prompt_ids is not None:
        return list(record.prompt_ids)
    return tokenizer.encode(record.prompt, add_bos=True)


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

    def record_at(self, index: int) -> PromptRecord:
        """The prompt at position ``index`` of the endless stream (epoch index // len, in that epoch's order),
        without moving the sampler: split-placement GRPO names prompts by these positions."""
        epoch, position = divmod(index, len(self.dataset))
        return self.dataset[self._epoch_order(epoch)[position]]

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
