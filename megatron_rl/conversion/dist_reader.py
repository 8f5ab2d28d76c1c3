"""Read our ``torch_dist`` checkpoints tensor by tensor, without building the model, starting processes or
importing torch.

    reader = CheckpointReader("runs/x/checkpoints")        # a checkpoint root or a step folder
    reader.index[ref].shape, reader.chunks(ref), reader.read_bytes(ref), reader.read([ref])[ref]

The checkpoint's ``.metadata`` (read by a restricted unpickler, ``dcp_files``) lists every model tensor by its
global (layout-free) key and global shape, with the chunks each rank saved. ``chunks(ref)`` gives each saved chunk
of a tensor with its place in the tensor, so TP shards, PP stages and EP expert groups are reassembled by their
recorded offsets, whatever layout saved them; ``read_bytes(ref)`` does that, in memory.

Each chunk is a torch.save record (an uncompressed zip whose ``data/<key>`` entry holds the elements). When the
record's own pickle shows the chunk stored whole, contiguous and with the expected shape and dtype, the chunk's
``data_offset`` locates its raw bytes in the file: they are read with pread, or copied file to file by the
exporter, and torch is never imported. Any other record (``data_offset`` None) is read with
torch.load(weights_only=True) of its byte range, as torch.distributed.checkpoint itself reads it.

Before anything is read, every storage file named in the metadata is checked to exist and to be long enough,
so a missing or truncated shard is a one-line error instead of a failure halfway through an export.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from megatron_rl.conversion.dcp_files import (
    DTYPE_ITEMSIZE,
    MetadataIndex,
    StorageInfo,
    load_metadata,
    load_plain_state,
    load_tensor_record,
)
from megatron_rl.conversion.names import MegatronRef, is_model_key, refs_in_stored_tensor
from megatron_rl.spec.errors import ConfigError

READ_BLOCK = 64 * 2**20

COMMON_STATE_KEY = "common_state/shard_0_1"
"""The common state's key in the shards from megatron-core 0.19 (``ShardedObject("common_state", ...).unique_key``)."""


@dataclass(frozen=True)
class StoredTensor:
    """Where one Megatron ref lives in the checkpoint."""

    key: str
    """Stored key (fqn) in the checkpoint."""
    prepend: tuple[int, ...]
    """Indices along the stored tensor's leading layer/expert axes."""
    shape: tuple[int, ...]
    """Shape of the ref's tensor (the stored shape without the leading axes)."""
    dtype: str
    """Stored dtype, by name (float32, bfloat16...)."""

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Chunk:
    """One saved chunk of a ref's tensor."""

    offsets: tuple[int, ...]
    """Offsets of the chunk in the ref's tensor."""
    sizes: tuple[int, ...]
    """Shape of the chunk."""
    path: Path
    """Storage file."""
    record: StorageInfo
    """Where the chunk's torch.save record is in that file."""
    lead: tuple[int, ...]
    """The ref's indices along the leading layer/expert axes of the saved chunk."""
    data_offset: Optional[int]
    """Byte offset of the chunk's first element in ``path`` when stored raw; None: read with torch.load."""


class _FileView(io.RawIOBase):
    """A read-only window [start, start + length) of an open file (one torch.save record)."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step *= s
    return tuple(reversed(strides))


def checkpoint_step_folder(path: str | Path) -> Path:
    """The step folder of ``path`` (a step folder, or a checkpoint root with ``latest``), or a ConfigError."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--ckpt {path}: no such folder")
    folder = path if (path / ".metadata").is_file() else None
    if folder is None:
        from megatron_rl.runtime.checkpoint import resolve_checkpoint

        try:
            folder = resolve_checkpoint(path)
        except FileNotFoundError:
            raise ConfigError(f"--ckpt {path}: not a checkpoint (no step_* folder, no latest, no .metadata)") from None
    if not (folder / ".metadata").is_file():
        raise ConfigError(f"--ckpt {folder}: not a torch_dist checkpoint (no .metadata); only checkpoints saved by "
                          "megatron_rl (dist_checkpointing, torch_dist backend) are read")
    meta = folder / "metadata.json"
    if meta.is_file():
        backend = json.loads(meta.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise ConfigError(f"--ckpt {folder}: sharded backend {backend!r} is not supported (use torch_dist)")
    return folder


class CheckpointReader:
    """Index and reads of one step folder of our checkpoints."""

    def __init__(self, path: str | Path):
        self.folder = checkpoint_step_folder(path)
        try:
            self.metadata = load_metadata(self.folder / ".metadata")
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError, TypeError, IndexError,
                KeyError) as exc:
            raise ConfigError(f"--ckpt {self.folder}: unreadable .metadata ({type(exc).__name__}: {exc})") from None
        self._check_storage_files()
        self.index: dict[MegatronRef, StoredTensor] = {}
        for key, md in self.metadata.state_dict_metadata.items():
            if getattr(md, "chunks", None) is None or not is_model_key(key):
                continue
            if md.properties.dtype not in DTYPE_ITEMSIZE:
                raise ConfigError(f"--ckpt {self.folder}: tensor {key} has dtype {md.properties.dtype}, which the "
                                  "converter does not read")
            size = tuple(md.size)
            for ref, prepend in refs_in_stored_tensor(key, size):
                if ref in self.index:
                    raise ConfigError(f"--ckpt {self.folder}: tensor {ref} is stored twice "
                                      f"({self.index[ref].key} and {key})")
                self.index[ref] = StoredTensor(key, prepend, size[len(prepend):], md.properties.dtype)

    def _check_storage_files(self) -> None:
        needed: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(needed.items()):
            path = self.folder / name
            if not path.is_file():
                raise ConfigError(f"--ckpt {self.folder}: shard file {name} is missing ({len(needed)} files expected)")
            if path.stat().st_size < end:
                raise ConfigError(f"--ckpt {self.folder}: shard file {name} is truncated "
                                  f"({path.stat().st_size} bytes, needs {end})")

    def chunks(self, ref: MegatronRef) -> list[Chunk]:
        """Every saved chunk of ``ref``'s tensor; a ConfigError if they do not cover it."""
        stored = self.index[ref]
        n = len(stored.prepend)
        md = self.metadata.state_dict_metadata[stored.key]
        chunks = []
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if not all(o <= p < o + s for p, o, s in zip(stored.prepend, offsets, sizes)):
                continue
            info = self.metadata.storage_data.get(MetadataIndex(stored.key, offsets))
            if info is None:
                continue
            lead = tuple(p - o for p, o in zip(stored.prepend, offsets))
            data_offset = self._raw_offset(info, sizes, stored.dtype)
            if data_offset is not None and n:  # the ref's block in a chunk that may span several layers/experts
                data_offset += int(np.ravel_multi_index(lead, sizes[:n])) * math.prod(sizes[n:]) * stored.itemsize
            chunks.append(Chunk(offsets[n:], sizes[n:], self.folder / info.relative_path, info, lead, data_offset))
        covered = sum(math.prod(c.sizes) for c in chunks)
        if covered != math.prod(stored.shape):
            raise ConfigError(f"--ckpt {self.folder}: tensor {ref} is incomplete ({covered} of "
                              f"{math.prod(stored.shape)} elements saved); the checkpoint is damaged")
        return chunks

    def _raw_offset(self, info: StorageInfo, sizes: tuple[int, ...], dtype: str) -> Optional[int]:
        if info.transform_descriptors:
            return None
        try:
            with open(self.folder / info.relative_path, "rb") as f:
                archive = zipfile.ZipFile(_FileView(f, info.offset, info.length))
                prefix = archive.namelist()[0].split("/", 1)[0]
                if archive.read(f"{prefix}/byteorder").strip() not in (b"little",):
                    return None
                record = load_tensor_record(archive.read(f"{prefix}/data.pkl"))
                entry = archive.getinfo(f"{prefix}/data/{record.storage_key}")
                f.seek(info.offset + entry.header_offset)
                header = f.read(30)
        except (OSError, KeyError, ValueError, TypeError, IndexError, pickle.UnpicklingError, zipfile.BadZipFile):
            return None
        if (record.dtype, record.offset, record.size, record.stride) != (dtype, 0, sizes, _contiguous_strides(sizes)) \
                or header[:4] != b"PK\x03\x04":
            return None
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != math.prod(sizes) * DTYPE_ITEMSIZE[dtype]:
            return None
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.offset + entry.header_offset + 30 + name_len + extra_len

    def read_chunk(self, chunk: Chunk, itemsize: int) -> np.ndarray:
        """The chunk's bytes, as uint8 of shape (*chunk.sizes, itemsize)."""
        if chunk.data_offset is None:
            return self._torch_load_chunk(chunk).reshape(*chunk.sizes, itemsize)
        out = np.empty((*chunk.sizes, itemsize), dtype=np.uint8)
        view = memoryview(out.reshape(-1))
        fd = os.open(chunk.path, os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:done + READ_BLOCK]], chunk.data_offset + done)
                if n == 0:
                    raise ConfigError(f"--ckpt {self.folder}: shard file {chunk.path.name} ended early")
                done += n
        finally:
            os.close(fd)
        return out

    def _torch_load_chunk(self, chunk: Chunk) -> np.ndarray:
        import torch

        with open(chunk.path, "rb") as f:
            f.seek(chunk.record.offset)
            data = f.read(chunk.record.length)
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)[chunk.lead]
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, TypeError, IndexError) as exc:
            raise ConfigError(f"--ckpt {self.folder}: reading tensors failed, shard file {chunk.path.name} is "
                              f"damaged ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") \
                from None
        if tuple(tensor.shape) != chunk.sizes:
            raise ConfigError(f"--ckpt {self.folder}: shard file {chunk.path.name} holds a {list(tensor.shape)} "
                              f"chunk where the metadata records {list(chunk.sizes)}")
        return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()

    def read_bytes(self, ref: MegatronRef) -> np.ndarray:
        """The whole tensor of ``ref``, reassembled from every rank's chunks: uint8 of shape (*shape, itemsize)."""
        stored = self.index[ref]
        out = np.empty((*stored.shape, stored.itemsize), dtype=np.uint8)
        for chunk in self.chunks(ref):
            region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            out[region] = self.read_chunk(chunk, stored.itemsize)
        return out

    def read(self, refs: Iterable[MegatronRef], dtype=None) -> dict:
        """Whole tensors of ``refs`` as torch tensors (cast to the torch ``dtype`` if given): ``read_bytes``, typed."""
        import torch

        out = {}
        for ref in refs:
            stored = self.index[ref]
            tensor = torch.from_numpy(self.read_bytes(ref).reshape(-1)).view(getattr(torch, stored.dtype))
            out[ref] = tensor.reshape(stored.shape) if dtype is None else tensor.reshape(stored.shape).to(dtype)
        return out

    def common_state(self) -> dict[str, Any]:
        """The checkpoint's common state (step, layout, extra): ``common.pt`` as megatron-core 0.16 writes it, or
        the ``common_state`` object 0.19 writes into the shards (a torch.save of ``[state]``)."""
        path = self.folder / "common.pt"
        if path.is_file():
            source, name, unwrap = path, "common.pt", False
        else:
            info = self.metadata.storage_data.get(MetadataIndex(COMMON_STATE_KEY))
            if info is None:
                return {}
            with open(self.folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                source, name, unwrap = f.read(info.length), f"{COMMON_STATE_KEY} in {info.relative_path}", True
        try:
            state = load_plain_state(source)
        except (OSError, EOFError, ValueError, TypeError, pickle.UnpicklingError, zipfile.BadZipFile):
            import torch  # tensors or an older format in it: torch reads it, still without running pickled code

            try:  # a user's file: no pickled code
                state = torch.load(io.BytesIO(source) if unwrap else source, map_location="cpu", weights_only=True)
            except Exception as exc:  # a damaged common state only loses metadata, not weights
                raise ConfigError(f"--ckpt {self.folder}: unreadable {name} ({type(exc).__name__}: {exc})") from None
        if unwrap:
            state = state[0] if isinstance(state, list) and state else None
        if not isinstance(state, dict):
            raise ConfigError(f"--ckpt {self.folder}: {name} does not hold a dict")
        return state
