"""Host reads per decode step of the paged engine on real Megatron models of 2 and 8 layers (one process, gloo).

Each model (the tiny-cpu preset with its layer count changed) decodes 5 prompts (a GRPO group of 3 sharing its
prompt, and two others) 12 tokens each, sampled with top-p, in blocks of 4 tokens so that rows take blocks as they
grow; every engine step is run under ``host_syncs`` and each decode-only step's count is kept. Writes
``OUT/rank0.json``: ``{layers: [reads per decode step]}`` and the reads of one step by name.

Run: ``.venv/bin/python tests/dist/engine_syncs.py --out DIR`` (tests/test_paged_engine.py runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from megatron_rl.runtime.probes import host_syncs


def decode_step_reads(layers: int) -> tuple[list, list]:
    from megatron_rl.generation.config import EngineConfig
    from megatron_rl.generation.engine import Engine
    from megatron_rl.generation.layout import Lockstep
    from megatron_rl.generation.pipeline import StageChain
    from megatron_rl.models.builder import build_model_chunks
    from megatron_rl.trainers.common import job_model_options
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape

    cfg = load_config(overrides=["model.name=tiny-cpu"])
    shape = dataclasses.replace(load_model_shape("tiny-cpu"), num_layers=layers)
    chunks = build_model_chunks(shape, job_model_options(cfg, shape))
    config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=12, top_p=0.9, kv_block_tokens=4)
    engine = Engine(config, chunks, chain=StageChain(chunks, device=torch.device("cpu")), lockstep=Lockstep(chunks),
                    seed=3)
    engine.add([[5, 6, 7, 8, 9]] * 3 + [[4, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1]])
    per_step, names, step = [], [], engine.step

    def counted() -> bool:
        with host_syncs() as reads:
            more = step()
        if more and engine.parts[0].runner.context.is_decode_only():
            per_step.append(len(reads))
            names[:] = reads
        return more

    engine.step = counted
    rows, _ = engine.run()
    if any(len(row.response) != 12 for row in rows):
        raise AssertionError(f"responses of {[len(row.response) for row in rows]} tokens, not 12 each")
    return per_step, names


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    from megatron_rl.runtime.distributed import initialize, job_dims, shutdown

    initialize(job_dims(), seed=3)
    result = {}
    for layers in (2, 8):
        result[str(layers)], result[f"names{layers}"] = decode_step_reads(layers)
    (out / "rank0.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    main()
