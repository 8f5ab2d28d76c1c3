"""Fixed character-level tokenizers for tiny models, and the loader of Hugging Face tokenizer folders.

``CharTokenizer`` (``model.tokenizer: null`` or ``builtin:char-ascii``): ids 0 <pad>, 1 <bos>, 2 <eos>, 3 <unk>,
then '\\n' and the 95 printable ASCII characters ' '..'~' in code order: vocab_size 100.
``builtin:char-arabic``: the same special tokens, then newline, space, ASCII digits and arithmetic signs, the
Arabic letters (U+0621..U+063A, U+0641..U+064A), Arabic-Indic digits and the Arabic comma, semicolon and
question mark: vocab_size 70, for the Arabic synthetic tasks (megatron_rl/data/synthetic.py). Each vocabulary is
fixed in code, so every process and every checkpoint agrees on it.

Test: `.venv/bin/python -m pytest tests/test_prompt_data.py -q` (and tests/test_rm.py -k tokenizer)
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_rl.spec.run_files import BUILTIN_TOKENIZER_NAMES

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS: str = "\n" + "".join(chr(code) for code in range(32, 127))
ARABIC_CHARACTERS: str = ("\n 0123456789=+-.:" + "".join(chr(code) for code in range(0x0621, 0x063B))
                          + "".join(chr(code) for code in range(0x0641, 0x064B))
                          + "".join(chr(0x0660 + digit) for digit in range(10)) + "\u060c\u061b\u061f")


class CharTokenizer:
    """Character-level tokenizer with a fixed vocabulary (ASCII: vocab_size 100 <= 128)."""

    def __init__(self, characters: str = CHARACTERS, name: str = "char-ascii-v1") -> None:
        if len(set(characters)) != len(characters):
            raise ValueError("a character vocabulary lists each character once")
        self.name = name
        self._id_to_char = dict(enumerate(characters, start=len(SPECIAL_TOKENS)))
        self._char_to_id = {char: index for index, char in self._id_to_char.items()}
        self.vocab_size = len(SPECIAL_TOKENS) + len(characters)
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(len(SPECIAL_TOKENS))
        self.special_ids = frozenset(range(len(SPECIAL_TOKENS)))

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of text; characters outside the vocabulary become unk_id."""
        ids = [self._char_to_id.get(char, self.unk_id) for char in text]
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True, stop_at_eos: bool = True) -> str:
        """Text of ids. Stops at the first eos (stop_at_eos); special tokens are dropped or written as <name>."""
        pieces = []
        for token_id in ids:
            token_id = int(token_id)
            if token_id == self.eos_id and stop_at_eos:
                break
            if token_id in self.special_ids:
                if not skip_special_tokens:
                    pieces.append(SPECIAL_TOKENS[token_id])
                continue
            if token_id not in self._id_to_char:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
            pieces.append(self._id_to_char[token_id])
        return "".join(pieces)

    def __len__(self) -> int:
        return self.vocab_size

    def vocabulary(self) -> dict[str, int]:
        """Every token's id, special tokens included (``same_tokenizer`` compares these)."""
        return {**{name: i for i, name in enumerate(SPECIAL_TOKENS)},
                **{char: i for i, char in self._id_to_char.items()}}


class HFTokenizer:
    """A Hugging Face tokenizer from a local folder (no hub access), with CharTokenizer's interface."""

    def __init__(self, path: str, *, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer

        from megatron_rl.spec.errors import ConfigError

        if not trust_remote_code and ships_tokenizer_code(path):
            raise remote_code_refused(path)
        # trust_remote_code is passed only when allowed: transformers' own default (False) otherwise
        allowed = {"trust_remote_code": True} if trust_remote_code else {}
        try:
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True, **allowed)
        except Exception as err:  # transformers raises many kinds for a broken folder
            if not trust_remote_code and "trust_remote_code" in str(err):
                raise remote_code_refused(path) from None
            raise ConfigError(f"model.tokenizer={path!r}: could not load a tokenizer ({type(err).__name__}: "
                              f"{err})") from None
        self.name = path
        self.vocab_size = len(self.hf)
        self.eos_id = self.hf.eos_token_id
        self.bos_id = self.hf.bos_token_id
        pad = self.hf.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.special_ids = frozenset(self.hf.all_special_ids)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False)
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True, stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    def vocabulary(self) -> dict[str, int]:
        """Every token's id, added tokens included."""
        return self.hf.get_vocab()


def same_tokenizer(a, b) -> bool:
    """Whether two loaded tokenizers give every text the same ids: the same vocabulary and special ids (what a
    teacher's log-probs of a student's tokens need)."""
    return (a.vocabulary() == b.vocabulary() and (a.eos_id, a.bos_id, a.pad_id) == (b.eos_id, b.bos_id, b.pad_id)
            and type(a) is type(b))


def ships_tokenizer_code(path: str) -> bool:
    """True when the folder's tokenizer_config.json maps its tokenizer to Python code in the folder (`auto_map`)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("auto_map"))


def remote_code_refused(path: str):
    """The one-line ConfigError for a tokenizer folder whose code model.trust_remote_code does not allow."""
    from megatron_rl.spec.errors import ConfigError

    return ConfigError(f"model.tokenizer={path!r} needs the tokenizer code shipped in that folder (custom code, "
                       "e.g. a tiktoken tokenizer); set model.trust_remote_code=true to run it, if you trust it")


BUILTIN_TOKENIZERS = dict(zip(BUILTIN_TOKENIZER_NAMES, (lambda: CharTokenizer(),
                                                          lambda: CharTokenizer(ARABIC_CHARACTERS, name="char-arabic-v1"))))
"""The character tokenizers ``model.tokenizer`` may name instead of a folder (their names: the spec's)."""


def load_tokenizer(path: str | None, *, trust_remote_code: bool = False):
    """The built-in CharTokenizer when path is None, a built-in one by name (``BUILTIN_TOKENIZERS``), else a local
    Hugging Face tokenizer folder.

    ``trust_remote_code`` (model.trust_remote_code): allow a folder whose tokenizer is Python code shipped in it
    (tokenizer_config.json ``auto_map``, e.g. Kimi-K2); refused with a ConfigError otherwise. Never the hub."""
    if path is None:
        return CharTokenizer()
    if path in BUILTIN_TOKENIZERS:
        return BUILTIN_TOKENIZERS[path]()
    from pathlib import Path

    from megatron_rl.spec.errors import ConfigError

    if not Path(path).is_dir():
        raise ConfigError(f"model.tokenizer={path!r} is not a folder; give a local Hugging Face tokenizer folder "
                          f"(or null for the built-in character tokenizer; built-in ones: "
                          f"{', '.join(BUILTIN_TOKENIZERS)})")
    return HFTokenizer(path, trust_remote_code=trust_remote_code)


def check_fits(tokenizer, shape) -> None:
    """A ConfigError when ``tokenizer`` has more tokens than the model ``shape`` has embeddings for."""
    from megatron_rl.spec.errors import ConfigError

    if tokenizer.vocab_size > shape.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but model {shape.name} only "
                          f"{shape.vocab_size}; use a matching model.tokenizer")
