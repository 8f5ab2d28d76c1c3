"""The conversion that ``launch.py convert`` checked, run in its own process (it imports torch; the launcher never
does). The launcher passes the direction and its parsed options as JSON:

    python -m megatron_rl.conversion.command hf-to-megatron '{"hf": "DIR", "out": "DIR", "tp": 2, ...}'

Bad input (not a checkpoint, missing or truncated shard, mismatched shapes, existing output without --overwrite)
is one line on stderr and exit 2; a crashed worker or a failed --verify exits 1.
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.private import private_umask


def main(argv: list[str]) -> int:
    direction, options = argv[0], json.loads(argv[1])
    args = SimpleNamespace(direction=direction, **options)
    private_umask()
    try:
        if direction == "hf-to-megatron":
            return _hf_to_megatron(args)
        return _megatron_to_hf(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except RuntimeError as exc:  # a worker crashed: one line here, the traceback is in the worker log
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _hf_to_megatron(args) -> int:
    from megatron_rl.conversion.importer import import_hf_to_megatron

    result = import_hf_to_megatron(args.hf, args.out, tp=args.tp or 1, pp=args.pp or 1, ep=args.ep or 1,
                                   dtype=args.dtype, overwrite=args.overwrite, timeout=args.timeout)
    print(f"wrote {result['step_folder']} ({result['dtype']}, built at tp={result['tp']} pp={result['pp']} "
          f"ep={result['ep']} on {result['processes']} process(es), {result['seconds']:.1f} s)")
    return 0


class VerificationFailed(Exception):
    """--verify found the two models disagreeing."""


def _lora_adapter(args) -> int:
    from megatron_rl.conversion.lora_export import export_peft_adapter

    result = export_peft_adapter(args.ckpt, args.out, base_hf=args.base_hf, overwrite=args.overwrite)
    print(f"wrote {result['out_dir']}: PEFT LoRA adapter (r={result['r']}, {result['tensors']} tensors, "
          f"target_modules {', '.join(result['target_modules']) or '-'}"
          + (f", target_parameters {', '.join(result['target_parameters'])}" if result["target_parameters"] else "")
          + (f", modules_to_save {', '.join(result['modules_to_save'])}" if result["modules_to_save"] else "")
          + f") for {args.base_hf}")
    return 0


def _megatron_to_hf(args) -> int:
    from megatron_rl.conversion.export import export_checkpoint_to_hf

    if args.lora_adapter:
        return _lora_adapter(args)

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
    from megatron_rl.runtime.manifest import record_export

    manifest = record_export(args.ckpt, summary.out_dir)  # the audit record of the run the checkpoint came from
    for note in summary.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {summary.out_dir}: {summary.architecture}, {summary.num_tensors} tensors in {summary.num_shards} "
          f"shard(s), {summary.bytes_written / 1e9:.3f} GB in {summary.seconds:.1f} s "
          f"({summary.bytes_copied_in_kernel / max(summary.bytes_written, 1):.0%} copied file to file)")
    if manifest is not None:
        print(f"recorded the export in {manifest}")
    if args.verify:
        print(json.dumps({k: report[k] for k in ("max_abs_logit_diff", "argmax_agreement", "tensors_equal")}))
    return 0


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main(sys.argv[1:]))
