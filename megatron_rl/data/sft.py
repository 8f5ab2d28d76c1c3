"""Supervised examples: prompt/completion JSONL and their encoding for next-token training.

JSONL lines hold ``prompt`` (the key is ``data.prompt_key``) and ``completion`` (``answer`` is accepted too).
Test: `.venv/bin/python -m pytest tests/test_prompt_data.py -q`
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from launcher.errors import ConfigError
from megatron_rl.data.jsonl import read_jsonl


def read_sft_jsonl(path: str | Path, *, prompt_key: str = "prompt") -> list[dict]:
    """[{"prompt", "completion"}] from a JSONL file; errors name file:line."""
    records = []
    for obj, where in read_jsonl(path, what="SFT data file", fix="point data.train_path at a JSONL file",
                                 example=f'{{"{prompt_key}": ..., "completion": ...}}'):
        completion = obj.get("completion", obj.get("answer"))
        if not isinstance(obj.get(prompt_key), str) or completion is None:
            raise ConfigError(f"{where}: needs string fields {prompt_key!r} and 'completion'")
        records.append({"prompt": obj[prompt_key], "completion": str(completion)})
    if not records:
        raise ConfigError(f"SFT data file {path} holds no examples")
    return records


def encode_sft_example(tokenizer, prompt: str, completion: str,
                       max_length: Optional[int] = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) for next-token SFT: <bos> prompt completion <eos>; the mask is 1 on completion+eos.

    mask[i] says whether ids[i] is a target, so the loss at position i-1 (predicting ids[i]) counts. Both are
    cut to ``max_length`` tokens when given.
    """
    prompt_ids = tokenizer.encode(prompt, add_bos=True)
    completion_ids = tokenizer.encode(completion, add_eos=True)
    ids, mask = prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)
    return ids[:max_length], mask[:max_length]
