"""Pipelined decode (the rows in pp parts decoding on their own, successive steps overlapping across the stages)
against the stages in turn, at PP=2 on 2 CPU ranks.

    .venv/bin/python bench/pipeline_decode.py            # small bench model (hidden 256, 4 layers), 64 rows
    .venv/bin/python bench/pipeline_decode.py --model tiny-cpu --rows 64 --new-tokens 32

Starts itself on 2 local gloo ranks (torch.distributed.run). Each rank holds one pipeline stage of the same
weights; ``generate`` runs greedy decoding of the same prompts with ``pipeline_microbatches=1`` (every step runs
stage 0 then stage 1 on all rows while the other stage idles) and with 2 (the default: while stage 1 finishes
part 0's step t, stage 0 runs part 1's step t, then part 0's step t + 1; megatron_rl/generation/engine.py ``_run_pipelined``),
alternately, ``--repeats`` rounds. Both give the same tokens (asserted). The last line is one JSON object;
``speedup`` = stages-in-turn seconds / pipelined seconds (medians). On a GPU cluster the stages are separate
GPUs; here they are 2 processes sharing the machine's 2 cores, and a forward of half the rows costs nearly what
one of all rows costs (per-op overhead), so the gain here is well below the 2x of compute-bound stages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(args) -> None:
    import torch

    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.runtime.distributed import initialize, job_dims, shutdown
    from megatron_rl.trainers.common import job_engine

    torch.set_num_threads(1)
    cfg = load_config(overrides=[f"model.name={args.model}", "parallel.pp=2", "algorithm.name=pretrain",
                                 "algorithm.global_batch_size=2", "parallel.micro_batch_size=1", "run.seed=3"])
    initialize(job_dims(pp=2), seed=3)
    shape = load_model_shape(args.model)
    engine = job_engine(cfg, shape, total_steps=1)
    prompts = torch.randint(3, shape.vocab_size, (args.rows, 8), generator=torch.Generator().manual_seed(0)).tolist()

    def run(parts):
        config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=args.new_tokens, temperature=0.0,
                              pipeline_microbatches=parts)
        return generate(engine.chunks, prompts, config)

    assert run(1).tokens == run(2).tokens
    times = {"stages_in_turn": [], "pipelined": []}
    for _ in range(args.repeats):
        for name, parts in (("stages_in_turn", 1), ("pipelined", 2)):
            torch.distributed.barrier()
            started = time.perf_counter()
            run(parts)
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - started)
    if torch.distributed.get_rank() == 0:
        medians = {name: statistics.median(values) for name, values in times.items()}
        Path(args.out).write_text(json.dumps({
            "model": args.model, "rows": args.rows, "new_tokens": args.new_tokens, "pp": 2,
            **{f"{name}_s_median": value for name, value in medians.items()},
            **{f"{name}_s_all": values for name, values in times.items()},
            "speedup": medians["stages_in_turn"] / medians["pipelined"]}))
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="small (bench/grpo_step.py's) or a preset name")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from megatron_rl.spec.ports import free_port

    with tempfile.TemporaryDirectory(prefix="pipeline_decode_") as tmp:
        model = args.model
        if model == "small":
            from generation import small_shape_file

            model = str(small_shape_file(Path(tmp)))
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), __file__, "--worker", "--model", model, "--rows", str(args.rows),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
        subprocess.run(cmd, check=True, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    result["model"] = args.model
    print(f"PP2 decode, {args.rows} rows x {args.new_tokens} tokens: stages in turn "
          f"{result['stages_in_turn_s_median']:.3f} s, pipelined {result['pipelined_s_median']:.3f} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
