"""``python launch.py convert``: Hugging Face <-> Megatron checkpoint conversion, here or as a Slurm job.

    python launch.py convert hf-to-megatron --hf HF_DIR --out CKPT_DIR [--tp 2 --pp 2 --ep 1] [--dtype bf16]
    python launch.py convert megatron-to-hf --ckpt CKPT_DIR --out HF_DIR [--shard-size 2GB] [--verify]
    python launch.py convert megatron-to-hf --ckpt LORA_CKPT --out ADAPTER_DIR --lora-adapter --base-hf HF_DIR
    python launch.py convert ... --slurm [--dry-run] [--wait] [cluster.key=value ...] [run.dir=DIR]

Bad input (not a checkpoint, unsupported architecture, missing or truncated shard, mismatched shapes, existing
output without --overwrite) exits 2 with one line; an export whose --verify fails exits 1 and publishes nothing.
The launcher checks the arguments and runs the conversion as a child process (``python -m
megatron_rl.conversion.command``, the job side: it imports torch), so the launcher never does. With --slurm it runs instead as a one-task
Slurm job (a >100B model needs a compute node's memory and cores): --dry-run prints the sbatch script, --wait
follows the job, and the logs go to run.dir/slurm (default runs/convert).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from launcher.cli import CliParser
from megatron_rl.spec.errors import ConfigError

EPILOG = """\
examples:
  python launch.py convert hf-to-megatron --hf ~/models/Qwen3-8B --out ckpts/qwen3-8b --tp 2 --pp 2
  python launch.py convert megatron-to-hf --ckpt runs/grpo/checkpoints --out exports/grpo-final --verify
  python launch.py convert megatron-to-hf --ckpt runs/x/checkpoints/step_00000100 --out hf --model tiny-cpu
  python launch.py convert hf-to-megatron --hf /models/Llama-3.1-405B --out /ckpt/405b --tp 8 --pp 8 \\
      --slurm cluster.partition=cpu cluster.mem=0 cluster.time=1-00:00:00 --wait

Supported: LlamaForCausalLM (tied or untied; also Mistral without sliding window), Qwen2ForCausalLM,
Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi-K2:
MLA, shared experts, sigmoid routing with its expert bias, yarn RoPE; official FP8 block-quantized weights are
dequantized to bf16 at import; multi-token-prediction layers are dropped, with a note); reward-model
checkpoints (a hidden->1 rm_head) export as *ForSequenceClassification with score.weight, and a PPO critic's
(<checkpoint dir>/critic) as *ForTokenClassification with the same weights.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="launch.py convert", description="Convert checkpoints between Hugging Face folders "
                       "and megatron_rl (Megatron Core dist_checkpointing) checkpoints.", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", metavar="{hf-to-megatron,megatron-to-hf}")
    sub.required = True
    imp = sub.add_parser("hf-to-megatron", help="HF folder -> our checkpoint (loadable at any layout)")
    exp = sub.add_parser("megatron-to-hf", help="our checkpoint (any layout) -> HF folder")
    for p, options in ((imp, _import_options(imp)), (exp, _export_options(exp))):
        p.set_defaults(conversion_options=options)
        _add_slurm_options(p)
    return parser


def _import_options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        p.add_argument("--hf", required=True, metavar="DIR", help="HF model folder (config.json + *.safetensors)"),
        p.add_argument("--out", required=True, metavar="DIR", help="checkpoint root to create (step_00000000 + "
                       "latest)"),
        p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="stored dtype (default: the HF weights')"),
        *_layout_options(p, "build the model at this layout (processes: pp * lcm(tp, ep))"),
    ]


def _export_options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        p.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint root (uses latest) or a step_* "
                       "folder"),
        p.add_argument("--out", required=True, metavar="DIR", help="HF folder to create"),
        p.add_argument("--model", metavar="SPEC", help="model description when the checkpoint records none: HF "
                       "folder or config.json, preset name or model YAML"),
        p.add_argument("--hf-source", metavar="DIR", help="copy tokenizer files from this folder"),
        p.add_argument("--shard-size", default="2GB", help="largest safetensors file (default 2GB)"),
        p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="written dtype (default: as stored)"),
        p.add_argument("--verify", action="store_true", help="run both models on the same tokens, print one JSON "
                       "line and publish only if logits agree within --tolerance"),
        p.add_argument("--tolerance", type=float, default=1e-3, help="largest allowed |logit difference| (fp32)"),
        p.add_argument("--lora-adapter", action="store_true", help="a LoRA checkpoint's adapters alone, as a PEFT "
                       "folder (adapter_config.json, adapter_model.safetensors) for --base-hf; default: the merged "
                       "model"),
        p.add_argument("--base-hf", metavar="DIR", help="with --lora-adapter: the HF folder of the base model the "
                       "run started from (recorded as base_model_name_or_path)"),
        *_layout_options(p, "layout of the Megatron side of --verify (default: the layout that saved it)"),
    ]


def _layout_options(p: argparse.ArgumentParser, what: str) -> list[argparse.Action]:
    return [
        p.add_argument("--tp", type=int, default=None, help=f"tensor parallel size; {what}"),
        p.add_argument("--pp", type=int, default=None, help="pipeline parallel size"),
        p.add_argument("--ep", type=int, default=None, help="expert parallel size"),
        p.add_argument("--overwrite", action="store_true", help="replace --out if it exists"),
        p.add_argument("--timeout", type=float, default=None, help="seconds before the worker processes are killed"),
    ]


def _add_slurm_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("as a Slurm job")
    group.add_argument("--slurm", action="store_true", help="submit the conversion as a one-task Slurm job "
                       "(sbatch) instead of running it here; the way to convert a >100B model")
    group.add_argument("--dry-run", action="store_true", help="with --slurm: print the sbatch script, submit nothing")
    group.add_argument("--wait", action="store_true", help="with --slurm: follow the job to its end and exit with "
                       "its status")
    group.add_argument("overrides", nargs="*", metavar="cluster.key=value", help="with --slurm: the job's "
                       "resources, e.g. cluster.partition=cpu cluster.mem=0 cluster.time=08:00:00, and run.dir=DIR "
                       "for its logs (default runs/convert)")


def conversion_argv(args: argparse.Namespace) -> list[str]:
    """The conversion's own arguments, rebuilt from the parsed ones: what a Slurm job passes on."""
    argv = [args.direction]
    for action in args.conversion_options:
        value = getattr(args, action.dest)
        if value is None or value is False or value == action.default:
            continue
        argv += [action.option_strings[0]] if value is True else [action.option_strings[0], str(value)]
    return argv


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse a missing input folder before torch is imported (a one-line ConfigError naming the flag)."""
    flags = {"hf-to-megatron": (("--hf", "hf", "an HF model folder"),),
             "megatron-to-hf": (("--ckpt", "ckpt", "a checkpoint root or a step_* folder"),
                                ("--hf-source", "hf_source", "a folder with tokenizer files"),
                                ("--base-hf", "base_hf", "the base model's HF folder"))}[args.direction]
    if args.direction == "megatron-to-hf":
        if args.lora_adapter and not args.base_hf:
            raise ConfigError("convert megatron-to-hf --lora-adapter needs --base-hf DIR, the HF folder of the base "
                              "model the adapters apply to")
        if args.base_hf and not args.lora_adapter:
            raise ConfigError("convert megatron-to-hf: --base-hf applies to --lora-adapter exports; add "
                              "--lora-adapter, or drop --base-hf for the merged model")
        if args.lora_adapter and args.verify:
            raise ConfigError("convert megatron-to-hf: --verify checks merged exports; drop it with --lora-adapter")
    for flag, dest, what in flags:
        value = getattr(args, dest)
        if value is None:
            continue
        path = Path(value).expanduser()
        if not path.exists():
            raise ConfigError(f"convert {args.direction}: {flag} {value}: no such folder; give {what}")
        if not path.is_dir():
            raise ConfigError(f"convert {args.direction}: {flag} {value} is a file, not a folder; give {what}")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.slurm:
        from launcher.slurm.executor import conversion_job, run_conversion

        cluster, run_dir = conversion_job(args.overrides)
        return run_conversion(cluster, run_dir, conversion_argv(args), dry_run=args.dry_run, wait=args.wait)
    if args.overrides:
        raise ConfigError(f"convert: unrecognized argument {args.overrides[0]!r} (cluster.* and run.dir settings "
                          "need --slurm)")
    if args.dry_run or args.wait:
        raise ConfigError(f"convert: {'--dry-run' if args.dry_run else '--wait'} applies to a Slurm job; add --slurm")
    check_inputs(args)
    options = {action.dest: getattr(args, action.dest) for action in args.conversion_options}
    command = [sys.executable, "-m", "megatron_rl.conversion.command", args.direction, json.dumps(options)]
    try:
        return subprocess.run(command, check=False).returncode
    except KeyboardInterrupt:
        return 130
