"""Tiny random DeepSeek-V3 models built by transformers (no downloads), for tests/test_deepseek_v3.py.

``make_deepseek_model(kind, folder)`` builds ``DeepseekV3ForCausalLM`` from a config in ``TINY_DEEPSEEK``:
q-LoRA (or none), one shared expert, one dense first layer, 8 routed experts top-2 in 2 groups (1 per token),
sigmoid routing with a random nonzero ``e_score_correction_bias``, routed scaling 2.5; the ``yarn`` kind adds
yarn RoPE. Every tensor gets random values (norms around 1, the bias buffer included) so nothing is trivially
zero or one. ``mtp=True`` appends a fake multi-token-prediction layer (``model.layers.{num_hidden_layers}.*``)
to the safetensors file, as DeepSeek-V3 ships one, which the importer must drop with a note.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert_fixtures import randomize_weights  # noqa: E402

BASE = dict(vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
            norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
            num_nextn_predict_layers=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
TINY_DEEPSEEK = {
    "qlora": dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "yarn": dict(BASE, rope_parameters=YARN),
    "no_qlora": dict(BASE, q_lora_rank=None, rope_parameters=YARN),
}


def make_deepseek_model(kind: str, folder: Path, *, seed: int = 0, mtp: bool = False) -> Path:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**TINY_DEEPSEEK[kind])
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    randomize_weights(model)
    with torch.no_grad():  # the correction bias is a buffer: a real one changes which experts win
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    folder = Path(folder)
    model.save_pretrained(str(folder))
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    if mtp:
        path = folder / "model.safetensors"
        tensors = load_file(str(path))
        prefix = f"model.layers.{config.num_hidden_layers}."
        layer1 = {k.replace("model.layers.1.", prefix): v.clone() for k, v in tensors.items()
                  if k.startswith("model.layers.1.")}
        extra = {prefix + "enorm.weight": torch.ones(config.hidden_size), prefix + "hnorm.weight":
                 torch.ones(config.hidden_size), prefix + "eh_proj.weight": torch.zeros(64, 2 * 64)}
        save_file({**tensors, **layer1, **extra}, str(path), metadata={"format": "pt"})
    return folder


FP8_SKIP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "e_score_correction_bias")


def quantize_fp8(src: Path, dst: Path, block: tuple[int, int] = (20, 24)) -> dict:
    """``src`` (a folder from ``make_deepseek_model``) quantized the way DeepSeek-V3 ships: every linear weight
    but the embedding, head and router as F8_E4M3 plus an fp32 ``weight_scale_inv`` per ``block`` (one scale =
    amax / 448 per block; partial blocks at the edges), ``quantization_config`` in config.json. Returns what the
    import must produce: every tensor dequantized (fp8 * scale) in fp32, or unchanged when not quantized."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    tensors, out, expected = load_file(str(src / "model.safetensors")), {}, {}
    for name, weight in tensors.items():
        if weight.ndim != 2 or any(part in name for part in FP8_SKIP):
            out[name] = expected[name] = weight
            continue
        rows, cols = -(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])
        padded = torch.zeros(rows * block[0], cols * block[1])
        padded[:weight.shape[0], :weight.shape[1]] = weight
        amax = padded.reshape(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
        scale = (amax / 448.0).clamp(min=1e-12)
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:weight.shape[0], :weight.shape[1]]
        fp8 = (weight / full).to(torch.float8_e4m3fn)
        out[name], out[name + "_scale_inv"] = fp8, scale
        expected[name] = fp8.to(torch.float32) * full
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return expected
