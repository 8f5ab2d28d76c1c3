"""The planner's GRPO KV-cache count = what colocated generation allocates (real Megatron Core, TP2, gloo, CPU).

``launcher.planner.costs.kv_cache_elements_per_token_per_layer`` against ``generate(...).kv_cache_bytes`` (the
bytes of the paged engine's block pool on one rank after a run), for the dense ``tiny-cpu`` (K and V of the rank's
query groups) and the MLA ``tiny-cpu-deepseek-v3`` (the latent, the same on every rank), at TP2.

This file is also the worker: ``torchrun --nproc-per-node 2 tests/test_kv_cache_count.py --out DIR``.
Run: ``.venv/bin/python -m pytest tests/test_kv_cache_count.py -q``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PRESETS = ("tiny-cpu", "tiny-cpu-deepseek-v3")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]
NEW_TOKENS = 4
BLOCK_TOKENS = 4
TP = 2


def test_planner_counts_the_cache_generation_allocates(tmp_path):
    from helpers import REPO_ROOT

    from megatron_rl.spec.model_shape import load_model_shape
    from launcher.planner.costs import kv_cache_elements_per_token_per_layer
    from megatron_rl.spec.ports import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(TP), "--master-port",
           str(free_port()), __file__, "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # the unbounded pool: each row's blocks at its longest
    positions = sum(-(-(len(p) + NEW_TOKENS) // BLOCK_TOKENS) * BLOCK_TOKENS for p in PROMPTS)
    for rank in range(TP):
        allocated = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for preset in PRESETS:
            shape = load_model_shape(preset)
            per_token = kv_cache_elements_per_token_per_layer(shape, TP)
            planned = positions * shape.num_layers * per_token * 4  # fp32 on CPU
            assert allocated[preset] == planned, (preset, rank, allocated[preset], planned)
    mla = load_model_shape("tiny-cpu-deepseek-v3")  # the latent: kv_lora_rank 16 + rope 8, the same at any TP
    assert kv_cache_elements_per_token_per_layer(mla, TP) == 16 + 8 == kv_cache_elements_per_token_per_layer(mla, 1)


def _worker(out: Path) -> None:
    import torch

    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.models.builder import ModelOptions, build_model_chunks
    from megatron_rl.runtime.distributed import initialize, job_dims

    dims = job_dims(tp=TP, sp=True)  # MoE at TP > 1 needs SP in training; generation switches it off
    initialize(dims, seed=3)
    result = {}
    for preset in PRESETS:
        shape = load_model_shape(preset)
        chunks = build_model_chunks(shape, ModelOptions(dims=dims, seq_length=shape.seq_length))
        config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=NEW_TOKENS, kv_block_tokens=BLOCK_TOKENS)
        out_ = generate(chunks, PROMPTS, config, seed=0)
        result[preset] = out_.kv_cache_bytes
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[sys.argv.index("--out") + 1]))
