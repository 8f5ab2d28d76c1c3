"""Chat data: message lists, and how prompts and responses become text (data.chat_template, data.system_prompt).

A message is ``{"role": ..., "content": ...}``; a part (a prompt or a response) is a string or a message list. With
``data.chat_template=true`` a conversation goes through the tokenizer's own chat template (transformers'
``apply_chat_template``; prompts with ``add_generation_prompt=True``), after ``data.system_prompt`` as a system
message unless the conversation has one. Without it, text stays as is and messages become ``role: content`` lines
(prompts end in ``assistant: ``), which any tokenizer, the character one too, can encode.

Test: `.venv/bin/python -m pytest tests/test_data_formats.py -q`
"""

from __future__ import annotations

from typing import Any, Optional, Union

from megatron_rl.spec.errors import ConfigError

Messages = list[dict]
Part = Union[str, Messages]


def is_messages(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of ``{"role": str, "content": str}`` messages."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def check_messages(value: Any, key: str, where: str) -> Messages:
    """``value`` (the field ``key`` of the record at ``where``) as a message list; ConfigError otherwise."""
    if not is_messages(value):
        raise ConfigError(f'{where}: {key!r} must be a non-empty list of {{"role": ..., "content": ...}} messages')
    return value


def check_part(value: Any, key: str, where: str, *, allow_empty: bool = False) -> Part:
    """``value`` as a string (non-empty unless ``allow_empty``) or a message list; ConfigError otherwise."""
    if isinstance(value, str):
        if not value and not allow_empty:
            raise ConfigError(f"{where}: {key!r} is an empty string")
        return value
    if not is_messages(value):
        raise ConfigError(f'{where}: {key!r} must be a string or a non-empty list of {{"role": ..., "content": ...}} '
                          "messages")
    return value


def as_messages(part: Part, role: str) -> Messages:
    return [{"role": role, "content": part}] if isinstance(part, str) else list(part)


def plain_text(messages: Messages) -> str:
    """Messages as ``role: content`` lines, for tokenizers without a chat template."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` (from ``load_tokenizer``) is a Hugging Face tokenizer with a chat template."""
    return bool(getattr(getattr(tokenizer, "hf", None), "chat_template", None))


class ChatFormat:
    """How prompts, responses and conversations become text and token ids for one tokenizer and data config."""

    def __init__(self, tokenizer, *, chat_template: bool = False, system_prompt: Optional[str] = None) -> None:
        if chat_template and not has_chat_template(tokenizer):
            name = getattr(tokenizer, "name", type(tokenizer).__name__)
            raise ConfigError(f"data.chat_template=true but the tokenizer {name} has no chat template; set "
                              "data.chat_template=false or model.tokenizer to a folder whose tokenizer has one")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt

    @classmethod
    def from_config(cls, data_cfg, tokenizer) -> ChatFormat:
        """The format ``data.chat_template`` / ``data.system_prompt`` ask for."""
        return cls(tokenizer, chat_template=data_cfg.chat_template, system_prompt=data_cfg.system_prompt)

    def conversation(self, prompt: Optional[Part], response: Optional[Part] = None) -> Messages:
        """[system prompt] + prompt (a string is the user's turn) + response (a string is the assistant's turn)."""
        messages = ([] if prompt is None else as_messages(prompt, "user")) + (
            [] if response is None else as_messages(response, "assistant"))
        if self.system_prompt is not None and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def render(self, messages: Messages, *, add_generation_prompt: bool, where: str = "chat data") -> str:
        """``messages`` through the tokenizer's chat template."""
        try:
            return self.tokenizer.hf.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
        except Exception as err:  # jinja raises its own kinds, and templates raise on roles they refuse
            raise ConfigError(f"{where}: the tokenizer's chat template failed on this conversation "
                              f"({type(err).__name__}: {err})") from None

    def ids(self, text: str) -> list[int]:
        """Token ids of rendered template text (its special tokens are in the text, none are added)."""
        return list(self.tokenizer.hf(text, add_special_tokens=False)["input_ids"])

    def prompt_text(self, prompt: Part, *, where: str = "chat data") -> str:
        """The text a policy continues: the template with the generation prompt, the text as is, or plain lines."""
        if self.chat_template:
            return self.render(self.conversation(prompt), add_generation_prompt=True, where=where)
        return prompt if isinstance(prompt, str) else plain_text(prompt) + "assistant: "
