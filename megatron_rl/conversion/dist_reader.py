"""Read our ``torch_dist`` checkpoints tensor by tensor, without building the model or starting processes.

The checkpoint's ``.metadata`` lists every model tensor by its global (layout-free) key and global shape, with
the chunks each rank saved. ``CheckpointReader.read(refs)`` asks torch.distributed.checkpoint's FileSystemReader
for exactly the blocks that make up the requested layers/experts, so only those bytes are loaded: TP shards,
PP stages and EP expert groups are reassembled by their recorded offsets, whatever layout saved them.

Before anything is read, every storage file named in the metadata is checked to exist and to be long enough,
so a missing or truncated shard is a one-line error instead of a failure halfway through an export.

``raw_chunks(ref)`` locates the raw bytes of each saved chunk of a tensor inside its storage file (each chunk is
a torch.save record: an uncompressed zip whose ``data/0`` entry holds the elements), after checking from the
record's own pickle that the chunk is stored whole, contiguous and with the expected shape. The exporter then
copies those byte ranges file to file in the kernel; anything unusual returns None and goes through ``read``.
"""

from __future__ import annotations

import collections
import io
import json
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from launcher.errors import ConfigError
from megatron_rl.conversion.names import MegatronRef, is_model_key, refs_in_stored_tensor


@dataclass(frozen=True)
class StoredTensor:
    """Where one Megatron ref lives in the checkpoint."""

    key: str
    """Stored key (fqn) in the checkpoint."""
    prepend: tuple[int, ...]
    """Indices along the stored tensor's leading layer/expert axes."""
    shape: tuple[int, ...]
    """Shape of the ref's tensor (the stored shape without the leading axes)."""
    dtype: torch.dtype
    """Stored dtype."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class RawChunk:
    """The raw, contiguous bytes of one saved chunk of a tensor."""

    path: Path
    """Storage file."""
    data_offset: int
    """Byte offset of the chunk's first element in that file."""
    offsets: tuple[int, ...]
    """Offsets of the chunk in the ref's tensor."""
    sizes: tuple[int, ...]
    """Shape of the chunk."""


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


class _TensorRecordUnpickler(pickle.Unpickler):
    """Reads a torch.save pickle of ONE plain tensor without building it: returns (storage id, offset, size,
    stride); anything else in the pickle raises."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest, **kw: (storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name.endswith("Storage"):
            return name
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step *= s
    return tuple(reversed(strides))


def checkpoint_step_folder(path: str | Path) -> Path:
    """The step folder of ``path`` (a step folder, or a checkpoint root with ``latest``), or a ConfigError."""
    from megatron_rl.runtime.checkpoint import resolve_checkpoint

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--ckpt {path}: no such folder")
    folder = path if (path / ".metadata").is_file() else None
    if folder is None:
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


class _BlockPlanner:
    """The part of torch DCP's LoadPlanner that FileSystemReader.read_data calls: where each read block goes."""

    def __init__(self, destinations: dict[tuple[str, tuple[int, ...]], torch.Tensor]):
        self.destinations = destinations

    def resolve_tensor(self, read_item) -> torch.Tensor:
        dest = self.destinations[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            dest = dest.narrow(dim, offset, length)
        return dest

    def commit_tensor(self, read_item, tensor) -> None:
        return None

    def load_bytes(self, read_item, value) -> None:
        raise RuntimeError("byte objects are not read by the converter")


class CheckpointReader:
    """Index and block reads of one step folder of our checkpoints."""

    def __init__(self, path: str | Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.folder = checkpoint_step_folder(path)
        self._reader = FileSystemReader(str(self.folder))
        try:
            self.metadata = self._reader.read_metadata()
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as exc:
            raise ConfigError(f"--ckpt {self.folder}: unreadable .metadata ({type(exc).__name__}: {exc})") from None
        self._reader.set_up_storage_reader(self.metadata, True)
        self._check_storage_files()
        self.index: dict[MegatronRef, StoredTensor] = {}
        for key, md in self.metadata.state_dict_metadata.items():
            if not hasattr(md, "chunks") or not is_model_key(key):
                continue
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

    def raw_chunks(self, ref: MegatronRef) -> Optional[list[RawChunk]]:
        """Where the raw bytes of every saved chunk of ``ref`` are, or None if any chunk is not plainly stored."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        stored = self.index[ref]
        n = len(stored.prepend)
        md = self.metadata.state_dict_metadata[stored.key]
        itemsize = torch.empty((), dtype=stored.dtype).element_size()
        chunks = []
        for chunk in md.chunks:
            if tuple(chunk.offsets[:n]) != stored.prepend:
                continue
            if any(s != 1 for s in chunk.sizes[:n]):
                return None
            info = self.metadata.storage_data.get(MetadataIndex(stored.key, chunk.offsets))
            offset = None if info is None else self._raw_offset(info, tuple(chunk.sizes), itemsize)
            if offset is None:
                return None
            chunks.append(RawChunk(self.folder / info.relative_path, offset, tuple(chunk.offsets[n:]),
                                   tuple(chunk.sizes[n:])))
        if sum(math.prod(c.sizes) for c in chunks) != math.prod(stored.shape):
            return None
        return chunks

    def _raw_offset(self, info, sizes: tuple[int, ...], itemsize: int) -> Optional[int]:
        if getattr(info, "transform_descriptors", None):
            return None
        try:
            with open(self.folder / info.relative_path, "rb") as f:
                archive = zipfile.ZipFile(_FileView(f, info.offset, info.length))
                prefix = archive.namelist()[0].split("/", 1)[0]
                if archive.read(f"{prefix}/byteorder").strip() not in (b"little",):
                    return None
                storage, offset, size, stride = _TensorRecordUnpickler(
                    io.BytesIO(archive.read(f"{prefix}/data.pkl"))).load()
                entry = archive.getinfo(f"{prefix}/data/{storage[2]}")
                f.seek(info.offset + entry.header_offset)
                header = f.read(30)
        except (OSError, KeyError, ValueError, TypeError, IndexError, pickle.UnpicklingError, zipfile.BadZipFile):
            return None
        if (offset, size, stride) != (0, sizes, _contiguous_strides(sizes)) or header[:4] != b"PK\x03\x04":
            return None
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != math.prod(sizes) * itemsize:
            return None
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.offset + entry.header_offset + 30 + name_len + extra_len

    def common_state(self) -> dict[str, Any]:
        """The checkpoint's common state (step, layout, extra) from common.pt."""
        path = self.folder / "common.pt"
        if not path.is_file():
            return {}
        try:
            return torch.load(path, map_location="cpu", weights_only=True)  # a user's file: no pickled code
        except Exception as exc:  # a damaged common.pt only loses metadata, not weights
            raise ConfigError(f"--ckpt {self.folder}: unreadable common.pt ({type(exc).__name__}: {exc})") from None

    def read(self, refs: Iterable[MegatronRef], dtype: Optional[torch.dtype] = None) -> dict[MegatronRef, torch.Tensor]:
        """Whole tensors of ``refs`` (each as saved, reassembled from every rank's chunks), in one pass."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        out: dict[MegatronRef, torch.Tensor] = {}
        destinations: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        items = []
        for ref in refs:
            stored = self.index[ref]
            tensor = torch.empty(stored.shape, dtype=stored.dtype)
            offsets = (*stored.prepend, *([0] * len(stored.shape)))
            sizes = (*([1] * len(stored.prepend)), *stored.shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            md = self.metadata.state_dict_metadata[stored.key]
            new_items = create_read_items_for_chunk_list(stored.key, md, [chunk])
            covered = sum(math.prod(item.lengths) for item in new_items)
            if covered != math.prod(sizes):
                raise ConfigError(f"--ckpt {self.folder}: tensor {ref} is incomplete ({covered} of "
                                  f"{math.prod(sizes)} elements saved); the checkpoint is damaged")
            destinations[(stored.key, tuple(offsets))] = tensor.view(sizes)
            items.extend(new_items)
            out[ref] = tensor
        try:
            self._reader.read_data(LoadPlan(items), _BlockPlanner(destinations)).wait()
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as exc:
            raise ConfigError(f"--ckpt {self.folder}: reading tensors failed, a shard file is damaged "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        if dtype is not None:
            out = {ref: t.to(dtype) for ref, t in out.items()}
        return out
