"""Reading JSONL data files: one JSON object per line, blank lines skipped, every error naming file:line.

Each dataset kind (prompts, preference pairs, SFT examples) parses the objects itself; this module owns what
they share: the file check, UTF-8 decoding, the JSON parse and the one-line ``ConfigError``s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional

from launcher.errors import ConfigError


def read_jsonl(path: str | Path, *, what: str, fix: str, example: str,
               digest: Optional[Any] = None) -> Iterator[tuple[dict, str]]:
    """Yield ``(object, "file:line")`` for each non-blank line of ``path``.

    what: the kind of file for messages ("prompt file"); fix: how to point the job at the right file; example:
    the shape of one line, shown when a line is not an object. ``digest`` (a hashlib object) sees every raw line.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} not found: {fix}")
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if digest is not None:
                digest.update(raw)
            where = f"{path}:{number}"
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                raise ConfigError(f"{where}: not UTF-8 ({err.reason})") from None
            if not text:
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{where}: expected a JSON object like {example}")
            yield obj, where
