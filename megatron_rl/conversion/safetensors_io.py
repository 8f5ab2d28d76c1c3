"""Hugging Face folders: checked reading of (sharded) safetensors and a streaming sharded writer.

Headers are parsed in pure Python (8-byte length + JSON), so a missing, truncated or mismatched shard is found
before any tensor is read. Tensors are read with pread into fresh tensors, not through mmap, so a reader's
resident memory is what it holds, not everything it has read. The writer plans every shard's header from names,
dtypes and shapes alone, then streams each tensor's bytes into place as soon as it is converted: memory holds
one tensor group, not a shard.

FP8 block-quantized checkpoints (DeepSeek-V3, Kimi-K2: ``quantization_config`` with ``quant_method: fp8`` and
``weight_block_size``; an ``F8_E4M3`` weight ``W`` beside an fp32 ``W_scale_inv`` of one scale per block) are
dequantized as they are read: ``read_rows`` returns fp32 ``fp8 * scale_inv`` of its rows only.

Check it: ``.venv/bin/python -m pytest tests/test_conversion_mapping.py -q``.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_rl.spec.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_SUFFIX = "_scale_inv"
# Files copied next to the weights when present (tokenizer, chat template, generation defaults).
WRITE_CHUNK = 64 * 2**20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def parse_size(text: str | int) -> int:
    """'2GB' (10^9), '512MiB' (2^20), '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ConfigError(f"--shard-size {text!r}: use a size such as 2GB, 500MB or 4GiB")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
    power = "KMGT".index(unit) + 1 if unit else 0
    size = int(number * (1024 if binary else 1000) ** power)
    if size < 1:
        raise ConfigError(f"--shard-size {text!r} must be positive")
    return size


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in a safetensors file."""

    file: str
    """File name inside the folder."""
    dtype: str
    """safetensors dtype (F32, BF16...)."""
    shape: tuple[int, ...]
    """Tensor shape."""
    offset: int
    """Byte offset of the tensor's first element in the file."""


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, after checking the file holds every byte the header promises."""
    return _header_and_data_start(path)[0]


def _header_and_data_start(path: Path) -> tuple[dict[str, Any], int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ConfigError(f"{path}: truncated safetensors file (no header)")
            (length,) = struct.unpack("<Q", raw)
            if length > size - 8:
                raise ConfigError(f"{path}: truncated safetensors file (header runs past the end)")
            header = json.loads(f.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{path}: not a readable safetensors file ({exc})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise ConfigError(f"{path}: truncated safetensors file ({size} bytes, header needs {8 + length + end})")
    return header, 8 + length


@dataclass
class HFCheckpoint:
    """A Hugging Face model folder: config.json plus safetensors weights (single file or sharded with an index)."""

    folder: Path
    """The folder."""
    config: dict[str, Any]
    """config.json as written."""
    tensors: dict[str, TensorEntry]
    """Every weight tensor by name."""
    _handles: dict[str, int] = field(default_factory=dict, repr=False)
    """Open file descriptors by file name."""

    @classmethod
    def open(cls, folder: str | Path) -> "HFCheckpoint":
        folder = Path(folder)
        if not folder.is_dir():
            raise ConfigError(f"--hf {folder}: not a folder; give a Hugging Face model folder (config.json + "
                              "*.safetensors)")
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"--hf {folder}: no config.json; this is not a Hugging Face model folder")
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg_path}: not valid JSON ({exc})") from None
        files = _weight_files(folder)
        tensors: dict[str, TensorEntry] = {}
        for name in files:
            header, start = _header_and_data_start(folder / name)
            for key, info in header.items():
                if key != "__metadata__":
                    tensors[key] = TensorEntry(name, info["dtype"], tuple(info["shape"]),
                                               start + info["data_offsets"][0])
        index = folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            lost = sorted(k for k, f in weight_map.items() if tensors.get(k) is None or tensors[k].file != f)
            if lost:
                raise ConfigError(f"{index}: {len(lost)} tensor(s) listed in the index are not in their shard "
                                  f"(first: {lost[0]} in {weight_map[lost[0]]})")
        return cls(folder=folder, config=config, tensors=tensors)

    def read_rows(self, name: str, first: int, last: int, cols: tuple[slice, ...] = ()):
        """Rows [first, last) (and column slices) of one tensor, reading only those bytes (an FP8 weight with a
        block scale comes back dequantized, in fp32)."""
        if self.tensors[name].dtype in FP8_DTYPES and name + SCALE_SUFFIX in self.tensors:
            return self._dequantized_rows(name, first, last, cols)
        return self._raw_rows(name, first, last, cols)

    def _raw_rows(self, name: str, first: int, last: int, cols: tuple[slice, ...] = ()):
        """Rows [first, last) read with pread, not mmap: a mapped file's pages would count in this process's
        resident memory for as long as the file stays open, and an import reads a whole model."""
        import torch

        entry = self.tensors[name]
        path = self.folder / entry.file
        dtype, row_shape = torch_dtype(entry.dtype), entry.shape[1:]
        row_bytes = math.prod(row_shape) * DTYPE_BYTES[entry.dtype]
        fd = self._handles.get(entry.file)
        if fd is None:
            fd = self._handles[entry.file] = os.open(path, os.O_RDONLY)

        def rows(start: int, stop: int):
            return _pread_into(fd, path, entry.offset + start * row_bytes,
                               torch.empty((stop - start, *row_shape), dtype=dtype))

        if not entry.shape:
            return _pread_into(fd, path, entry.offset, torch.empty((), dtype=dtype))
        if not cols:
            return rows(first, last)
        kept = tuple(len(range(*c.indices(n))) for c, n in zip(cols, row_shape))
        out = torch.empty((last - first, *kept, *row_shape[len(cols):]), dtype=dtype)
        block = max(1, WRITE_CHUNK // max(row_bytes, 1))  # whole rows, a bounded block at a time
        for start in range(first, last, block):
            stop = min(last, start + block)
            out[start - first:stop - first] = rows(start, stop)[(slice(None), *cols)]
        return out

    @property
    def fp8_block(self) -> tuple[int, int]:
        """(rows, columns) of one quantization block (config.json quantization_config.weight_block_size)."""
        block = (self.config.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
        return int(block[0]), int(block[1])

    def fp8_weights(self) -> list[str]:
        """Names of the FP8 tensors (each must have a ``_scale_inv``)."""
        return sorted(n for n, e in self.tensors.items() if e.dtype in FP8_DTYPES)

    def _dequantized_rows(self, name: str, first: int, last: int, cols: tuple[slice, ...]):
        import torch

        rows_total, cols_total = self.tensors[name].shape
        col = cols[0] if cols else slice(0, cols_total)
        c0, c1 = col.start or 0, cols_total if col.stop is None else col.stop
        weight = self._raw_rows(name, first, last, (slice(c0, c1),)).to(torch.float32)
        if last <= first or c1 <= c0:
            return weight
        br, bc = self.fp8_block
        r_lo, c_lo = first // br, c0 // bc
        scale = self._raw_rows(name + SCALE_SUFFIX, r_lo, (last - 1) // br + 1, (slice(c_lo, (c1 - 1) // bc + 1),))
        scale = scale.to(torch.float32).repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
        scale = scale[first - r_lo * br:last - r_lo * br, c0 - c_lo * bc:c1 - c_lo * bc]
        return weight * scale

    def read(self, name: str):
        return self.read_rows(name, 0, self.tensors[name].shape[0] if self.tensors[name].shape else 1)

    def dtype(self) -> str:
        """The (most common) safetensors dtype of the weights; BF16 for FP8 block-quantized weights (what they
        dequantize to, as DeepSeek's own conversion does)."""
        if self.fp8_weights():
            return "BF16"
        counts: dict[str, int] = {}
        for entry in self.tensors.values():
            counts[entry.dtype] = counts.get(entry.dtype, 0) + 1
        return max(counts, key=counts.get) if counts else "F32"

    def close(self) -> None:
        for fd in self._handles.values():
            os.close(fd)
        self._handles.clear()


def _pread_into(fd: int, path: Path, offset: int, out):
    """Fill the contiguous tensor ``out`` with the bytes at ``offset`` of the open file ``fd`` (``path``). The
    buffer is taken with ctypes, not ``.numpy()``, which would make the tensor's storage unresizable (the
    streamed save frees written tensors by resizing their storage to 0)."""
    import ctypes

    if out.nbytes == 0:
        return out
    view = memoryview((ctypes.c_char * out.nbytes).from_address(out.data_ptr())).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:done + WRITE_CHUNK]], offset + done)
        if n == 0:
            raise ConfigError(f"{path}: file ended at byte {offset + done} while reading a tensor (changed since "
                              "it was checked?)")
        done += n
    return out


def _weight_files(folder: Path) -> list[str]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ConfigError(f"{index}: not a valid safetensors index ({exc})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ConfigError(f"{folder}: shard {missing[0]} listed in {INDEX_FILE} is missing "
                              f"({len(missing)} of {len(files)} missing)")
        return files
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
            raise ConfigError(f"--hf {folder}: only safetensors weights are read; convert the .bin files first "
                              "(transformers: model.save_pretrained(dir, safe_serialization=True))")
        raise ConfigError(f"--hf {folder}: no *.safetensors weights found")
    return files


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer and generation files from ``src`` to ``dst``; returns the names copied."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


# ----- writer -----
@dataclass(frozen=True)
class PlannedTensor:
    name: str
    """HF tensor name."""
    dtype: str
    """safetensors dtype."""
    shape: tuple[int, ...]
    """Shape."""

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n


def plan_shards(groups: list[list[PlannedTensor]], max_bytes: int) -> list[list[PlannedTensor]]:
    """Pack tensor groups (kept together) into shards of at most ``max_bytes`` (a bigger group gets its own)."""
    shards: list[list[PlannedTensor]] = []
    current: list[PlannedTensor] = []
    size = 0
    for group in groups:
        group_bytes = sum(t.nbytes for t in group)
        if current and size + group_bytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.extend(group)
        size += group_bytes
    if current:
        shards.append(current)
    return shards


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


class ShardedSafetensorsWriter:
    """Writes planned shards; tensors must arrive in plan order. ``close()`` writes the index. Nothing is fsynced
    here: the caller puts the finished folder on disk, one fsync per file at the end (an fsync at each shard's end
    would stall the stream while the kernel flushes it)."""

    def __init__(self, folder: Path, shards: list[list[PlannedTensor]], metadata: Optional[dict] = None):
        self.folder = folder
        self.shards = shards
        self.metadata = {"format": "pt", **(metadata or {})}
        self._order = [(i, t) for i, shard in enumerate(shards) for t in shard]
        self._next = 0
        self._file = None
        self._file_index = -1
        self._sources: dict[Path, int] = {}
        self.bytes_written = 0

    def _open(self, index: int) -> None:
        self._finish_file()
        header: dict[str, Any] = {"__metadata__": self.metadata}
        offset = 0
        for t in self.shards[index]:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(self.folder / shard_file_name(index, len(self.shards)), "wb", buffering=0)
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._file_index = index

    def _next_planned(self, name: str) -> PlannedTensor:
        if self._next >= len(self._order):
            raise RuntimeError(f"unplanned tensor {name}")
        index, planned = self._order[self._next]
        if planned.name != name:
            raise RuntimeError(f"tensor {name} arrived out of plan order (expected {planned.name})")
        if index != self._file_index:
            self._open(index)
        return planned

    def write(self, name: str, tensor) -> None:
        """Append ``tensor``'s bytes (it must match the planned shape and dtype)."""
        import torch

        planned = self._next_planned(name)
        if (planned.shape, planned.dtype) != (tuple(tensor.shape), torch_dtype_name(tensor.dtype)):
            raise RuntimeError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match the plan "
                               f"({planned.shape} {planned.dtype})")
        self._append(planned, memoryview(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()))

    def write_bytes(self, name: str, data) -> None:
        """Append the planned tensor ``name`` from a buffer of exactly its bytes (C order, little-endian)."""
        planned = self._next_planned(name)
        data = memoryview(data).cast("B")
        if len(data) != planned.nbytes:
            raise RuntimeError(f"tensor {name}: {len(data)} bytes given, the plan holds {planned.nbytes}")
        self._append(planned, data)

    def _append(self, planned: PlannedTensor, data: memoryview) -> None:
        for start in range(0, len(data), WRITE_CHUNK):  # one huge write() is several times slower on Linux
            self._file.write(data[start:start + WRITE_CHUNK])
        self.bytes_written += planned.nbytes
        self._next += 1

    def copy_ranges(self, name: str, segments: list[tuple[Path, int, int]]) -> None:
        """Append the planned tensor ``name`` by copying byte ranges (file, offset, length) of other files, in the
        kernel (copy_file_range) where the filesystem allows it: no trip through this process's memory."""
        planned = self._next_planned(name)
        if sum(n for _, _, n in segments) != planned.nbytes:
            raise RuntimeError(f"tensor {name}: copied ranges hold {sum(n for _, _, n in segments)} bytes, "
                               f"the plan {planned.nbytes}")
        dst = self._file.fileno()
        for path, offset, nbytes in segments:
            src = self._sources.get(path)
            if src is None:
                src = self._sources[path] = os.open(path, os.O_RDONLY)
            _copy_range(src, dst, offset, nbytes)
        self.bytes_written += planned.nbytes
        self._next += 1

    def _finish_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(f"only {self._next} of {len(self._order)} planned tensors were written")
        self._finish_file()
        self._close_sources()
        weight_map = {t.name: shard_file_name(i, len(self.shards)) for i, shard in enumerate(self.shards)
                      for t in shard}
        total = sum(t.nbytes for shard in self.shards for t in shard)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._close_sources()

    def _close_sources(self) -> None:
        for fd in self._sources.values():
            os.close(fd)
        self._sources.clear()


_KERNEL_COPY = [hasattr(os, "copy_file_range")]


def _copy_range(src: int, dst: int, offset: int, nbytes: int) -> None:
    """Copy ``nbytes`` at ``offset`` of ``src`` to the current position of ``dst`` (kernel copy, else pread)."""
    position = os.lseek(dst, 0, os.SEEK_CUR)
    done = 0
    while done < nbytes and _KERNEL_COPY[0]:
        try:
            n = os.copy_file_range(src, dst, min(nbytes - done, WRITE_CHUNK), offset + done, position + done)
        except OSError:  # other filesystem, old kernel: fall back to reading through memory
            _KERNEL_COPY[0] = False
            break
        if n == 0:
            raise RuntimeError("source file ended early during copy")
        done += n
    while done < nbytes:
        data = os.pread(src, min(nbytes - done, WRITE_CHUNK), offset + done)
        if not data:
            raise RuntimeError("source file ended early during copy")
        done += os.pwrite(dst, data, position + done)
    os.lseek(dst, position + nbytes, os.SEEK_SET)


_TORCH_TO_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def torch_dtype_name(dtype) -> str:
    """safetensors dtype string of a torch dtype."""
    return _TORCH_TO_ST[str(dtype).replace("torch.", "")]


def torch_dtype(st_name: str):
    import torch

    inverse = {v: k for k, v in _TORCH_TO_ST.items()}
    return getattr(torch, inverse[st_name])
