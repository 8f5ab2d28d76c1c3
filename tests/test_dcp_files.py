"""The restricted unpicklers of megatron_rl/conversion/dcp_files.py: they read what torch writes, and nothing else.

Run: .venv/bin/python -m pytest tests/test_dcp_files.py -q

A checkpoint saved by torch.distributed.checkpoint (one process, no Megatron) is read both by torch and by the
stand-ins, entry by entry, and its tensors through the raw-bytes path and the torch.load path; pickles that
would run code (in .metadata, in a tensor record, in common.pt) are refused, and the code does not run.
"""

from __future__ import annotations

import os
import pickle
import zipfile

import pytest

from megatron_rl.spec.errors import ConfigError
from megatron_rl.conversion.dcp_files import (
    MetadataIndex,
    load_metadata,
    load_plain_state,
    load_tensor_record,
)
from megatron_rl.conversion.dist_reader import CheckpointReader

torch = pytest.importorskip("torch")


class RunsCode:
    """Unpickling this calls os.system: the classic malicious pickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A DCP folder of model-key tensors in fp32 and bf16 (1-D, 2-D, and a layer-stacked 3-D one)."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("dcp") / "step_00000001"
    generator = torch.Generator().manual_seed(0)
    state = {"embedding.word_embeddings.weight": torch.randn(24, 8, generator=generator),
             "decoder.final_layernorm.weight": torch.randn(8, generator=generator).to(torch.bfloat16),
             "decoder.layers.mlp.linear_fc2.weight": torch.randn(3, 8, 16, generator=generator)}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder, state


def test_metadata_stand_ins_read_what_torch_reads(saved):
    from torch.distributed.checkpoint import FileSystemReader

    folder, state = saved
    ours, theirs = load_metadata(folder / ".metadata"), FileSystemReader(str(folder)).read_metadata()
    assert sorted(ours.state_dict_metadata) == sorted(theirs.state_dict_metadata) == sorted(state)
    for key, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[key]
        assert mine.properties.dtype == str(md.properties.dtype).removeprefix("torch.") == \
            str(state[key].dtype).removeprefix("torch.")
        assert mine.size == tuple(md.size)
        assert [(c.offsets, c.sizes) for c in mine.chunks] == [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    assert len(ours.storage_data) == len(theirs.storage_data) > 0
    for index, info in theirs.storage_data.items():
        mine = ours.storage_data[MetadataIndex(index.fqn, tuple(index.offset))]
        assert (mine.relative_path, mine.offset, mine.length) == (info.relative_path, info.offset, info.length)


def test_raw_bytes_equal_torch_load(saved, monkeypatch):
    """Every tensor read from its raw bytes (no torch) equals what torch saved, and equals the torch.load path."""
    folder, state = saved
    reader = CheckpointReader(folder)
    assert len(reader.index) == 5  # the stacked tensor holds 3 layers
    raw = {ref: reader.read_bytes(ref) for ref in reader.index}
    assert all(c.data_offset is not None for ref in reader.index for c in reader.chunks(ref))
    monkeypatch.setattr(CheckpointReader, "_raw_offset", lambda self, info, sizes, dtype: None)
    assert all(c.data_offset is None for ref in reader.index for c in reader.chunks(ref))
    for ref, data in raw.items():
        stored = reader.index[ref]
        tensor = state[stored.key][stored.prepend] if stored.prepend else state[stored.key]
        assert data.tobytes() == tensor.contiguous().view(torch.uint8).numpy().tobytes(), ref
        assert reader.read_bytes(ref).tobytes() == data.tobytes(), ref
        assert torch.equal(reader.read([ref], dtype=torch.float32)[ref], tensor.to(torch.float32)), ref


def test_tensor_record_is_read_without_building_it(saved):
    folder, _ = saved
    metadata = load_metadata(folder / ".metadata")
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "decoder.final_layernorm.weight")
    with open(folder / info.relative_path, "rb") as f:
        f.seek(info.offset)
        archive = zipfile.ZipFile(__import__("io").BytesIO(f.read(info.length)))
    record = load_tensor_record(archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl"))))
    assert (record.dtype, record.offset, record.size, record.stride) == ("bfloat16", 0, (8,), (1,))


def test_a_metadata_pickle_that_runs_code_is_refused(tmp_path):
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(pickle.UnpicklingError, match=r"refused to load (posix|os)\.system"):
        load_metadata(folder / ".metadata")
    with pytest.raises(ConfigError, match="unreadable .metadata"):
        CheckpointReader(folder)
    assert not marker.exists()
    # a metadata class next to a forbidden one does not open the door either
    (folder / ".metadata").write_bytes(pickle.dumps({"a": MetadataIndex("x"), "b": RunsCode(marker)}))
    with pytest.raises(pickle.UnpicklingError):
        load_metadata(folder / ".metadata")
    assert not marker.exists()


def test_a_tensor_record_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        load_tensor_record(pickle.dumps(RunsCode(marker)))
    with pytest.raises(pickle.UnpicklingError, match="not a single plain tensor"):
        load_tensor_record(pickle.dumps(("storage", 1, 2)))
    assert not marker.exists()


def test_a_common_state_that_runs_code_is_refused_by_both_readers(tmp_path):
    """common.pt as torch.save writes it (a zip): the plain reader refuses the pickle, the torch.load fallback
    (weights_only=True) refuses it too; a plain one is read without torch."""
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    marker = tmp_path / "ran"
    torch.save({"step": 3, "layout": {"tp": 2}, "extra": {"model": None}}, folder / "common.pt")
    assert load_plain_state(folder / "common.pt") == {"step": 3, "layout": {"tp": 2}, "extra": {"model": None}}
    with zipfile.ZipFile(folder / "common.pt", "w") as archive:
        archive.writestr("common/data.pkl", pickle.dumps({"step": 1, "extra": RunsCode(marker)}, protocol=2))
        archive.writestr("common/byteorder", "little")
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        load_plain_state(folder / "common.pt")
    reader = CheckpointReader.__new__(CheckpointReader)
    reader.folder = folder
    with pytest.raises(ConfigError, match="unreadable common.pt"):
        reader.common_state()
    assert not marker.exists()
