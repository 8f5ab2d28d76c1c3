"""Greedy tokens of our engine from one of our checkpoints (run under torchrun; rank 0 prints one JSON line).

    python -m torch.distributed.run --nproc-per-node 2 tests/dist/greedy_from_checkpoint.py CKPT TP MODEL PROMPTS_JSON
"""

import json
import sys

if __name__ == "__main__":
    import torch

    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.models.builder import ModelOptions, build_model_chunks
    from megatron_rl.runtime import checkpoint as ckpt
    from megatron_rl.runtime.distributed import current_dims, initialize, job_dims, shutdown

    path, tp, model, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    initialize(job_dims(tp=tp), seed=0)
    shape = load_model_shape(model)
    chunks = build_model_chunks(shape, ModelOptions(dims=current_dims()))
    ckpt.load_checkpoint(path, chunks=chunks, load_optimizer=False)
    out = generate(chunks, prompts, EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=8, temperature=0.0))
    if torch.distributed.get_rank() == 0:
        print(json.dumps({"tokens": out.tokens}), flush=True)
    # leave together and tear the group down: a rank that exits while the other still prints can leave gloo's
    # threads to a destructor that aborts ("terminate called without an active exception", seen once in CI)
    torch.distributed.barrier()
    shutdown()
