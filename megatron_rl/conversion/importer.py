"""Import a Hugging Face model folder as one of our checkpoints (step 0), built at a chosen TP/PP/EP layout.

    python launch.py convert hf-to-megatron --hf DIR --out DIR [--tp N --pp N --ep N] [--dtype bf16]

The parent process (no torch) checks the folder first: config.json, supported architecture, every shard present
and complete, every tensor name and shape the config implies, and the layout. Then ``pp * lcm(tp, ep)`` worker
processes build the model at that layout on the meta device (no weights allocated) and save it with Megatron's
dist-checkpointing (``torch_dist``, the files ``save_checkpoint`` writes, so trainers load it at any layout),
each shard read from the safetensors (only its rows) just when it is written, then dropped
(``streamed_save``): the whole node holds about one shard per process at a time, not the model
(``bench/convert_import.py``, a 3.2 GB MoE at TP2 x EP2: peak RSS of all processes 3.1x the largest tensor,
1.3x above the processes' fixed cost; the in-memory import it replaced peaked at 26x). The output is written
into a hidden temp folder and renamed to ``--out`` at the end. The HF config.json and tokenizer files are kept
inside the step folder (``hf_config.json``, ``hf_tokenizer/``) so that ``megatron-to-hf`` finds the family
without being told.

DeepSeek-V3 / Kimi-K2 checkpoints ship multi-token-prediction layers (``model.layers.{num_hidden_layers}.*``,
``num_nextn_predict_layers``): they are DROPPED here, with a note on stderr; the Megatron model has no MTP
layers, and exports write ``num_nextn_predict_layers: 0``.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape
from megatron_rl.spec.parallel import attention_split_error, default_etp, expert_split_error, mlp_split_error

IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)


def check_hf_tensors(shape: ModelShape, tensors: dict, source: str,
                     fp8_block: Optional[tuple[int, int]] = None) -> list[str]:
    """Every tensor the config implies is present with its shape, and nothing else is (pure Python); FP8 weights
    each have a block scale of the right shape (``fp8_block``: quantization_config.weight_block_size, None when
    the config declares no quantization). Returns notes for the user (MTP layers dropped, FP8 dequantized)."""
    from megatron_rl.conversion.names import expected_hf_tensors, mtp_hf_prefixes
    from megatron_rl.conversion.safetensors_io import FP8_DTYPES, SCALE_SUFFIX

    expected = expected_hf_tensors(shape)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ConfigError(f"{source}: missing tensor {missing[0]} ({len(missing)} missing); the weights do not "
                          "match config.json (truncated download?)")
    for name, want in expected.items():
        got = tuple(tensors[name].shape)
        if got != want:
            raise ConfigError(f"{source}: mismatched shapes: {name} is {list(got)}, config.json implies {list(want)}")
    mtp = mtp_hf_prefixes(shape)
    dropped = sorted(n for n in tensors if mtp and n.startswith(mtp))
    notes = []
    if dropped:
        notes.append(f"dropped the {shape.mtp_num_layers} multi-token-prediction layer(s) ({len(dropped)} tensors "
                     f"under {mtp[0]}*): MTP is not built or trained here, and exports carry none "
                     "(num_nextn_predict_layers 0)")
    fp8 = sorted(n for n in expected if getattr(tensors[n], "dtype", None) in FP8_DTYPES)
    if fp8 and fp8_block is None:
        raise ConfigError(f"{source}: {fp8[0]} is FP8 but config.json has no quantization_config (weight_block_size)")
    for name in fp8:
        scale = tensors.get(name + SCALE_SUFFIX)
        want = tuple(-(-n // b) for n, b in zip(expected[name], fp8_block, strict=True))
        if scale is None or tuple(scale.shape) != want:
            raise ConfigError(f"{source}: FP8 tensor {name} needs {name + SCALE_SUFFIX} of shape {list(want)} "
                              f"(one scale per {fp8_block[0]}x{fp8_block[1]} block), got "
                              f"{None if scale is None else list(scale.shape)}")
    scales = {name + SCALE_SUFFIX for name in fp8}
    if fp8:
        notes.append(f"dequantized {len(fp8)} FP8 block-quantized tensors ({fp8_block[0]}x{fp8_block[1]} blocks, "
                     "weight_scale_inv); the checkpoint and its exports are unquantized (no quantization_config)")
    unexpected = sorted(n for n in tensors if n not in expected and not n.endswith(IGNORED_HF_TENSORS)
                        and not (n == "lm_head.weight" and shape.tie_embeddings) and n not in dropped
                        and n not in scales)
    if unexpected:
        raise ConfigError(f"{source}: {len(unexpected)} tensor(s) the converter does not map (first: "
                          f"{unexpected[0]}); the architecture has parts this converter does not support")
    return notes


def check_layout(shape: ModelShape, tp: int, pp: int, ep: int) -> None:
    """Layout rules Megatron enforces, as one-line errors before any process starts."""
    from megatron_rl.conversion.names import conversion_dims

    for name, value in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    etp = default_etp(tp=tp, ep=ep)  # the experts' split as the job builds them
    why = (attention_split_error(shape, tp, key="--") or mlp_split_error(shape, tp, etp, key="--")
           or expert_split_error(shape, ep, key="--"))
    if why is not None:
        raise ConfigError(why)
    conversion_dims(shape, tp, pp, ep)  # a legal (possibly uneven) pipeline split


def import_hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
                          dtype: Optional[str] = None, overwrite: bool = False,
                          timeout: Optional[float] = None) -> dict[str, Any]:
    """Convert the HF folder ``hf_dir`` into a checkpoint root ``out_dir`` (``step_00000000`` + ``latest``)."""
    from megatron_rl.conversion.export import prepare_output, publish
    from megatron_rl.conversion.names import check_convertible, layout_world_size, shape_from_config
    from megatron_rl.conversion.safetensors_io import HFCheckpoint
    from megatron_rl.conversion.spawn import run_worker

    start = time.perf_counter()
    hf_dir, out = Path(hf_dir).resolve(), Path(out_dir).resolve()
    if dtype is not None and dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"--dtype {dtype!r}: use fp32, bf16 or fp16")
    hf = HFCheckpoint.open(hf_dir)
    source = str(hf_dir)
    shape = shape_from_config(hf.config, f"{source}/config.json", name=hf_dir.name)
    check_convertible(shape, source)
    notes = check_hf_tensors(shape, {k: v for k, v in hf.tensors.items()}, source,
                             hf.fp8_block if hf.config.get("quantization_config") else None)
    for note in notes:  # before the (long) conversion starts
        print(f"note: {note}", file=sys.stderr, flush=True)
    check_layout(shape, tp, pp, ep)
    if out == hf_dir or hf_dir in out.parents:
        raise ConfigError(f"--out {out} must not be inside the HF folder")
    tmp = prepare_output(out, overwrite)
    nproc = layout_world_size(tp, pp, ep)
    try:
        task = {"kind": "import", "hf": str(hf_dir), "out": str(tmp), "tp": tp, "pp": pp, "ep": ep, "dtype": dtype}
        results = run_worker([task], nproc, timeout=timeout)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out_dir": str(out), "step_folder": str(out / Path(results[0]["folder"]).name), "tp": tp, "pp": pp,
            "ep": ep, "processes": nproc, "dtype": results[0]["dtype"], "seconds": time.perf_counter() - start,
            "notes": notes}
