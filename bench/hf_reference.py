"""The Hugging Face side of the GPU check and of bench/generation.py: the same weights in ``transformers``,
its generation and log-probs, and how ours are compared with them (tolerances per dtype).
"""

from __future__ import annotations

import statistics

import torch

FP32_LOGPROB_TOL = 1e-4
BF16_LOGPROB_MAX_TOL = 0.25
BF16_LOGPROB_MEAN_TOL = 0.02


def megatron_to_hf(model, shape, *, dtype: torch.dtype, device: torch.device):
    """A transformers model holding a copy of a TP=1, PP=1 Megatron ``GPTModel``'s weights, mapped by the
    project's converter (``megatron_rl.conversion``); no BOS/EOS ids, so ``generate`` runs every new token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.conversion.mapping import hf_tensors_from_state_dict
    from megatron_rl.conversion.names import hf_config_from_shape

    fields = {**hf_config_from_shape(shape), "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config)
    hf.to(dtype)
    weights = hf_tensors_from_state_dict(model.state_dict(), shape)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    allowed_missing = {"lm_head.weight"} if shape.tie_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise RuntimeError(f"weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    if shape.tie_embeddings and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("transformers did not tie lm_head to the embedding")
    return hf.eval()


def hf_generate(hf, prompts: torch.Tensor, new_tokens: int, eos_id: int | None = None) -> torch.Tensor:
    """Greedy ``transformers`` generate: exactly ``new_tokens`` per row, or with ``eos_id`` until each row's eos
    (the rows after it padded with 0, as ``generate`` pads finished rows)."""
    lengths = dict(min_new_tokens=new_tokens) if eos_id is None else {}
    with torch.inference_mode():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, eos_token_id=eos_id, use_cache=True, **lengths)
    return out[:, prompts.shape[1]:]


def hf_logprobs(hf, tokens: torch.Tensor) -> torch.Tensor:
    """[B, S-1] float32 log-probs of tokens[:, 1:] under the HF model (one teacher-forced forward)."""
    with torch.inference_mode():
        logits = hf(input_ids=tokens[:, :-1]).logits.float()
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


# ------------------------------------------------------------------------------------------ comparisons
def compare_logprobs(prompt_lens: list[int], responses: list[list[int]], kv_logprobs: list[list[float]],
                     reference: torch.Tensor) -> dict:
    """max / mean |KV-cache log-prob - reference| over response tokens; reference is [B, S-1] of tokens[:, 1:]."""
    ref = reference.float().cpu()
    diffs = []
    for row, (start, response, lps) in enumerate(zip(prompt_lens, responses, kv_logprobs)):
        if response:
            want = ref[row, start - 1:start - 1 + len(response)]
            diffs.append((torch.tensor(lps, dtype=torch.float32) - want).abs())
    all_diffs = torch.cat(diffs) if diffs else torch.zeros(0)
    return {"tokens": int(all_diffs.numel()),
            "max_abs_diff": float(all_diffs.max()) if all_diffs.numel() else 0.0,
            "mean_abs_diff": float(all_diffs.mean()) if all_diffs.numel() else 0.0}


def judge(stats: dict, *, dtype: str) -> dict:
    """Attach the tolerance for dtype and whether the stats meet it."""
    if dtype == "fp32":
        tol = {"max_abs": FP32_LOGPROB_TOL}
        ok = stats["max_abs_diff"] <= FP32_LOGPROB_TOL
    else:
        tol = {"max_abs": BF16_LOGPROB_MAX_TOL, "mean_abs": BF16_LOGPROB_MEAN_TOL}
        ok = stats["max_abs_diff"] <= BF16_LOGPROB_MAX_TOL and stats["mean_abs_diff"] <= BF16_LOGPROB_MEAN_TOL
    return {**stats, "tolerance": tol, "passed": bool(ok and stats["tokens"] > 0)}


def padded_sequences(prompts: list[list[int]], responses: list[list[int]], device) -> torch.Tensor:
    """prompt + response rows, right-padded with 0, as one [B, S] tensor."""
    rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Rows decoded identically, and the mean number of leading tokens that agree."""
    from megatron_rl.data.preferences import common_prefix_length

    return {"rows_equal_fraction": sum(a == b for a, b in zip(ours, theirs)) / len(ours),
            "mean_agreeing_prefix": statistics.fmean(common_prefix_length(a, b) for a, b in zip(ours, theirs))}
