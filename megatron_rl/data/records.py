"""Reading data records from any supported file: JSONL, JSON, Parquet, Arrow, or a ``datasets.save_to_disk`` folder.

Every dataset kind (GRPO prompts, SFT examples, preference pairs) reads its files here and parses the records
itself. JSONL is read line by line (blank lines skipped) so errors name file:line; the other formats go through
Hugging Face ``datasets`` (``load_dataset("json"/"parquet"/"arrow", data_files=...)``, ``load_from_disk``),
offline and with its Arrow cache in a private temporary folder that is deleted once the records are in memory
(nothing lands in ``~/.cache/huggingface``). Their errors name the file and, for a missing field, its columns.

Test: `.venv/bin/python -m pytest tests/test_data_formats.py -q`
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any, Optional

from megatron_rl.spec.errors import ConfigError

FORMATS = "a .jsonl, .json, .parquet or .arrow file, or a datasets.save_to_disk folder"
_DATASETS_BUILDERS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


@dataclasses.dataclass(frozen=True)
class RecordFile:
    """The records of one data file, in file order."""

    path: Path
    rows: list[tuple[dict, str]]
    """(record, where): where is ``file:line`` for JSONL and ``file row i`` (0-based) for the other formats."""
    columns: Optional[tuple[str, ...]]
    """The table's columns; None for JSONL, whose lines each have their own keys."""

    def missing(self, obj: dict, where: str, key: str, fix: str) -> ConfigError:
        """The error for a record without ``key``: a table's names the file and its columns, JSONL's the line."""
        if self.columns is not None and key not in self.columns:
            return ConfigError(f"{self.path}: no column {key!r} (columns: {', '.join(self.columns)}); {fix}")
        return ConfigError(f"{where}: no {key!r} field (fields: {', '.join(obj) or 'none'}); {fix}")


def read_records(path: str | Path, *, what: str, fix: str, example: str, digest: Optional[Any] = None) -> RecordFile:
    """The records of ``path`` (a file of one of FORMATS, or a save_to_disk folder).

    what: the kind of file for messages ("prompt file"); fix: how to point the job at the right file; example:
    the shape of one record, shown when a JSONL line is not an object. ``digest`` (a hashlib object) sees every
    raw JSONL line, or each record of the other formats as canonical JSON.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what} {path} not found: {fix}")
    if path.is_file() and path.suffix == ".jsonl":
        return RecordFile(path, list(_read_jsonl(path, example, digest)), None)
    if not path.is_dir() and path.suffix not in _DATASETS_BUILDERS:
        raise ConfigError(f"{what} {path}: unsupported format {path.suffix or '(no suffix)'!r}; give {FORMATS}")
    rows, columns = _read_with_datasets(path, what)
    if digest is not None:
        for row in rows:
            digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return RecordFile(path, [(row, f"{path} row {i}") for i, row in enumerate(rows)], columns)


def _read_jsonl(path: Path, example: str, digest: Optional[Any]):
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


def _read_with_datasets(path: Path, what: str) -> tuple[list[dict], tuple[str, ...]]:
    import datasets

    datasets.disable_progress_bars()  # every rank reads the data; one bar per rank is noise
    try:
        if path.is_dir():
            table = datasets.load_from_disk(str(path), keep_in_memory=True)
            if isinstance(table, datasets.DatasetDict):
                raise ConfigError(f"{what} {path} is a DatasetDict with splits {', '.join(table)}: point the path at "
                                  f"one split's folder, e.g. {path / next(iter(table))}")
            return table.to_list(), tuple(table.column_names)
        with tempfile.TemporaryDirectory(prefix="megatron-rl-datasets-") as cache_dir:
            table = datasets.load_dataset(_DATASETS_BUILDERS[path.suffix], data_files=[str(path)], split="train",
                                          cache_dir=cache_dir, keep_in_memory=True)
            return table.to_list(), tuple(table.column_names)
    except ConfigError:
        raise
    except Exception as err:  # datasets and pyarrow raise many kinds for a broken file
        reason = err.__cause__ or err
        message = " ".join(str(reason).split())[:300]
        raise ConfigError(f"{what} {path}: datasets could not read it ({type(reason).__name__}: {message}); give "
                          f"{FORMATS}") from None
