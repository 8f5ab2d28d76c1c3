"""The pickles of a ``torch_dist`` checkpoint folder, read without importing torch and without running code.

    from megatron_rl.conversion.dcp_files import load_metadata
    metadata = load_metadata(Path("runs/x/checkpoints/step_00000100/.metadata"))
    metadata.state_dict_metadata[key].chunks, metadata.storage_data[MetadataIndex(key, offsets)].relative_path

Every file read here is a pickle, and a pickle may name any Python callable. Each reader is a restricted
unpickler: ``find_class`` resolves only the names of its allowlist, each to a small local stand-in (a dataclass
with the attributes of torch's class, a tuple for ``torch.Size``, the dtype's name for a ``torch.dtype``), and
refuses every other name with ``pickle.UnpicklingError``, so a crafted checkpoint cannot run code. (torch's own
``FileSystemReader.read_metadata`` is a plain ``pickle.load``.) Nor is torch imported, which is most of an
export's start-up.

- ``load_metadata``: ``.metadata``, torch.distributed.checkpoint's ``Metadata``;
- ``load_tensor_record``: the pickle of a torch.save record of one plain tensor (a chunk in a ``.distcp``);
- ``load_plain_state``: a torch.save file (or its bytes) holding only Python containers and scalars: the common
  state, ``common.pt`` up to megatron-core 0.16, a ``common_state`` object in the shards from 0.19.

Check it: ``.venv/bin/python -m pytest tests/test_dcp_files.py -q``.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

DTYPE_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                  "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
"""Bytes per element of the torch dtypes a checkpoint may hold, by name (``str(torch.float32)[6:]``)."""


@dataclass
class ChunkStorageMetadata:
    """One saved block of a tensor."""

    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()


@dataclass
class TensorProperties:
    dtype: str = "float32"
    """The dtype's name."""

    def __setstate__(self, state: tuple) -> None:  # torch pickles (dtype, layout, requires_grad, format, pinned)
        self.dtype = state[0]


@dataclass
class TensorStorageMetadata:
    properties: Optional[TensorProperties] = None
    size: tuple[int, ...] = ()
    chunks: Optional[list[ChunkStorageMetadata]] = None


@dataclass
class BytesStorageMetadata:
    pass


@dataclass(frozen=True)
class MetadataIndex:
    """Key of ``Metadata.storage_data``: the tensor's key and the chunk's offsets."""

    fqn: str
    offset: Optional[tuple[int, ...]] = None
    index: Optional[int] = field(default=None, hash=False, compare=False)


@dataclass
class StorageInfo:
    """Where one chunk's torch.save record is: [offset, offset + length) of ``relative_path``."""

    relative_path: str = ""
    offset: int = 0
    length: int = 0
    transform_descriptors: Optional[list[str]] = None


@dataclass
class Metadata:
    state_dict_metadata: Optional[dict[str, Any]] = None
    planner_data: Any = None
    storage_data: Optional[dict[MetadataIndex, StorageInfo]] = None
    storage_meta: Any = None
    version: Optional[str] = None


class _Unread:
    """Stand-in for the parts of a Metadata the converter does not read (save plans, storage meta)."""

    def __setstate__(self, state: Any) -> None:
        pass


def _name(value: Any) -> Any:
    """torch.serialization._get_layout(name), an Enum(value): keep the argument."""
    return value


def _unread_call(*args: Any) -> None:
    """A value of the unread parts, built by a call (StorageMeta.checkpoint_id may be a PosixPath)."""
    return None


_DCP = "torch.distributed.checkpoint"
_METADATA_NAMES: dict[tuple[str, str], Any] = {
    ("torch", "Size"): tuple,
    **{("torch", dtype): dtype for dtype in DTYPE_ITEMSIZE},
    ("torch.serialization", "_get_layout"): _name,
    (f"{_DCP}.metadata", "Metadata"): Metadata,
    (f"{_DCP}.metadata", "TensorStorageMetadata"): TensorStorageMetadata,
    (f"{_DCP}.metadata", "BytesStorageMetadata"): BytesStorageMetadata,
    (f"{_DCP}.metadata", "ChunkStorageMetadata"): ChunkStorageMetadata,
    (f"{_DCP}.metadata", "TensorProperties"): TensorProperties,
    (f"{_DCP}.metadata", "MetadataIndex"): MetadataIndex,
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): _name,
    (f"{_DCP}.metadata", "StorageMeta"): _Unread,
    (f"{_DCP}.filesystem", "_StorageInfo"): StorageInfo,
    (f"{_DCP}.planner", "SavePlan"): _Unread,
    (f"{_DCP}.planner", "WriteItem"): _Unread,
    (f"{_DCP}.planner", "TensorWriteData"): _Unread,
    (f"{_DCP}.planner", "WriteItemType"): _name,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): _unread_call,
    ("pathlib._local", "PosixPath"): _unread_call,  # where Python 3.13 pickles it
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in ``allowed`` (name -> stand-in) and refuses any other one,
    and every persistent id unless ``persistent`` is given."""

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], persistent=None):
        super().__init__(io.BytesIO(data))
        self.allowed = allowed
        self.persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}: not a name this file may hold") from None

    def persistent_load(self, pid: Any) -> Any:
        if self.persistent is None:
            raise pickle.UnpicklingError("refused a persistent id (a tensor storage) in a file that holds none")
        return self.persistent(pid)


def load_metadata(path: Path) -> Metadata:
    """The checkpoint's ``.metadata``; UnpicklingError if it names anything but torch DCP's metadata classes."""
    metadata = RestrictedUnpickler(Path(path).read_bytes(), _METADATA_NAMES).load()
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise pickle.UnpicklingError("not a torch.distributed.checkpoint Metadata")
    return metadata


STORAGE_TYPES = {"float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
                 "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
                 "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage"}
"""The storage class torch.save names for a tensor of each dtype (by the dtype's name)."""


def _rebuild_tensor(storage, offset, size, stride, *rest, **kwargs) -> tuple:
    return storage, offset, tuple(size), tuple(stride)


_TENSOR_RECORD_NAMES: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    **{("torch", storage): dtype for dtype, storage in STORAGE_TYPES.items()},
    ("collections", "OrderedDict"): collections.OrderedDict,
}


@dataclass(frozen=True)
class TensorRecord:
    """The one plain tensor a torch.save record holds, as its pickle describes it."""

    dtype: str
    """The dtype's name."""
    storage_key: str
    """Name of the storage's entry under ``data/`` in the record's zip."""
    offset: int
    """First element, in the storage."""
    size: tuple[int, ...]
    stride: tuple[int, ...]


def load_tensor_record(data: bytes) -> TensorRecord:
    """What the torch.save pickle ``data`` of ONE plain tensor describes, without building it; UnpicklingError
    if the pickle holds anything else."""
    loaded = RestrictedUnpickler(data, _TENSOR_RECORD_NAMES, persistent=lambda pid: pid).load()
    try:
        (kind, dtype, key, *_), offset, size, stride = loaded
    except (TypeError, ValueError):
        raise pickle.UnpicklingError("not a single plain tensor") from None
    if kind != "storage" or dtype not in STORAGE_TYPES:
        raise pickle.UnpicklingError("not a single plain tensor")
    return TensorRecord(dtype, str(key), int(offset), size, stride)


def load_plain_state(source: Path | bytes) -> Any:
    """The object a torch.save file (or its bytes) holds, when it holds only Python containers and scalars (no
    tensor, no class); UnpicklingError or zipfile.BadZipFile otherwise (the caller then uses
    torch.load(weights_only=True))."""
    with zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise zipfile.BadZipFile("not a torch.save archive")
        return RestrictedUnpickler(archive.read(pickles[0]), {("collections", "OrderedDict"): dict}).load()
