"""Check an export by running both models: Megatron (our checkpoint, at a chosen layout) and transformers.

    python launch.py convert megatron-to-hf --ckpt DIR --out DIR --verify [--tp N --pp N --ep N] [--tolerance X]

Both sides run on the CPU in fp32 on the same token ids (seeded, drawn from the vocabulary). Printed as one JSON
line: ``max_abs_logit_diff`` (full-vocabulary logits; for a reward model the scores, with the Megatron head's
bias taken off since HF's score layer has none), ``argmax_agreement`` (fraction of positions whose top token
agrees; for a reward model the fraction of sequence pairs ranked alike) and ``tensors_equal`` (transformers
loaded every exported tensor unchanged: no missing, unexpected or resized key, every parameter bit-equal to the
file, experts compared through transformers' fused in-memory layout). Equal tensors alone are not enough: logits
catch a wrong kernel path or config field that weights cannot show.
"""

from __future__ import annotations

import json
import random
import re
import tempfile
from pathlib import Path
from typing import Any, Optional

from megatron_rl.spec.errors import ConfigError

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")


def prompt_tokens(vocab_size: int, *, batch: int = 2, seq_len: int = 16, seed: int = 1234) -> list[list[int]]:
    """Deterministic token ids for the comparison (plain Python, same on both sides)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(seq_len)] for _ in range(batch)]


def _load_hf(hf_dir: Path, reward: bool):
    import torch
    import transformers

    auto = transformers.AutoModelForSequenceClassification if reward else transformers.AutoModelForCausalLM
    try:
        model, info = auto.from_pretrained(str(hf_dir), dtype=torch.float32, output_loading_info=True)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model, info = auto.from_pretrained(str(hf_dir), torch_dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def loaded_matches_files(model, hf_dir: Path) -> tuple[bool, str]:
    """Whether transformers' parameters equal the exported files, tensor by tensor (first difference named)."""
    import torch
    from safetensors import safe_open

    state = model.state_dict()
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                file_tensor = f.get_tensor(name).float()
                loaded = state.get(name)
                if loaded is None:
                    loaded = _from_fused(state, name, file_tensor.shape)
                if loaded is None:
                    return False, f"{name} is not in the transformers model"
                if loaded.shape != file_tensor.shape or not torch.equal(loaded.float(), file_tensor):
                    return False, f"{name} differs after loading"
    return True, ""


def _from_fused(state: dict, name: str, shape) -> Optional[Any]:
    """The slice of transformers-5's fused expert tensors (or renamed Mixtral router) that holds ``name``."""
    router = _MIXTRAL_ROUTER.match(name)
    if router:
        return state.get(f"model.layers.{router.group(1)}.mlp.gate.weight")
    match = _EXPERT.match(name)
    if not match:
        return None
    layer, expert, proj = int(match.group(1)), int(match.group(2)), match.group(3)
    prefix = f"model.layers.{layer}.mlp.experts."
    if proj in ("down_proj", "w2"):
        fused = state.get(prefix + "down_proj")
        return None if fused is None else fused[expert]
    fused = state.get(prefix + "gate_up_proj")
    if fused is None:
        return None
    rows = fused[expert]
    half = rows.shape[0] // 2
    return rows[:half] if proj in ("gate_proj", "w1") else rows[half:]


def compare_with_hf(megatron: dict, hf_dir: str | Path, tokens: list[list[int]], *, tolerance: float,
                    reward_bias: Optional[float] = None) -> dict[str, Any]:
    """Report for Megatron outputs (``logits``, or ``rewards`` for a reward model) against transformers running
    the HF folder ``hf_dir`` on the same ``tokens``. ``reward_bias`` defaults to config.json's ``reward_bias``."""
    import torch

    hf_dir = Path(hf_dir)
    reward = "rewards" in megatron
    hf_model, info = _load_hf(hf_dir, reward)
    problems = [f"{k}: {sorted(v)[:3]}" for k, v in info.items() if k != "error_msgs" and v]
    equal, why = loaded_matches_files(hf_model, hf_dir) if not problems else (False, "; ".join(problems))
    ids = torch.tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        if reward:
            if hf_model.config.pad_token_id is None:
                hf_model.config.pad_token_id = -1  # no real token: every sequence's score is read at its end
            hf_scores = hf_model(ids).logits.reshape(-1).float()
            if reward_bias is None:
                reward_bias = float(json.loads((hf_dir / "config.json").read_text()).get("reward_bias", 0.0))
            ours = megatron["rewards"].float() - reward_bias
            diff = float((hf_scores - ours).abs().max())
            pairs = [(i, j) for i in range(len(tokens)) for j in range(i + 1, len(tokens))]
            same = sum(bool((hf_scores[i] > hf_scores[j]) == (ours[i] > ours[j])) for i, j in pairs)
            agreement = same / len(pairs) if pairs else 1.0
        else:
            hf_logits = hf_model(ids).logits.float()
            ours = megatron["logits"].float()
            if hf_logits.shape != ours.shape:
                raise ConfigError(f"logit shapes differ: transformers {list(hf_logits.shape)}, Megatron "
                                  f"{list(ours.shape)}; config.json vocab_size may be wrong")
            diff = float((hf_logits - ours).abs().max())
            agreement = float((hf_logits.argmax(-1) == ours.argmax(-1)).float().mean())
    return {"max_abs_logit_diff": diff, "argmax_agreement": agreement, "tensors_equal": equal,
            "ok": bool(equal and diff <= tolerance),
            "detail": {"tolerance": tolerance, "reward_model": reward, "prompts": [len(tokens), len(tokens[0])],
                       "tensors": why or "all equal"}}


def verify_export(ckpt: str | Path, hf_dir: str | Path, *, tp: Optional[int] = None, pp: Optional[int] = None,
                  ep: Optional[int] = None, model: Optional[str] = None, tolerance: float = 1e-3,
                  batch: int = 2, seq_len: int = 16, timeout: Optional[float] = None) -> dict[str, Any]:
    """Compare the Megatron checkpoint ``ckpt`` (run at tp/pp/ep, default: the layout that saved it) with the HF
    export ``hf_dir``. Returns the JSON-able report; ``report["ok"]`` says whether it is within ``tolerance``."""
    import torch

    from megatron_rl.conversion.dist_reader import CheckpointReader
    from megatron_rl.conversion.export import resolve_model_source
    from megatron_rl.conversion.importer import check_layout
    from megatron_rl.conversion.names import layout_world_size
    from megatron_rl.conversion.spawn import run_worker

    reader = CheckpointReader(ckpt)
    common = reader.common_state()
    source = resolve_model_source(reader.folder, model, common)
    saved = common.get("layout") or {}
    tp, pp = tp or saved.get("tp", 1), pp or saved.get("pp", 1)
    ep = ep or (saved.get("ep", 1) if source.shape.is_moe else 1)
    check_layout(source.shape, tp, pp, ep)
    tokens = prompt_tokens(source.shape.vocab_size, batch=batch, seq_len=seq_len)
    with tempfile.TemporaryDirectory(prefix="verify-") as work:
        out_file = str(Path(work) / "megatron_logits.pt")
        task = {"kind": "logits", "ckpt": str(reader.folder), "model": str(model) if model else None,
                "tp": tp, "pp": pp, "ep": ep, "tokens": tokens, "out_file": out_file}
        run_worker([task], layout_world_size(tp, pp, ep), workdir=Path(work) / "worker", timeout=timeout)
        megatron = torch.load(out_file, map_location="cpu", weights_only=True)
    report = compare_with_hf(megatron, hf_dir, tokens, tolerance=tolerance)
    report["detail"]["layout"] = {"tp": tp, "pp": pp, "ep": ep}
    return report
