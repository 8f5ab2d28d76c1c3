"""Probes of what a code path would cost a GPU, measured on any device: host reads (each a sync on a GPU, stopping
the host from queueing work while the device runs) and the peak memory of the tensors it makes.

``host_syncs()`` records the aten calls that read values back (``item``, ``int()``, ``bool()``, ``__index__`` all
reach ``_local_scalar_dense``; ``nonzero``, ``masked_select``, and indexing by a boolean mask, whose count sizes
the result), seen below Python so a read inside an aten op is caught too, and ``Tensor.tolist`` (which no aten op
sees). ``PeakBytes`` is the most tensor storage the block's ops held at once. The tests hold the engine and the
kernels to them (tests/test_paged_engine.py, tests/dist/engine_syncs.py) and bench/engine_costs.py reports them.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class HostReads(TorchDispatchMode):
    """Appends to ``reads`` the name of every aten call that reads a tensor's value back to the host."""

    READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}
    INDEXING = {"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default",
                "aten._index_put_impl_.default"}

    def __init__(self, reads: list):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in self.READS or name in self.INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_flatten(args[1])[0]):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_syncs() -> Iterator[list]:
    """The host reads made in the block (``HostReads``, and ``tolist``), in order."""
    reads: list = []
    tolist = torch.Tensor.tolist
    torch.Tensor.tolist = lambda self: reads.append("tolist") or tolist(self)
    try:
        with HostReads(reads):
            yield reads
    finally:
        torch.Tensor.tolist = tolist


class PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage that ops run in the block held at once (a storage counts from the op that
    made it until it is freed): the block's peak extra memory, on any device."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes():
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in self.seen:
                    self.seen.add(storage.data_ptr())
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, storage.data_ptr(), storage.nbytes())
        return out

    def _freed(self, pointer: int, nbytes: int) -> None:
        self.seen.discard(pointer)
        self.live -= nbytes
