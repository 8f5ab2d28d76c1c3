"""What router replay does to the importance ratio: generation log-probs against the training forward's, for the
same MoE weights in bf16, with free routing and with the recorded routes replayed.

    .venv/bin/python bench/router_replay.py            # CPU, bf16, a 4-layer 32-expert top-4 MoE, ~1 min
    .venv/bin/python bench/router_replay.py --dtype fp32

Generation (KV cache, one token per decode step) and the training forward (whole sequences) round the bf16 GEMMs
differently, so some tokens reach another expert in training than when they were sampled; their log-prob ratio
then carries the routing flip. The check takes one rollout, then two forwards of it through the GRPO trainer's
own path (``collate_rollout``, ``forward_logprobs``): without ``routes`` (free routing) and with them (replay).
It reports, over the response tokens, the spread of ``log(pi_train / pi_generate)``: standard deviation, largest
magnitude, and the fraction of tokens whose ratio leaves PPO's [0.8, 1.2] clip range; and the fraction of
(token, layer) routes that differ between generation and the free training forward.

This is a numerics measurement, not a timing: the last line is one JSON object with the two spreads (no
speedup). ``bench/gpu_check.py`` runs the same function on the GPU (Transformer Engine layers when installed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    import launcher  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO_ROOT))

import torch

BENCH_MOE = {
    "name": "bench-moe-32x4", "family": "qwen3_moe", "hf_architecture": "Qwen3MoeForCausalLM", "num_layers": 4,
    "hidden_size": 128, "ffn_hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 2,
    "kv_channels": 32, "vocab_size": 256, "seq_length": 128, "max_position_embeddings": 256,
    "gated_linear_unit": True, "normalization": "RMSNorm", "norm_epsilon": 1.0e-6,
    "position_embedding_type": "rope", "rotary_base": 1000000.0, "qk_layernorm": True, "tie_embeddings": False,
    "num_experts": 32, "moe_router_topk": 4, "moe_ffn_hidden_size": 64, "moe_norm_topk_prob": True}


def ratio_spread(engine, shape, *, prompts: int, prompt_len: int, new_tokens: int, seed: int = 3) -> dict:
    """Log-ratio statistics of one sampled rollout, free routing against replayed routing (see the docstring)."""
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.rollout.batch import RolloutRow, collate_rollout
    from megatron_rl.runtime.training import forward_logprobs

    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, shape.vocab_size, (prompts, prompt_len), generator=gen).tolist()
    config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=new_tokens, temperature=1.0, record_routes=True)
    out = generate(engine.chunks, prompt_ids, config, seed=seed)
    rows = [RolloutRow(prompt_ids=p, response_ids=t, logprobs=lp, advantage=0.0, routes=r)
            for p, t, lp, r in zip(prompt_ids, out.tokens, out.logprobs, out.routes)]
    seq_length = max(len(p) + len(t) for p, t in zip(prompt_ids, out.tokens)) - 1
    replayed = collate_rollout(rows, seq_length=seq_length, pad_id=0)
    free = {key: value for key, value in replayed.items() if key != "routes"}
    mask = replayed["loss_mask"].bool()
    generated = replayed["behav_logp"][mask]
    result = {"tokens": int(mask.sum())}
    free_maps = _free_routing_maps(engine, free, seq_length)
    recorded = replayed["routes"].cpu().long()
    known = recorded[..., 0] >= 0
    recorded_maps = torch.zeros_like(free_maps).scatter_(-1, recorded.clamp(min=0), True)
    same = (recorded_maps == free_maps).all(dim=-1)
    result["route_flip_fraction"] = float((~same & known).sum() / known.sum())
    for name, batch in (("free_routing", free), ("router_replay", replayed)):
        logp = forward_logprobs(engine.chunks, [batch], seq_length=seq_length)[0]
        log_ratio = (logp.float().cpu()[mask.cpu()] - generated.float().cpu())
        result[name] = {"log_ratio_std": float(log_ratio.std()), "log_ratio_max_abs": float(log_ratio.abs().max()),
                        "outside_clip_fraction": float(((log_ratio.exp() - 1).abs() > 0.2).float().mean())}
    return result


def _free_routing_maps(engine, batch: dict, seq_length: int) -> torch.Tensor:
    """[b, s, slots, experts] bool: the experts each token went to in a free-routing training forward, as the
    routers returned them (forward hooks)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl.models import unwrap
    from megatron_rl.runtime.training import forward_logprobs

    b = batch["tokens"].size(0)
    maps: dict[int, torch.Tensor] = {}
    handles = []
    for chunk in engine.chunks:
        for module in unwrap(chunk).modules():
            if isinstance(module, TopKRouter):
                def keep(router, args, output):
                    maps[router.router_replay.slot] = output[1].detach().view(seq_length, b, -1).transpose(0, 1).cpu()
                handles.append(module.register_forward_hook(keep))
    try:
        forward_logprobs(engine.chunks, [batch], seq_length=seq_length)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([maps[slot] for slot in sorted(maps)], dim=2)


def build(shape_yaml: str, dtype: str, run_dir: str):
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.trainers.common import job_engine

    cfg = load_config(None, [f"model.name={shape_yaml}", f"model.dtype={dtype}", "algorithm.router_replay=true",
                             "algorithm.kl_coef=0", "parallel.micro_batch_size=1", "algorithm.global_batch_size=1",
                             f"run.dir={run_dir}"])
    shape = load_model_shape(shape_yaml)
    return job_engine(cfg, shape, total_steps=1), shape


def main() -> None:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from megatron_rl.spec.ports import free_port
    from megatron_rl.runtime.distributed import initialize, job_dims, shutdown

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    with tempfile.TemporaryDirectory(prefix="router_replay_") as tmp:
        shape_yaml = Path(tmp) / "bench-moe.yaml"
        shape_yaml.write_text(yaml.safe_dump(BENCH_MOE))
        initialize(job_dims(), seed=7)
        try:
            engine, shape = build(str(shape_yaml), args.dtype, tmp)
            result = {"model": f"{shape.name}, {args.dtype}", "device": "cuda" if torch.cuda.is_available() else "cpu",
                      **ratio_spread(engine, shape, prompts=args.prompts, prompt_len=8, new_tokens=args.new_tokens)}
        finally:
            shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
