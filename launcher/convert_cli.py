"""``python launch.py convert``: Hugging Face <-> Megatron checkpoint conversion (torch is only imported when called).

    python launch.py convert hf-to-megatron --hf HF_DIR --out CKPT_DIR [--tp 2 --pp 2 --ep 1] [--dtype bf16]
    python launch.py convert megatron-to-hf --ckpt CKPT_DIR --out HF_DIR [--shard-size 2GB] [--verify]

Bad input (not a checkpoint, unsupported architecture, missing or truncated shard, mismatched shapes, existing
output without --overwrite) exits 2 with one line; an export whose --verify fails exits 1 and publishes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from launcher.errors import ConfigError

EPILOG = """\
examples:
  python launch.py convert hf-to-megatron --hf ~/models/Qwen3-8B --out ckpts/qwen3-8b --tp 2 --pp 2
  python launch.py convert megatron-to-hf --ckpt runs/grpo/checkpoints --out exports/grpo-final --verify
  python launch.py convert megatron-to-hf --ckpt runs/x/checkpoints/step_00000100 --out hf --model tiny-cpu

Supported: LlamaForCausalLM (tied or untied; also Mistral without sliding window), Qwen2ForCausalLM,
Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM; reward-model checkpoints (a hidden->1 rm_head)
export as *ForSequenceClassification with score.weight.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ConfigError(f"convert: {message} (see python launch.py convert --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="launch.py convert", description="Convert checkpoints between Hugging Face folders "
                     "and megatron_rl (Megatron Core dist_checkpointing) checkpoints.", epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", metavar="{hf-to-megatron,megatron-to-hf}")
    sub.required = True
    imp = sub.add_parser("hf-to-megatron", help="HF folder -> our checkpoint (loadable at any layout)")
    imp.add_argument("--hf", required=True, metavar="DIR", help="HF model folder (config.json + *.safetensors)")
    imp.add_argument("--out", required=True, metavar="DIR", help="checkpoint root to create (step_00000000 + latest)")
    imp.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="stored dtype (default: the HF weights')")
    exp = sub.add_parser("megatron-to-hf", help="our checkpoint (any layout) -> HF folder")
    exp.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint root (uses latest) or a step_* folder")
    exp.add_argument("--out", required=True, metavar="DIR", help="HF folder to create")
    exp.add_argument("--model", metavar="SPEC", help="model description when the checkpoint records none: HF "
                     "folder or config.json, preset name or model YAML")
    exp.add_argument("--hf-source", metavar="DIR", help="copy tokenizer files from this folder")
    exp.add_argument("--shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    exp.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="written dtype (default: as stored)")
    exp.add_argument("--verify", action="store_true", help="run both models on the same tokens, print one JSON "
                     "line and publish only if logits agree within --tolerance")
    exp.add_argument("--tolerance", type=float, default=1e-3, help="largest allowed |logit difference| (fp32)")
    for p, what in ((imp, "build the model at this layout (processes: pp * lcm(tp, ep))"),
                    (exp, "layout of the Megatron side of --verify (default: the layout that saved it)")):
        p.add_argument("--tp", type=int, default=None, help=f"tensor parallel size; {what}")
        p.add_argument("--pp", type=int, default=None, help="pipeline parallel size")
        p.add_argument("--ep", type=int, default=None, help="expert parallel size")
        p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
        p.add_argument("--timeout", type=float, default=None, help="seconds before the worker processes are killed")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.direction == "hf-to-megatron":
            return _hf_to_megatron(args)
        return _megatron_to_hf(args)
    except RuntimeError as exc:  # a worker crashed: one line here, the traceback is in the worker log
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _hf_to_megatron(args) -> int:
    from megatron_rl.conversion.importer import import_hf_to_megatron

    result = import_hf_to_megatron(args.hf, args.out, tp=args.tp or 1, pp=args.pp or 1, ep=args.ep or 1,
                                   dtype=args.dtype, overwrite=args.overwrite, timeout=args.timeout)
    print(f"wrote {result['step_folder']} ({result['dtype']}, built at tp={result['tp']} pp={result['pp']} "
          f"ep={result['ep']} on {result['processes']} process(es), {result['seconds']:.1f} s)")
    return 0


class VerificationFailed(Exception):
    """--verify found the two models disagreeing."""


def _megatron_to_hf(args) -> int:
    from megatron_rl.conversion.export import export_checkpoint_to_hf

    report: dict = {}

    def check(folder) -> None:
        from megatron_rl.conversion.verify import verify_export

        report.update(verify_export(args.ckpt, folder, tp=args.tp, pp=args.pp, ep=args.ep, model=args.model,
                                    tolerance=args.tolerance, timeout=args.timeout))
        if not report["ok"]:
            raise VerificationFailed()

    last = [time.monotonic()]

    def progress(message: str) -> None:  # big exports: a line every 10 s on stderr (Slurm logs)
        if time.monotonic() - last[0] >= 10:
            last[0] = time.monotonic()
            print(message, file=sys.stderr, flush=True)

    try:
        summary = export_checkpoint_to_hf(args.ckpt, args.out, model=args.model, hf_source=args.hf_source,
                                          shard_size=args.shard_size, dtype=args.dtype, overwrite=args.overwrite,
                                          check=check if args.verify else None, progress=progress)
    except VerificationFailed:
        print(json.dumps({k: report[k] for k in ("max_abs_logit_diff", "argmax_agreement", "tensors_equal")}))
        print(f"error: verification failed ({report['detail']['tensors']}; tolerance {args.tolerance}); "
              f"{args.out} was not written", file=sys.stderr)
        return 1
    for note in summary.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {summary.out_dir}: {summary.architecture}, {summary.num_tensors} tensors in {summary.num_shards} "
          f"shard(s), {summary.bytes_written / 1e9:.3f} GB in {summary.seconds:.1f} s "
          f"({summary.bytes_copied_in_kernel / max(summary.bytes_written, 1):.0%} copied file to file)")
    if args.verify:
        print(json.dumps({k: report[k] for k in ("max_abs_logit_diff", "argmax_agreement", "tensors_equal")}))
    return 0


if __name__ == "__main__":
    from launcher.cli import main as launch_main

    sys.exit(launch_main(["convert", *sys.argv[1:]]))
