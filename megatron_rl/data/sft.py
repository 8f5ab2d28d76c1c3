"""Supervised examples: prompt/completion records from any supported data file, and their encoding for next-token
training.

Records (``megatron_rl.data.records``: JSONL, JSON, Parquet, Arrow or a save_to_disk folder) hold the prompt text
under ``data.prompt_key`` and the completion under ``completion`` (else ``data.answer_key``), or a chat, a list of
``{"role", "content"}`` messages under ``data.messages_key``, whose last message (the assistant's) is the
completion and the messages before it the prompt.

Test: `.venv/bin/python -m pytest tests/test_prompt_data.py tests/test_data_formats.py -q`
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

from megatron_rl.data.chat import ChatFormat, Part, check_messages
from megatron_rl.data.records import FORMATS, read_records
from megatron_rl.spec.errors import ConfigError


def read_sft_records(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
                     messages_key: str = "messages") -> list[dict]:
    """[{"prompt": text or messages, "completion": text}]; errors name file:line (JSONL) or the file's columns."""
    data = read_records(path, what="SFT data file", fix=f"point data.train_path at {FORMATS}",
                        example=f'{{"{prompt_key}": ..., "completion": ...}}')
    records = []
    for obj, where in data.rows:
        if obj.get(prompt_key) is None and obj.get(messages_key) is not None:
            messages = check_messages(obj[messages_key], messages_key, where)
            if messages[-1]["role"] != "assistant":
                raise ConfigError(f"{where}: {messages_key!r} must be a list of messages ending in the assistant's "
                                  "reply (the completion)")
            records.append({"prompt": messages[:-1], "completion": messages[-1]["content"]})
            continue
        if not isinstance(obj.get(prompt_key), str):
            raise data.missing(obj, where, prompt_key, "set data.prompt_key to the prompt field (a string), or "
                                                       "data.messages_key to a chat field")
        completion_key = "completion" if obj.get("completion") is not None else answer_key
        if obj.get(completion_key) is None:
            raise data.missing(obj, where, "completion", f"give each example a 'completion' (or data.answer_key "
                                                         f"{answer_key!r}) field")
        records.append({"prompt": obj[prompt_key], "completion": str(obj[completion_key])})
    if not records:
        raise ConfigError(f"SFT data file {path} holds no examples")
    return records


def encode_sft_example(tokenizer, prompt: Part, completion: str, max_length: Optional[int] = None, *,
                       chat: Optional[ChatFormat] = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) for next-token SFT; the mask is 1 on the completion and its end.

    Without a chat template: <bos> prompt completion <eos> (a message-list prompt as ``role: content`` lines).
    With ``chat`` using the template: the prompt through the template with the generation prompt, then the rest of
    the rendered conversation (the assistant's turn and the template's end of turn), then <eos> when that does not
    already hold it. mask[i] says whether ids[i] is a target, so the loss at position i-1 (predicting ids[i])
    counts. Both are cut to ``max_length`` tokens when given.
    """
    chat = chat if chat is not None else ChatFormat(tokenizer)
    if chat.chat_template:
        prompt_text = chat.prompt_text(prompt)
        whole = chat.render(chat.conversation(prompt, completion), add_generation_prompt=False)
        if not whole.startswith(prompt_text):
            raise ConfigError("data.chat_template=true: the tokenizer's chat template does not render a prompt (with "
                              "the generation prompt) as the start of the conversation, so SFT cannot tell the "
                              "completion apart; set data.chat_template=false")
        prompt_ids, completion_ids = chat.ids(prompt_text), chat.ids(whole[len(prompt_text):])
        if tokenizer.eos_id is not None and tokenizer.eos_id not in completion_ids:
            completion_ids.append(tokenizer.eos_id)
    else:
        prompt_ids = tokenizer.encode(chat.prompt_text(prompt), add_bos=True)
        completion_ids = tokenizer.encode(completion, add_eos=True)
    ids, mask = prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)
    return ids[:max_length], mask[:max_length]


def encode_examples(tokenizer, records: list[dict], max_length: int,
                    chat: Optional[ChatFormat] = None) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per record (``encode_sft_example``)."""
    return [encode_sft_example(tokenizer, r["prompt"], r["completion"], max_length, chat=chat) for r in records]


def batch_for_step(examples: list, *, step: int, batch_size: int, seed: int) -> list:
    """The SFT examples of a step: a deterministic function of (seed, step), the same on every rank."""
    rng = random.Random(f"sft:{seed}:{step}")
    return [examples[rng.randrange(len(examples))] for _ in range(batch_size)]


def sft_seq_length(examples: list, *, multiple: int = 1) -> int:
    """The longest example, rounded up to ``multiple`` (``Engine.sequence_multiple``); the extra positions are
    masked right padding, so the loss does not change."""
    longest = max(len(ids) for ids, _ in examples)
    return -(-longest // multiple) * multiple
