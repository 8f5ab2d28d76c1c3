"""Preference pairs for reward-model and DPO training: records of any data file (text or chat) or a seeded synthetic task,
tokenized and fitted.

Records (``megatron_rl.data.records``: JSONL, JSON, Parquet, Arrow or a save_to_disk folder; a bad JSONL line
raises ConfigError naming file:line, a missing column names the file and its columns):
- text:  ``{"prompt": "...", "chosen": "...", "rejected": "..."}`` (prompt optional; its key is ``data.prompt_key``);
- chat:  ``{"prompt": [messages] or "...", "chosen": [messages] or "...", "rejected": [...]}``, where a message is
  ``{"role": ..., "content": ...}``; ``messages`` (``data.messages_key``) may stand for a message-list prompt;
  chosen/rejected may also be whole conversations with no prompt (HH-RLHF style).

How a (prompt, response) becomes tokens (``SequenceEncoder``; the RM scorer uses the same rules):
- all text: ``prompt + response`` with the tokenizer's special tokens. An HF tokenizer: its own BOS, then EOS
  appended when absent (TRL's convention; the reward is read at the EOS). The character tokenizer: <bos> prompt
  response, NO <eos>: the reward is read at the response's last character. Measured on prefer_last_digit with
  tiny-cpu: held-out accuracy 0.98 after 100 steps without <eos>, 0.88 after 800 with it (the extra hop from
  <eos> back to the answer is slow to learn from scratch);
- any chat part: the conversation ``prompt messages + [assistant response]`` through the tokenizer's chat
  template when it has one; otherwise ``role: content`` lines as plain text;
- ``data.chat_template=true``: every pair, text ones too, as that conversation through the template (required),
  after ``data.system_prompt`` (``megatron_rl.data.chat.ChatFormat``).

Response starts (``response_starts=True``, the DPO trainer, which scores the response tokens only): the index of
each side's first response token is where its ids leave the prompt's ids encoded alone (text: the prompt's text;
chat: the prompt conversation with the template's generation prompt, or ``assistant: `` without a template), so a
token merged across the boundary counts as response. Whole conversations (no prompt) take their shared leading
messages as the prompt.

Pairs where a side is longer than ``max_length``: ``truncate`` keeps the BOS and the END of the sequence (the reward
is read at the last token) by cutting the start of the prompt; ``drop`` removes the pair. Both are counted.

Synthetic tasks (``data.task`` when ``data.train_path`` is null): ``prefer_<task>`` for each task of
``megatron_rl.data.synthetic`` (last_digit, first_digit, add, reverse). Chosen = the correct answer; rejected = a
wrong well-formed answer (3 in 4) or a malformed string. Train and eval pairs come from DISJOINT problems
(``synthetic.split_problems`` with the run seed), so held-out accuracy measures the rule, not memory.

Test: `.venv/bin/python -m pytest tests/test_rm.py -q`
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Optional

from megatron_rl.data import synthetic
from megatron_rl.data.chat import ChatFormat, Part, check_part, has_chat_template, plain_text
from megatron_rl.data.records import FORMATS, RecordFile, read_records
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.spec.errors import ConfigError

PREFERENCE_TASKS: tuple[str, ...] = tuple(f"prefer_{task}" for task in synthetic.TASKS)
SYNTHETIC_TRAIN_PAIRS = 4096
SYNTHETIC_EVAL_PAIRS = 256
_MALFORMED_CHARS = "abcdefghij0123456789 =+-"


@dataclasses.dataclass(kw_only=True, frozen=True)
class PreferenceRecord:
    """One preference pair as text or chat, before tokenization."""

    prompt: Optional[Part]
    """Prompt text or message list; None when chosen/rejected are whole conversations."""
    chosen: Part
    """Preferred response (text or messages)."""
    rejected: Part
    """Dispreferred response (text or messages)."""
    source: str
    """Where it came from: file:line, or synthetic:<task>:<split>:<n>."""


@dataclasses.dataclass(kw_only=True)
class PreferenceData:
    """Tokenized pairs that fit max_length, and what happened to the others."""

    chosen: list[list[int]]
    """Token ids of each kept pair's chosen sequence."""
    rejected: list[list[int]]
    """Token ids of each kept pair's rejected sequence (same order)."""
    name: str
    """Where the pairs came from (file path or synthetic task and split), for logs."""
    num_read: int
    """Pairs read before the length policy."""
    num_truncated: int
    """Kept pairs with at least one side truncated."""
    num_dropped: int
    """Pairs removed by the drop policy."""
    chosen_starts: list[int] = dataclasses.field(default_factory=list)
    """Index in each chosen sequence of its first response token (``tokenize_pairs(response_starts=True)``;
    empty otherwise)."""
    rejected_starts: list[int] = dataclasses.field(default_factory=list)
    """The same for the rejected sequences."""

    def __len__(self) -> int:
        return len(self.chosen)


class SequenceEncoder:
    """Token ids of (prompt, response) the way the reward model sees them (see the module docstring)."""

    def __init__(self, tokenizer, chat: Optional[ChatFormat] = None) -> None:
        """``tokenizer``: what ``megatron_rl.data.tokenizer.load_tokenizer`` returns; ``chat``: the data config's
        chat format (``ChatFormat.from_config``; None: no forced template, no system prompt)."""
        self.tokenizer = tokenizer
        self.chat = chat if chat is not None else ChatFormat(tokenizer)
        self.is_char = isinstance(tokenizer, CharTokenizer)
        self.pad_id, self.bos_id, self.eos_id = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
        self.has_chat_template = has_chat_template(tokenizer)

    def encode(self, prompt: Optional[Part], response: Part, *, where: str = "preference pair") -> list[int]:
        if not self.chat.chat_template and (prompt is None or isinstance(prompt, str)) and isinstance(response, str):
            return self._encode_text((prompt or "") + response)
        messages = self.chat.conversation(prompt, response)
        if self.has_chat_template:
            return self.chat.ids(self.chat.render(messages, add_generation_prompt=False, where=where))
        return self._encode_text(plain_text(messages))

    def response_start(self, prompt: Optional[Part], response: Part, ids: list[int], *,
                       where: str = "preference pair") -> int:
        """Index in ``ids`` (``encode(prompt, response)``) of the first response token: where ``ids`` leave the
        prompt encoded alone (see the module docstring)."""
        return common_prefix_length(self._prompt_ids(prompt, response, where=where), ids)

    def _prompt_ids(self, prompt: Optional[Part], response: Part, *, where: str) -> list[int]:
        if not self.chat.chat_template and (prompt is None or isinstance(prompt, str)) and isinstance(response, str):
            return self._encode_text(prompt or "")
        messages = self.chat.conversation(prompt)
        if self.has_chat_template:
            return self.chat.ids(self.chat.render(messages, add_generation_prompt=True, where=where)) if messages else []
        return self._encode_text(plain_text(messages) + "assistant: ")

    def _encode_text(self, text: str) -> list[int]:
        if self.is_char:
            return self.tokenizer.encode(text, add_bos=True)
        ids = list(self.tokenizer.hf(text, add_special_tokens=True)["input_ids"])
        if self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
            ids.append(self.eos_id)
        return ids

    def fit(self, ids: list[int], max_length: int) -> list[int]:
        """``ids`` cut to max_length keeping a leading BOS and the end (the caller counts the cut)."""
        if len(ids) <= max_length:
            return ids
        head = self._kept_head(ids, max_length)
        return ids[:head] + ids[len(ids) - (max_length - head):]

    def fit_with_start(self, ids: list[int], start: int, max_length: int) -> tuple[list[int], int]:
        """``fit`` plus where the response now starts (after the kept BOS when its own start was cut)."""
        kept = self.fit(ids, max_length)
        cut = len(ids) - len(kept)
        return kept, start if not cut else max(self._kept_head(ids, max_length), start - cut)

    def _kept_head(self, ids: list[int], max_length: int) -> int:
        return 1 if self.bos_id is not None and ids and ids[0] == self.bos_id and max_length > 1 else 0


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading entries ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def split_shared_prompt(record: PreferenceRecord) -> PreferenceRecord:
    """A whole-conversation pair (no prompt, both sides message lists) with its shared leading messages as the
    prompt; any other record as it is."""
    chosen, rejected = record.chosen, record.rejected
    if record.prompt is not None or isinstance(chosen, str) or isinstance(rejected, str):
        return record
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    if not shared:
        return record
    return dataclasses.replace(record, prompt=chosen[:shared], chosen=chosen[shared:], rejected=rejected[shared:])


def parse_preference(data: RecordFile, obj: dict, where: str, *, prompt_key: str = "prompt",
                     messages_key: str = "messages") -> PreferenceRecord:
    """One record of ``data`` as a PreferenceRecord; ConfigError naming ``where`` (or the file's columns)."""
    for key in ("chosen", "rejected"):
        if obj.get(key) is None:
            raise data.missing(obj, where, key, "a preference pair needs chosen and rejected")
    if obj.get(prompt_key) is not None and obj.get(messages_key) is not None:
        raise ConfigError(f"{where}: give the prompt as {prompt_key!r} or as {messages_key!r}, not both")
    key = messages_key if obj.get(messages_key) is not None else prompt_key
    prompt = obj.get(key)
    return PreferenceRecord(
        prompt=None if prompt is None else check_part(prompt, key, where, allow_empty=True),
        chosen=check_part(obj["chosen"], "chosen", where), rejected=check_part(obj["rejected"], "rejected", where),
        source=where)


def read_preference_records(path: str | Path, *, prompt_key: str = "prompt",
                            messages_key: str = "messages") -> list[PreferenceRecord]:
    """The preference pairs of a data file (any of records.FORMATS)."""
    data = read_records(path, what="preference file", fix=f"point data.train_path / data.eval_path at {FORMATS}",
                        example=f'{{"{prompt_key}": ..., "chosen": ..., "rejected": ...}}')
    records = [parse_preference(data, obj, where, prompt_key=prompt_key, messages_key=messages_key)
               for obj, where in data.rows]
    if not records:
        raise ConfigError(f"preference file {path} holds no pairs")
    return records




def synthetic_preference_records(task: str, *, split: str, num_pairs: int, seed: int) -> list[PreferenceRecord]:
    """``num_pairs`` seeded pairs of a ``prefer_<task>`` task from the train or test problems (disjoint)."""
    if task not in PREFERENCE_TASKS:
        raise ConfigError(f"data.task={task!r} is not a preference task; use one of {', '.join(PREFERENCE_TASKS)} "
                          "or give data.train_path")
    base = task[len("prefer_"):]
    train_problems, test_problems = synthetic.split_problems(base, seed=seed)
    problems = train_problems if split == "train" else test_problems
    answers = synthetic.answer_space(base)
    rng = random.Random(f"rm-pairs:{task}:{split}:{seed}")
    records = []
    for n in range(num_pairs):
        problem = problems[rng.randrange(len(problems))]
        correct = problem["answer"]
        rejected = correct
        while rejected == correct:
            kind = rng.random()
            if kind < 0.5:
                rejected = answers[rng.randrange(len(answers))]
            elif kind < 0.75:
                rejected = "".join(rng.choice(_MALFORMED_CHARS) for _ in range(rng.randint(1, 4)))
            else:  # a hard negative: the right answer with trailing junk, which a policy otherwise learns to game
                rejected = correct + "".join(rng.choice(_MALFORMED_CHARS) for _ in range(rng.randint(1, 3)))
        records.append(PreferenceRecord(prompt=problem["prompt"], chosen=correct, rejected=rejected,
                                        source=f"synthetic:{task}:{split}:{n}"))
    return records


def tokenize_pairs(records: list[PreferenceRecord], encoder: SequenceEncoder, *, max_length: int, truncation: str,
                   vocab_size: int, name: str, response_starts: bool = False) -> PreferenceData:
    """Tokenize, apply the length policy (truncate or drop, counted) and check ids against the model's vocab;
    with ``response_starts`` also record where each side's response begins."""
    data = PreferenceData(chosen=[], rejected=[], name=name, num_read=len(records), num_truncated=0, num_dropped=0)
    for record in records:
        if response_starts:
            record = split_shared_prompt(record)
        responses = (record.chosen, record.rejected)
        sides = [encoder.encode(record.prompt, response, where=record.source) for response in responses]
        starts = [encoder.response_start(record.prompt, response, ids, where=record.source) if response_starts
                  else 0 for response, ids in zip(responses, sides)]
        for ids in sides:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ConfigError(f"{record.source}: token id {bad[0]} is outside the model's vocabulary "
                                  f"({vocab_size}); model.tokenizer does not match model.name")
        if any(len(ids) > max_length for ids in sides):
            if truncation == "drop":
                data.num_dropped += 1
                continue
            data.num_truncated += 1
            sides, starts = zip(*(encoder.fit_with_start(ids, start, max_length) for ids, start in zip(sides, starts)))
        data.chosen.append(sides[0])
        data.rejected.append(sides[1])
        if response_starts:
            data.chosen_starts.append(starts[0])
            data.rejected_starts.append(starts[1])
    if not data.chosen:
        raise ConfigError(f"{name}: every pair is longer than data.max_length={max_length} and was dropped; "
                          "raise data.max_length or set data.truncation=truncate")
    return data


def load_preference_splits(data_cfg, encoder: SequenceEncoder, *, max_length: int, vocab_size: int, seed: int,
                           response_starts: bool = False) -> tuple[PreferenceData, Optional[PreferenceData]]:
    """(train, eval or None) from ``data.train_path``/``eval_path`` or the synthetic ``data.task``."""
    common = dict(max_length=max_length, truncation=data_cfg.truncation, vocab_size=vocab_size,
                  response_starts=response_starts)
    if data_cfg.train_path is None:
        task = data_cfg.task
        if task not in PREFERENCE_TASKS:
            raise ConfigError(f"data.task={task!r} is not a preference task and data.train_path is null; use "
                              f"data.task={PREFERENCE_TASKS[0]} (or another of {', '.join(PREFERENCE_TASKS)}) or give "
                              "a data file of prompt/chosen/rejected")
        train = tokenize_pairs(synthetic_preference_records(task, split="train", num_pairs=SYNTHETIC_TRAIN_PAIRS,
                                                            seed=seed), encoder, name=f"{task} (train)", **common)
        held_out = synthetic_preference_records(task, split="test", num_pairs=SYNTHETIC_EVAL_PAIRS, seed=seed)
        return train, tokenize_pairs(held_out, encoder, name=f"{task} (held-out)", **common)
    keys = dict(prompt_key=data_cfg.prompt_key, messages_key=data_cfg.messages_key)
    train = tokenize_pairs(read_preference_records(data_cfg.train_path, **keys), encoder,
                           name=str(data_cfg.train_path), **common)
    if data_cfg.eval_path is None:
        return train, None
    return train, tokenize_pairs(read_preference_records(data_cfg.eval_path, **keys), encoder,
                                 name=str(data_cfg.eval_path), **common)
