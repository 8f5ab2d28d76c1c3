"""LoRA checkpoints to Hugging Face: merged weights, or a PEFT adapter folder for the HF base model.

    python launch.py convert megatron-to-hf --ckpt runs/grpo_lora_tiny/checkpoints --out hf_merged
    python launch.py convert megatron-to-hf --ckpt CKPT --out adapter_dir --lora-adapter --base-hf HF_BASE
    .venv/bin/python -m pytest tests/test_lora.py -q

A LoRA run's checkpoints hold each adapted linear's ``<linear>.lora.A`` [r, in] and ``.lora.B`` [out, r] under
global (layout-free) keys, next to the frozen base weight, and its settings under ``extra["lora"]``. The merged
export writes W + B A * alpha / r (computed in fp32 from the global tensors, so every TP layout merges alike)
through the usual name map. The adapter export keeps A and B apart with PEFT's names: the fused QKV's A is
shared by q_proj, k_proj and v_proj and its B is split into their rows, and a gated fc1's A is shared by
gate_proj and up_proj with B split, by the same row split (``names.hf_row_sources``) the base weights use; MLA's
projections and the shared experts' are plain copies (``target_modules`` name each with its parent module, so
``mlp.gate_proj`` does not also take ``shared_experts.gate_proj``). Routed experts, which transformers 5 holds fused
per layer, go through PEFT's ``target_parameters`` (``expert_adapter_tensors``), and in a MoE model so do the other
gate/up/down projections (``MOE_RENAMED_LINEARS``), with ``lora_dropout`` 0: PEFT applies no dropout there.
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
from typing import Any, Union

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
    if any(ref.name == REWARD_HEAD_WEIGHT for ref in reader.index):
        raise ConfigError("--lora-adapter writes causal-LM adapters; this is a reward-model checkpoint: export "
                          "it merged (without --lora-adapter)")
    source = resolve_model_source(reader.folder, base, reader.common_state())
    check_convertible(source.shape, source.origin)
    maps = tensor_maps(source.shape)
    check_stored_tensors(reader, maps, source.shape, f"--base-hf {base}", False)
    tensors, parameters = expert_adapter_tensors(reader, adapted, source.shape.num_experts)
    targets: set[str] = set()
    by_parameter = set()
    for tm in maps:
        if tm.ref not in adapted or tm.ref.expert is not None:
            continue
        a_ref, b_ref = adapter_refs(tm.ref)
        read = reader.read([a_ref, b_ref])
        lora_a, lora_b = read[a_ref], read[b_ref]
        for name, blocks in hf_row_sources(tm, source.shape, lora_b.shape[0]).items():
            module = name.removesuffix(".weight")
            target = ".".join(module.split(".")[-2:])  # with its parent: mlp.gate_proj, not shared_experts'
            if source.shape.num_experts and target.rsplit(".", 1)[1] in MOE_RENAMED_LINEARS:
                by_parameter.add(f"{target}.weight")
            else:
                targets.add(target)
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = lora_a.clone()  # safetensors stores no shared memory
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.cat([lora_b[first:first + rows]
                                                                         for first, rows in blocks]).contiguous()
    saved = saved_module_tensors(reader, maps, source.shape, settings.get("modules_to_save") or [])
    tensors.update({PEFT_PREFIX + name: value for name, value in saved.items()})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
              "r": int(settings["rank"]), "lora_alpha": settings["alpha"],
              # PEFT refuses dropout on a targeted parameter (it cannot drop the input of one expert's product)
              "lora_dropout": 0.0 if parameters or by_parameter else settings.get("dropout", 0.0),
              "target_modules": sorted(targets), "target_parameters": (parameters + sorted(by_parameter)) or None,
              "bias": "none",
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
            "target_parameters": config["target_parameters"] or [], "modules_to_save": config["modules_to_save"]}


MOE_RENAMED_LINEARS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
"""Linear names that PEFT 0.21 on transformers 5 reads, in a MoE model's target_modules, as the fused experts' (the
conversion of v4 adapters), whichever module they name: a dense layer's or shared expert's are written as
``target_parameters`` ("mlp.gate_proj.weight"), which PEFT adapts as the same linear (``lora.ParamWrapper``)."""
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""transformers 5's fused routed experts of a MoE layer (Qwen3-MoE, DeepSeek-V3, Mixtral: ``mlp.experts.<name>``,
[experts, out, in]), in the order PEFT nests its wrappers: the first is the innermost."""


def expert_adapter_tensors(reader, adapted, num_experts: int) -> tuple[dict, list[str]]:
    """PEFT's tensors for the routed experts' adapters, and its ``target_parameters``. PEFT adapts a fused expert
    parameter through ``target_parameters`` (``lora.ParamWrapper``): lora_A [experts x r, in], read as
    (expert, r, in), and lora_B [out, r x experts], read as (out, r, expert), expert-minor; the wrappers of one
    module nest, the inner one's tensors under ``base_layer.``. A gated fc1's B is [B_gate; B_up], as gate_up_proj."""
    import torch

    from megatron_rl.conversion.names import EXPERT_FC1, EXPERT_FC2, adapter_refs

    by_layer: dict[int, dict[str, dict[int, Any]]] = {}
    for ref in adapted:
        if ref.expert is not None:
            param = EXPERT_PARAMETERS[(EXPERT_FC1, EXPERT_FC2).index(ref.name)]
            by_layer.setdefault(ref.layer, {}).setdefault(param, {})[ref.expert] = ref
    tensors = {}
    for layer, params in sorted(by_layer.items()):
        present = [p for p in EXPERT_PARAMETERS if p in params]
        for depth, param in enumerate(present):
            refs = params[param]
            if sorted(refs) != list(range(num_experts)):
                raise ConfigError(f"--ckpt {reader.folder}: layer {layer} stores adapters for experts {sorted(refs)} "
                                  f"of {num_experts}; a checkpoint of a model.lora run holds every expert's")
            a_refs, b_refs = zip(*(adapter_refs(refs[e]) for e in range(num_experts)))
            read = reader.read([*a_refs, *b_refs])
            lora_a = torch.cat([read[ref] for ref in a_refs])
            lora_b = torch.stack([read[ref] for ref in b_refs], dim=-1)
            prefix = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts." + "base_layer." * (len(present) - 1 - depth)
            tensors[prefix + "lora_A.weight"] = lora_a.contiguous()
            tensors[prefix + "lora_B.weight"] = lora_b.reshape(lora_b.shape[0], -1).contiguous()
    return tensors, [f"mlp.experts.{p}" for p in EXPERT_PARAMETERS if any(p in params for params in by_layer.values())]


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
