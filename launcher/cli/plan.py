"""``python launch.py plan ...``: search or evaluate a layout and print it (table or --json).

Run: ``python launch.py plan --model llama-3.1-405b --gpus 16384 --gpu-type h100-80gb
--global-batch-size 2048 [--seq-len 8192] [--mode pretrain|grpo|rm] [--precision bf16|fp8]
[--layout tp=8,pp=16,vpp=4,cp=1,ep=1,mbs=1,recompute=selective,sp=true] [--json]``.
Exit codes: 0 plan printed (also for --layout that does not fit: it prints fits false); 2 bad input or
illegal layout; 3 nothing fits (the message names the smallest GPU count that would).
"""

from __future__ import annotations

import argparse
import json
import sys

from launcher.cli import CliParser
from launcher.errors import ConfigError

EXIT_NO_FIT = 3
DEFAULT_GLOBAL_BATCH = 1024


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the plan subcommand."""
    p = CliParser(prog="launch.py plan", description="Pick or evaluate a Megatron parallel layout.")
    p.add_argument("--model", required=True, help="preset name, HF config.json (or folder), or Megatron-style YAML")
    p.add_argument("--gpus", type=int, required=True, help="total GPU count")
    p.add_argument("--gpu-type", default="h100-80gb", help="a100-80gb | h100-80gb | h200-141gb | ...")
    p.add_argument("--seq-len", type=int, default=None, help="training sequence length (default: model's)")
    p.add_argument("--global-batch-size", type=int, default=DEFAULT_GLOBAL_BATCH,
                   help=f"sequences per optimizer step (default {DEFAULT_GLOBAL_BATCH})")
    p.add_argument("--mode", default="pretrain", choices=["pretrain", "grpo", "rm"])
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--layout", default=None, help="evaluate this (partial) layout instead of searching")
    p.add_argument("--top-k", type=int, default=5, help="alternatives to show")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the plan subcommand; returns the exit code."""
    from launcher.model_shape import load_model_shape
    from launcher.planner import NoFeasibleLayout, evaluate, plan

    try:
        args = build_parser().parse_args(argv)
        shape = load_model_shape(args.model)
        common = dict(num_gpus=args.gpus, gpu_type=args.gpu_type, seq_length=args.seq_len,
                      global_batch_size=args.global_batch_size, mode=args.mode,
                      precision=args.precision, top_k=args.top_k)
        if args.layout:
            result = evaluate(shape, args.layout, **common)
        else:
            result = plan(shape, **common)
    except NoFeasibleLayout as exc:
        print(f"error: {exc}", file=sys.stderr)
        if "--json" in (argv or sys.argv[1:]):
            print(json.dumps({"fits": False, "error": str(exc), "smallest_gpus": exc.smallest_gpus}))
        return EXIT_NO_FIT
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(result.to_json() if args.json else result.explain())
    return 0
