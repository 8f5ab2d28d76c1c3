"""Probes of what a code path would cost a GPU, measured on any device: host reads (each a sync on a GPU, stopping
the host from queueing work while the device runs) and the peak memory of the tensors it makes.

``host_syncs()`` records the aten calls that read values back (``_local_scalar_dense``, which ``item``, ``int()``,
``bool()`` and ``__index__`` reach; ``nonzero``, ``masked_select``, and indexing by a boolean mask, whose count sizes
the result), seen below Python so a read inside an aten op is caught too, and the tensor methods that read values
(``tolist``, which no aten op sees; the scalar methods, whose read under ``torch.inference_mode`` no mode sees). ``PeakBytes`` is the most tensor storage the block's ops held at once. The tests hold the engine and the
kernels to them (tests/test_paged_engine.py, tests/dist/engine_syncs.py) and bench/engine_costs.py reports them.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


SCALAR_READ = "aten._local_scalar_dense.default"
SCALAR_METHODS = ("item", "__bool__", "__int__", "__float__", "__index__")
"""The tensor methods that read one value back; under ``torch.inference_mode`` their read reaches no dispatch mode,
so ``host_syncs`` counts them at the method too (once: the aten read inside one is not counted again)."""


class HostReads(TorchDispatchMode):
    """Appends to ``reads`` the name of every aten call that reads a tensor's value back to the host (a scalar read
    inside a patched method, while ``inside[0]``, excepted)."""

    READS = {SCALAR_READ, "aten.nonzero.default", "aten.masked_select.default"}
    INDEXING = {"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default",
                "aten._index_put_impl_.default"}

    def __init__(self, reads: list, inside: list):
        super().__init__()
        self.reads, self.inside = reads, inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if (name in self.READS and not (name == SCALAR_READ and self.inside[0])) or name in self.INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_flatten(args[1])[0]):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_syncs() -> Iterator[list]:
    """The host reads made in the block (``HostReads``, the scalar methods and ``tolist``), in order."""
    reads: list = []
    inside = [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", *SCALAR_METHODS)}

    def counted(name: str, original):
        def read(self, *args, **kwargs):
            if not inside[0]:
                reads.append(name if name == "tolist" else SCALAR_READ)
            inside[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                inside[0] -= 1
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        with HostReads(reads, inside):
            yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


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
