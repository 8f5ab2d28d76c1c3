"""LoRA checkpoints to Hugging Face: merged weights, or a PEFT adapter folder for the HF base model.

    python launch.py convert megatron-to-hf --ckpt runs/grpo_lora_tiny/checkpoints --out hf_merged
    python launch.py convert megatron-to-hf --ckpt CKPT --out adapter_dir --lora-adapter --base-hf HF_BASE
    .venv/bin/python -m pytest tests/test_lora.py -q

A LoRA run's checkpoints hold each adapted linear's ``<linear>.lora.A`` [r, in] and ``.lora.B`` [out, r] under
global (layout-free) keys, next to the frozen base weight, and its settings under ``extra["lora"]``. The merged
export writes W + B A * alpha / r (computed in fp32 from the global tensors, so every TP layout merges alike)
through the usual name map. The adapter export keeps A and B apart with PEFT's names: the fused QKV's A is
shared by q_proj, k_proj and v_proj and its B is split into their rows, and a gated fc1's A is shared by
gate_proj and up_proj with B split, by the same row split (``names.hf_row_sources``) the base weights use.
``model.lora.modules_to_save`` (trained in full) are in both: the merged export writes the checkpoint's weights,
and the adapter folder lists them in ``modules_to_save`` (``embed_tokens``, ``lm_head``, ``model.norm``) with their
tensors under PEFT's keys (``base_model.model.lm_head.weight``, as PEFT 0.21's ``save_pretrained`` writes them).
With tied embeddings the one trained weight is written as both, and ``ensure_weight_tying`` keeps PEFT's copies
tied. ``lora_dropout`` is the run's ``model.lora.dropout`` (PEFT applies it in training mode only).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from megatron_rl.conversion.export import (
    adapted_weights,
    check_stored_tensors,
    hf_tensor_bytes,
    lora_settings,
    prepare_output,
    publish,
    resolve_model_source,
)
from megatron_rl.spec.errors import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def export_peft_adapter(ckpt: Union[str, Path], out_dir: Union[str, Path], *, base_hf: Union[str, Path],
                        overwrite: bool = False) -> dict[str, Any]:
    """Write the checkpoint's adapters as a PEFT LoRA folder (``adapter_config.json``,
    ``adapter_model.safetensors``) for the HF model in ``base_hf``; returns a summary."""
    import torch
    from safetensors.torch import save_file

    from megatron_rl.conversion.dist_reader import CheckpointReader
    from megatron_rl.conversion.names import (
        REWARD_HEAD_WEIGHT,
        adapter_refs,
        check_convertible,
        hf_row_sources,
        tensor_maps,
    )

    out = Path(out_dir).resolve()
    if out.exists() and not overwrite:
        raise ConfigError(f"--out {out} already exists; pass --overwrite to replace it")
    base = Path(base_hf).expanduser().resolve()
    if not (base / "config.json").is_file():
        raise ConfigError(f"--base-hf {base_hf}: no config.json there; give the Hugging Face folder of the base model")
    reader = CheckpointReader(ckpt)
    settings = lora_settings(reader)
    adapted = adapted_weights(reader)
    if settings is None or not adapted:
        raise ConfigError(f"--lora-adapter: --ckpt {reader.folder} holds no LoRA adapters (its run had no "
                          "model.lora); export it without --lora-adapter")
    if any(ref.expert is not None for ref in adapted):
        raise ConfigError(f"--lora-adapter: --ckpt {reader.folder} has adapters on routed experts, which transformers "
                          "holds fused (one parameter for all experts) and PEFT adapts only through target_parameters, "
                          "not written yet; export it merged (without --lora-adapter)")
    if any(ref.name == REWARD_HEAD_WEIGHT for ref in reader.index):
        raise ConfigError("--lora-adapter writes causal-LM adapters; this is a reward-model checkpoint: export "
                          "it merged (without --lora-adapter)")
    source = resolve_model_source(reader.folder, base, reader.common_state())
    check_convertible(source.shape, source.origin)
    maps = tensor_maps(source.shape)
    check_stored_tensors(reader, maps, source.shape, f"--base-hf {base}", False)
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for tm in maps:
        if tm.ref not in adapted:
            continue
        a_ref, b_ref = adapter_refs(tm.ref)
        read = reader.read([a_ref, b_ref])
        lora_a, lora_b = read[a_ref], read[b_ref]
        for name, blocks in hf_row_sources(tm, source.shape, lora_b.shape[0]).items():
            module = name.removesuffix(".weight")
            targets.add(module.rsplit(".", 1)[-1])
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = lora_a.clone()  # safetensors stores no shared memory
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.cat([lora_b[first:first + rows]
                                                                         for first, rows in blocks]).contiguous()
    saved = saved_module_tensors(reader, maps, source.shape, settings.get("modules_to_save") or [])
    tensors.update({PEFT_PREFIX + name: value for name, value in saved.items()})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
              "r": int(next(iter(tensors.values())).shape[0]), "lora_alpha": settings["alpha"],
              "lora_dropout": settings.get("dropout", 0.0), "target_modules": sorted(targets), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "init_lora_weights": True,
              "modules_to_save": sorted({HF_SAVED_MODULES[n] for n in saved}) or None}
    if source.shape.tie_embeddings and "lm_head.weight" in saved:  # PEFT then keeps its two copies one parameter
        config["ensure_weight_tying"] = True
    tmp = prepare_output(out, overwrite)
    try:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out_dir": out, "tensors": len(tensors), "target_modules": sorted(targets), "r": config["r"],
            "modules_to_save": config["modules_to_save"]}


HF_SAVED_MODULES = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head",
                    "model.norm.weight": "model.norm"}
"""HF tensor of a modules_to_save -> its PEFT modules_to_save name. PEFT matches these names as suffixes of module
paths, so the final norm is ``model.norm``: a bare ``norm`` would also take every layer's norms."""


def saved_module_tensors(reader, maps, shape, modules_to_save) -> dict:
    """HF name -> global tensor of each trained base module (model.lora.modules_to_save) the checkpoint stores;
    with tied embeddings the shared weight is both embed_tokens and lm_head (PEFT keeps a copy for each)."""
    import torch

    from megatron_rl.conversion.names import EMBEDDING, FINAL_NORM, OUTPUT

    wanted = {{"embedding": EMBEDDING, "output_layer": OUTPUT, "final_layernorm": FINAL_NORM}[m]
              for m in modules_to_save}
    if shape.tie_embeddings and wanted & {EMBEDDING, OUTPUT}:
        wanted |= {EMBEDDING, OUTPUT}
    out = {}
    for tm in maps:
        if tm.ref.name not in wanted or tm.ref.layer is not None:
            continue
        dtype = getattr(torch, reader.index[tm.ref].dtype)
        for (name, data), hf_shape in zip(hf_tensor_bytes(tm, shape, reader, None).items(), tm.hf_shapes):
            out[name] = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).copy()).view(dtype).reshape(hf_shape)
    if shape.tie_embeddings and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out
