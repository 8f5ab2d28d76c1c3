"""Save a Megatron checkpoint whose weights never sit in memory together: each shard is read from the Hugging
Face safetensors when torch's checkpoint writer asks for it, written and dropped.

The importer (``worker.run_import``) builds the model on the meta device at the requested layout, so Megatron's
own ``sharded_state_dict()`` gives every key, global shape, offset and replica id it would save, and hands it
to ``megatron.core.dist_checkpointing.save`` with ``StreamedSaveStrategy``. Everything up to the tensor bytes
is Megatron's and torch's own code: Megatron writes the common state and ``metadata.json``, turns the sharded
tensors into torch DCP objects (``mcore_to_pyt_state_dict``) and plans with its ``MCoreSavePlanner``; torch's
``FileSystemWriter`` writes the ``.distcp`` files and the ``.metadata``. The one difference from Megatron's
default strategy is where the bytes come from and when: the planner's ``resolve_data`` reads the shard from
the HF files (``HFShardReader``: QKV interleave, [gate; up], vocab padding, FP8 dequantization, experts), and
the writer is torch's synchronous one, which resolves one item at a time, where Megatron's asynchronous writer
loads every tensor of a rank before writing any. A rank therefore holds one shard (twice, while a fused or
vocab-padded tensor is assembled) at a time, whatever the model size.

Why not write the DCP files by hand: the storage layout (torch.save records, ``_StorageInfo`` offsets), the
``.metadata`` and Megatron's own key/replica handling would then be a second implementation to keep in step
with two libraries; here they are the libraries' code, and only ``resolve_data`` is ours.

Check it: ``.venv/bin/python -m pytest tests/test_streaming_import.py -q``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_rl.conversion.names import TensorMap, megatron_shape, parse_megatron_key, tensor_maps
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape


class HFShardReader:
    """The data of any Megatron ShardedTensor of a model of ``shape``, read from the HF checkpoint ``hf``
    (only the rows of that shard)."""

    def __init__(self, shape: ModelShape, hf):
        self.shape, self.hf = shape, hf
        self.maps = {tm.ref: tm for tm in tensor_maps(shape)}

    def tensor_map(self, sh: ShardedTensor) -> TensorMap:
        """The HF source of ``sh``, after checking Megatron's global shape is the one the HF tensors give."""
        n = sh.prepend_axis_num
        ref = parse_megatron_key(sh.key, tuple(sh.global_offset[:n]))
        tm = self.maps.get(ref)
        if tm is None:
            raise ConfigError(f"model tensor {ref} ({sh.key}) has no Hugging Face source in the name map")
        global_shape = tuple(sh.global_shape[n:])
        expected = megatron_shape(tm, global_shape[0] if tm.kind == "vocab" else None)
        if global_shape != expected:
            raise ConfigError(f"mismatched shapes: Megatron builds {ref} as {list(global_shape)}, the HF "
                              f"tensors give {list(expected)}")
        return tm

    def read(self, sh: ShardedTensor) -> torch.Tensor:
        """``sh``'s block of the global tensor, shaped like ``sh.data`` and of its dtype."""
        from megatron_rl.conversion.mapping import megatron_region_from_hf

        n = sh.prepend_axis_num
        tm = self.tensor_map(sh)
        region = megatron_region_from_hf(tm, self.shape, sh.global_shape[n], tuple(sh.global_offset[n:]),
                                         tuple(sh.local_shape), self.hf.read_rows, sh.data.dtype)
        if region.is_floating_point() and torch.isnan(region).any():
            raise ConfigError(f"{tm.hf[0]}: the Hugging Face checkpoint holds NaN values ({tm.ref})")
        return region.reshape(sh.local_shape)


class _ReadWhenWritten(MCoreSavePlanner):
    """Megatron's save planner, with each tensor's bytes read from the HF files when the writer asks."""

    def __init__(self, reader: HFShardReader, shards: dict[tuple[str, tuple[int, ...]], ShardedTensor]):
        super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
        self.reader, self.shards = reader, shards
        self.written: Optional[torch.Tensor] = None

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        if self.written is not None and self.written.untyped_storage().resizable():
            # torch's serial loader still holds the previous tensor while it asks for the next one, which it
            # has written by then: free its bytes, or two shards (the embedding and the LM head) sit in memory
            self.written.untyped_storage().resize_(0)
        sh = self.shards[(write_item.index.fqn, tuple(write_item.index.offset))]
        self.written = self.reader.read(sh).reshape(write_item.tensor_data.chunk.sizes)
        return self.written


class _Writer(FileSystemWriter):
    """torch's synchronous writer, recording the checkpoint folder as a str like Megatron's writer does (a pickled
    Path in .metadata is refused by readers that unpickle only known names)."""

    def storage_meta(self):
        meta = super().storage_meta()
        meta.checkpoint_id = str(meta.checkpoint_id)
        return meta


class StreamedSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` save strategy (same files, same metadata; megatron-core 0.19 takes no other class)
    that reads every main-replica shard from the HF checkpoint as it is written; the state dict's tensors only
    describe shards (meta tensors)."""

    def __init__(self, reader: HFShardReader):
        super().__init__("torch_dist", 1)
        self.reader = reader

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        from torch.distributed.checkpoint import save
        from torch.distributed.checkpoint.api import CheckpointException

        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        shards = {(sh.key, tuple(sh.global_offset)): sh for group in by_key.values() for sh in group
                  if isinstance(sh, ShardedTensor)}
        for sh in shards.values():  # every name and shape, before the first byte is written
            self.reader.tensor_map(sh)
        planner = _ReadWhenWritten(self.reader, shards)
        # one thread and file per rank, no copy-ahead: torch's writer then resolves (reads) one item at a time,
        # after writing the one before
        writer = _Writer(str(checkpoint_dir), single_file_per_rank=True, sync_files=False, thread_count=1,
                         per_thread_copy_ahead=0)
        try:
            save(mcore_to_pyt_state_dict(by_key, is_loading=False), storage_writer=writer, planner=planner)
        except CheckpointException as exc:  # a rank's one-line error, not torch's gathered report
            config_errors = [failure[0] for failure in exc.failures.values() if isinstance(failure[0], ConfigError)]
            if config_errors:
                raise config_errors[0] from None
            raise

