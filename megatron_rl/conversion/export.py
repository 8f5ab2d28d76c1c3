"""Export one of our checkpoints (any TP/PP/EP layout, training or reward model) to a Hugging Face folder.

    python launch.py convert megatron-to-hf --ckpt runs/x/checkpoints --out hf_out [--shard-size 2GB] [--verify]

or in-process (rank 0 of a trainer, no process group needed)::

    from megatron_rl.conversion import export_checkpoint_to_hf
    export_checkpoint_to_hf("runs/x/checkpoints", "runs/x/hf", model="path/to/hf_model_or_preset")

No model is built, and neither torch nor Megatron is imported unless a tensor needs torch (a dtype cast, a
checkpoint record of an unusual form). Tensors are read from the checkpoint's global (layout-free) keys and
streamed, in plan order, into safetensors shards whose headers are planned up front. A tensor whose saved chunks
are blocks of whole rows (TP=1, or TP shards on dim 0: most bytes) is copied file to file in the kernel
(copy_file_range), row range by row range (padded vocab rows cut, QKV split per query group, [gate; up] split);
any other (row-parallel weights at TP>1) is reassembled in memory on a worker thread, up to ``read_budget``
bytes ahead of the writer, so that its reads overlap the writes. Peak memory is about ``read_budget`` (or the
largest such tensor, if bigger) plus the tensor being written, whatever the model size. Everything is written
into a hidden temporary folder that is renamed to ``out`` only when complete and on disk.
"""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape

HF_CONFIG_FILE = "hf_config.json"
HF_TOKENIZER_DIR = "hf_tokenizer"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """What the exporter knows about the model behind a checkpoint."""

    shape: ModelShape
    """Architecture."""
    hf_config: dict[str, Any]
    """The HF config.json to write (recorded at import, or generated from the shape)."""
    tokenizer_dir: Optional[Path] = None
    """Folder holding tokenizer files to copy, if any."""
    origin: str = ""
    """Where the description came from (for messages)."""


@dataclass(kw_only=True)
class ExportSummary:
    """Result of one export."""

    out_dir: Path
    """The published Hugging Face folder."""
    architecture: str
    """architectures[0] written to config.json."""
    num_tensors: int
    """Tensors written."""
    num_shards: int
    """safetensors files written."""
    bytes_written: int
    """Tensor bytes written."""
    seconds: float
    """Wall time of the export."""
    bytes_copied_in_kernel: int = 0
    """Part of bytes_written copied file to file (copy_file_range) rather than through memory."""
    notes: list[str] = field(default_factory=list)
    """Things the user should know (dropped reward bias, ignored tensors)."""


def model_metadata(shape: ModelShape, hf_config: Optional[dict] = None, tokenizer_dir: Optional[str] = None) -> dict:
    """What a trainer should store under ``extra["model"]`` of its checkpoints so they export without --model."""
    return {"shape": shape.to_dict(), "hf_config": hf_config, "tokenizer_dir": tokenizer_dir}


def resolve_model_source(step_folder: Path, model: Union[None, str, Path, ModelShape, dict],
                         common: dict, hf_source: Optional[Path] = None) -> ModelSource:
    """Model description: explicit ``model`` > files stored in the checkpoint > ``extra["model"]`` of the common state."""
    from megatron_rl.conversion.names import hf_config_from_shape, shape_from_config
    from megatron_rl.spec.model_shape import load_model_shape

    if isinstance(model, ModelShape):
        return ModelSource(shape=model, hf_config=hf_config_from_shape(model), tokenizer_dir=hf_source,
                           origin="given shape")
    if isinstance(model, dict):
        return ModelSource(shape=shape_from_config(model, "given HF config"), hf_config=model,
                           tokenizer_dir=hf_source, origin="given HF config")
    if model:
        path = Path(model)
        cfg_file = path / "config.json" if path.is_dir() else path
        if cfg_file.suffix == ".json" and cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            return ModelSource(shape=shape_from_config(cfg, str(cfg_file)), hf_config=cfg,
                               tokenizer_dir=hf_source or cfg_file.parent, origin=str(cfg_file))
        shape = load_model_shape(str(model))
        return ModelSource(shape=shape, hf_config=hf_config_from_shape(shape), tokenizer_dir=hf_source,
                           origin=f"model {model}")
    for folder in (step_folder, step_folder.parent):
        cfg_file = folder / HF_CONFIG_FILE
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            tok = folder / HF_TOKENIZER_DIR
            return ModelSource(shape=shape_from_config(cfg, str(cfg_file)), hf_config=cfg,
                               tokenizer_dir=hf_source or (tok if tok.is_dir() else None), origin=str(cfg_file))
    recorded = (common.get("extra") or {}).get("model") if isinstance(common.get("extra"), dict) else None
    if recorded:
        tok = recorded.get("tokenizer_dir")
        tok_dir = hf_source or (Path(tok) if tok and Path(tok).is_dir() else None)
        if recorded.get("hf_config"):
            cfg = recorded["hf_config"]
            return ModelSource(shape=shape_from_config(cfg, "checkpoint extra.model"), hf_config=cfg,
                               tokenizer_dir=tok_dir, origin="checkpoint extra.model.hf_config")
        shape = ModelShape.from_dict(recorded["shape"])
        return ModelSource(shape=shape, hf_config=hf_config_from_shape(shape), tokenizer_dir=tok_dir,
                           origin="checkpoint extra.model.shape")
    raise ConfigError(f"--ckpt {step_folder}: the checkpoint does not record its model; pass --model "
                      "(an HF folder or config.json, a preset name or a model YAML)")


def prepare_output(out: Path, overwrite: bool) -> Path:
    """Refuse an existing output unless ``overwrite``; return a fresh hidden temp folder next to it."""
    if out.exists() and not overwrite:
        raise ConfigError(f"--out {out} already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, out: Path) -> None:
    """Put the finished temp folder on disk (one fsync per file, then the folder) and rename it to ``out``
    (moving an old ``out`` aside first, then deleting it)."""
    from megatron_rl.runtime.checkpoint import fsync_path, fsync_tree

    fsync_tree(tmp)
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_stored_tensors(reader, maps: list, shape: ModelShape, origin: str, reward: bool) -> None:
    """Every tensor the model needs is stored with its shape, and the checkpoint holds nothing unexplained."""
    from megatron_rl.conversion.names import OUTPUT, REWARD_HEAD_BIAS, REWARD_HEAD_WEIGHT, megatron_shape

    missing = [tm.ref for tm in maps if tm.ref not in reader.index]
    if missing:
        raise ConfigError(f"--ckpt {reader.folder}: lacks {len(missing)} tensor(s) that {origin} needs "
                          f"(first: {missing[0]}); is it a complete checkpoint of this model?")
    for tm in maps:
        stored = reader.index[tm.ref].shape
        expected = megatron_shape(tm, stored[0] if tm.kind == "vocab" else None)
        ok = stored == expected or (tm.ref.name == REWARD_HEAD_WEIGHT and stored == (shape.hidden_size,))
        if not ok or (tm.kind == "vocab" and stored[0] < tm.hf_shapes[0][0]):
            raise ConfigError(f"mismatched shapes: checkpoint tensor {tm.ref} is {list(stored)} but {origin} "
                              f"implies {list(expected)}; is --model the right model for this checkpoint?")
    from megatron_rl.conversion.names import is_adapter_ref

    ignorable = {OUTPUT} if shape.tie_embeddings or reward else set()
    if reward:
        ignorable.add(REWARD_HEAD_BIAS)  # no place for it in HF's score layer; recorded in config.json
    mapped = {tm.ref for tm in maps}
    extra = sorted(str(r) for r in reader.index if r not in mapped and r.name not in ignorable
                   and not is_adapter_ref(r))  # LoRA adapters: merged into their base weights
    if extra:
        raise ConfigError(f"--ckpt {reader.folder}: holds {len(extra)} tensor(s) that {origin} does not "
                          f"describe (first: {extra[0]}); is --model the right model for this checkpoint?")


def export_config(hf_config: dict, reader, dtype_name: str, reward: bool) -> tuple[dict, list[str]]:
    """config.json of the export (a reward model becomes *ForSequenceClassification, a PPO critic
    *ForTokenClassification: the same weights, a value at every token) and notes for the user."""
    from megatron_rl.conversion.names import (CLASSIFICATION_ARCHITECTURES, REWARD_HEAD_BIAS, VALUE_HEAD_ARCHITECTURES,
                                              with_architecture)
    from megatron_rl.runtime.checkpoint import COMPANION_KEY

    cfg = with_architecture(json.loads(json.dumps(hf_config)))
    notes: list[str] = []
    if reward:
        extra = reader.common_state().get("extra") or {}
        heads = VALUE_HEAD_ARCHITECTURES if extra.get(COMPANION_KEY) == "critic" else CLASSIFICATION_ARCHITECTURES
        arch = heads.get(cfg["architectures"][0], cfg["architectures"][0])
        cfg.update(architectures=[arch], num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        bias_ref = next((r for r in reader.index if r.name == REWARD_HEAD_BIAS), None)
        if bias_ref is not None:
            bias = float(reader.read([bias_ref])[bias_ref].reshape(-1)[0])
            cfg["reward_bias"] = bias
            if bias != 0.0:
                notes.append(f"the reward head's bias {bias:.6g} has no place in HF's score layer: exported scores "
                             "are the checkpoint's rewards minus it (stored as config.json reward_bias)")
    if cfg.get("num_nextn_predict_layers"):
        notes.append(f"the {cfg['num_nextn_predict_layers']} multi-token-prediction layer(s) of the original "
                     "model were dropped at import: none exported (config.json num_nextn_predict_layers 0)")
        cfg["num_nextn_predict_layers"] = 0
    cfg["torch_dtype"] = dtype_name
    if "dtype" in cfg:
        cfg["dtype"] = dtype_name
    cfg.pop("transformers_version", None)
    return cfg, notes


def kernel_copy_plan(tm, shape: ModelShape, reader) -> Optional[dict[str, list[tuple[Path, int, int]]]]:
    """Byte ranges of the checkpoint's files that make up each HF tensor of ``tm``, when every saved chunk is
    stored raw and is a block of whole rows (TP=1, or sharded on dim 0) so that every HF tensor is a sequence of
    contiguous byte ranges; None otherwise (row-parallel weights at TP>1, unusual records): those are assembled
    in memory (``hf_tensor_bytes``)."""
    from megatron_rl.conversion.names import hf_row_sources

    stored = reader.index[tm.ref]
    chunks = reader.chunks(tm.ref)
    if not stored.shape or any(c.data_offset is None or c.sizes[1:] != stored.shape[1:] for c in chunks):
        return None
    row_bytes = math.prod(stored.shape[1:]) * stored.itemsize
    chunks = sorted(chunks, key=lambda c: c.offsets[0])
    plan = {}
    for name, blocks in hf_row_sources(tm, shape, stored.shape[0]).items():
        segments: list[tuple[Path, int, int]] = []
        for first, rows in blocks:
            for c in chunks:
                lo, hi = max(first, c.offsets[0]), min(first + rows, c.offsets[0] + c.sizes[0])
                if lo >= hi:
                    continue
                start, nbytes = c.data_offset + (lo - c.offsets[0]) * row_bytes, (hi - lo) * row_bytes
                if segments and segments[-1][0] == c.path and segments[-1][1] + segments[-1][2] == start:
                    segments[-1] = (c.path, segments[-1][1], segments[-1][2] + nbytes)
                else:
                    segments.append((c.path, start, nbytes))
        plan[name] = segments
    return plan


def hf_tensor_bytes(tm, shape: ModelShape, reader, out_dtype: Optional[str],
                    lora_scale: Optional[float] = None) -> dict[str, np.ndarray]:
    """The bytes of each HF tensor of ``tm``: its global Megatron tensor reassembled in memory, then the HF
    tensors' rows taken from it (padding rows cut, QKV split per query group, [gate; up] split), cast to
    ``out_dtype`` if given. ``lora_scale``: the tensor has a LoRA adapter, merged in first (W + B A scale)."""
    from megatron_rl.conversion.names import hf_row_sources

    stored = reader.index[tm.ref]
    if lora_scale is not None:
        rows = merged_weight_bytes(reader, tm.ref, lora_scale).reshape(stored.shape[0], -1)
    else:
        rows = reader.read_bytes(tm.ref).reshape(stored.shape[0] if stored.shape else 1, -1)
    out = {}
    for name, blocks in hf_row_sources(tm, shape, rows.shape[0]).items():
        data = rows[blocks[0][0]:sum(blocks[0])] if len(blocks) == 1 else \
            np.concatenate([rows[first:first + n] for first, n in blocks])
        out[name] = data if out_dtype in (None, stored.dtype) else cast(data, stored.dtype, out_dtype)
    return out


def cast(data: np.ndarray, dtype: str, out_dtype: str) -> np.ndarray:
    """Bytes of ``dtype`` elements -> bytes of the same values in ``out_dtype`` (torch's rounding)."""
    import torch

    values = torch.from_numpy(data.reshape(-1)).view(getattr(torch, dtype))
    return values.to(getattr(torch, out_dtype)).view(torch.uint8).numpy()


def lora_settings(reader) -> Optional[dict[str, Any]]:
    """The run's ``model.lora`` settings recorded in the checkpoint (None: not a LoRA checkpoint)."""
    extra = reader.common_state().get("extra")
    return extra.get("lora") if isinstance(extra, dict) else None


def adapted_weights(reader) -> dict:
    """Base weight ref -> the LoRA scale alpha / r of its adapter, for every adapter the checkpoint stores."""
    from megatron_rl.conversion.names import LORA_SUFFIXES, MegatronRef

    refs = [ref for ref in reader.index if ref.name.endswith(LORA_SUFFIXES[0])]
    if not refs:
        return {}
    settings = lora_settings(reader)
    if settings is None:
        raise ConfigError(f"--ckpt {reader.folder}: holds LoRA adapters but no extra['lora'] settings (alpha); "
                          "it was not saved by a megatron_rl LoRA run")
    out = {}
    for a_ref in refs:
        rank = reader.index[a_ref].shape[0]
        out[MegatronRef(a_ref.name.removesuffix(LORA_SUFFIXES[0]) + ".weight", a_ref.layer, a_ref.expert)] = \
            float(settings["alpha"]) / rank
    return out


def merged_weight_bytes(reader, ref, scale: float) -> np.ndarray:
    """The global base weight of ``ref`` with its adapter merged (W + B A scale), in the stored dtype, as
    ``read_bytes`` gives it: uint8 of shape (*shape, itemsize)."""
    import torch

    from megatron_rl.conversion.names import adapter_refs

    a_ref, b_ref = adapter_refs(ref)
    tensors = reader.read([ref, a_ref, b_ref])
    base = tensors[ref]
    merged = (base.float() + (tensors[b_ref].float() @ tensors[a_ref].float()) * scale).to(base.dtype)
    return merged.contiguous().view(torch.uint8).numpy().reshape(*base.shape, base.element_size())


class ReadAhead:
    """``read(item)`` of each item in turn, run on ``pool``'s worker up to ``budget`` bytes (at least one item)
    ahead of the consumer, so that reading the next tensors overlaps writing this one."""

    def __init__(self, pool: ThreadPoolExecutor, items: list, read: Callable, nbytes: Callable[[Any], int],
                 budget: int):
        self.pool, self.items, self.read, self.nbytes, self.budget = pool, items, read, nbytes, budget
        self.pending: collections.deque = collections.deque()
        self.queued = 0
        self.submitted = 0
        self._submit()

    def _submit(self) -> None:
        while self.submitted < len(self.items):
            item = self.items[self.submitted]
            if self.pending and self.queued + self.nbytes(item) > self.budget:
                return
            self.pending.append((item, self.pool.submit(self.read, item)))
            self.queued += self.nbytes(item)
            self.submitted += 1

    def next(self) -> Any:
        item, future = self.pending.popleft()
        result = future.result()
        self.queued -= self.nbytes(item)
        self._submit()
        return result

    def cancel(self) -> None:
        """Drop the reads not started yet (after an error)."""
        for _, future in self.pending:
            future.cancel()


def export_checkpoint_to_hf(ckpt: Union[str, Path], out_dir: Union[str, Path], *,
                            model: Union[None, str, Path, ModelShape, dict] = None,
                            hf_source: Union[None, str, Path] = None, shard_size: Union[int, str] = "2GB",
                            dtype: Optional[str] = None, overwrite: bool = False,
                            read_budget: int = 256 * 2**20, kernel_copy: bool = True,
                            check: Optional[Callable[[Path], None]] = None,
                            progress: Optional[Callable[[str], None]] = None) -> ExportSummary:
    """Export checkpoint ``ckpt`` (step folder or checkpoint root) to the HF folder ``out_dir``.

    model: HF folder/config.json, preset or YAML spec, ModelShape or HF config dict; default: what the checkpoint
    recorded. hf_source: folder to copy tokenizer files from. dtype: fp32/bf16/fp16 (default: as stored).
    check: called with the finished (unpublished) folder; if it raises, nothing is published.
    kernel_copy: copy tensors whose bytes need no change (TP=1 or dim-0 shards, no dtype cast) file to file with
    copy_file_range instead of through memory.
    """
    from megatron_rl.conversion.dist_reader import CheckpointReader
    from megatron_rl.conversion.names import REWARD_HEAD_WEIGHT, check_convertible, tensor_maps
    from megatron_rl.conversion.safetensors_io import (
        PlannedTensor,
        ShardedSafetensorsWriter,
        copy_tokenizer_files,
        parse_size,
        plan_shards,
        torch_dtype_name,
    )

    start = time.perf_counter()
    out = Path(out_dir).resolve()
    max_shard = parse_size(shard_size)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if out.exists() and not overwrite:
        raise ConfigError(f"--out {out} already exists; pass --overwrite to replace it")
    reader = CheckpointReader(ckpt)
    if out == reader.folder or reader.folder in out.parents or out in reader.folder.parents:
        raise ConfigError(f"--out {out} must not be the checkpoint folder, inside it or above it")
    source = resolve_model_source(reader.folder, model, reader.common_state(),
                                  Path(hf_source) if hf_source else None)
    shape = source.shape
    check_convertible(shape, source.origin)
    reward = any(ref.name == REWARD_HEAD_WEIGHT for ref in reader.index)
    maps = tensor_maps(shape, reward_head=reward)

    check_stored_tensors(reader, maps, shape, source.origin, reward)

    merged = adapted_weights(reader)  # LoRA: base weight ref -> scale; these go through memory, merged

    out_dtype = DTYPES[dtype] if dtype else None
    groups = []
    for tm in maps:
        st_dtype = torch_dtype_name(out_dtype or reader.index[tm.ref].dtype)
        groups.append([PlannedTensor(name, st_dtype, hf_shape)
                       for name, hf_shape in zip(tm.hf, tm.hf_shapes, strict=True)])
    shards = plan_shards(groups, max_shard)

    hf_config, notes = export_config(source.hf_config, reader, out_dtype or reader.index[maps[0].ref].dtype, reward)
    arch = hf_config["architectures"][0]

    tmp = prepare_output(out, overwrite)
    writer = ShardedSafetensorsWriter(tmp, shards)
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if source.tokenizer_dir is not None:
            copy_tokenizer_files(Path(source.tokenizer_dir), tmp)
        plans = {tm.ref: kernel_copy_plan(tm, shape, reader) for tm in maps
                 if kernel_copy and out_dtype in (None, reader.index[tm.ref].dtype) and tm.ref not in merged}
        in_memory = [tm for tm in maps if plans.get(tm.ref) is None]
        kernel_bytes = 0
        with ThreadPoolExecutor(max_workers=1) as pool:
            ahead = ReadAhead(pool, in_memory, lambda tm: hf_tensor_bytes(tm, shape, reader, out_dtype,
                                                                          merged.get(tm.ref)),
                              lambda tm: reader.index[tm.ref].nbytes, read_budget)
            try:
                for i, tm in enumerate(maps):
                    if plans.get(tm.ref) is not None:
                        for name, segments in plans[tm.ref].items():
                            writer.copy_ranges(name, segments)
                            kernel_bytes += sum(n for _, _, n in segments)
                    else:
                        for name, data in ahead.next().items():
                            writer.write_bytes(name, data)
                    if progress:
                        progress(f"exported {i + 1}/{len(maps)} tensor groups ({writer.bytes_written / 1e9:.2f} GB)")
            finally:
                ahead.cancel()
        writer.close()
        if check is not None:
            check(tmp)
        publish(tmp, out)
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportSummary(out_dir=out, architecture=arch, num_tensors=sum(len(g) for g in groups),
                         num_shards=len(shards), bytes_written=writer.bytes_written,
                         seconds=time.perf_counter() - start, notes=notes, bytes_copied_in_kernel=kernel_bytes)
