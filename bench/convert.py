"""Export throughput and peak memory of ``megatron-to-hf`` on an 8.1 GB checkpoint, against a plain copy.

Run: ``.venv/bin/python bench/convert.py [--workdir DIR] [--hidden 4096 --layers 10 --vocab 32000] [--rounds 3]``

1. writes a random Llama-shaped HF model (fp32; default hidden 4096, 10 layers, ffn 11008, GQA 32/8, untied
   vocab 32000: 8.14 GB) with the streaming safetensors writer;
2. imports it with ``convert hf-to-megatron --tp 2`` (2 processes), so the checkpoint is TP-sharded: most bytes
   are copied file to file in the kernel, the row-parallel weights (30 %) are reassembled in memory;
3. times ``--rounds`` alternating pairs, each run after dropping the page cache (when root may write
   /proc/sys/vm/drop_caches) and each ending with its data on disk: ``cp -r`` of the checkpoint's step folder +
   ``sync``, then ``python launch.py convert megatron-to-hf --ckpt <checkpoint root>`` as a subprocess (it fsyncs
   every file it wrote); the peak RSS of that process comes from wait4;
4. removes every file it wrote.
The last line is one JSON object: bytes, median seconds and GB/s of both, ``speedup`` = copy_s / export_s (whole
process to whole process, interpreter start included), ``startup_s`` = the export process's wall time minus the
time its export call reports (interpreter start and imports: the time before the first byte is read, plus
process exit), ``steady_GBps`` = exported bytes / that export time, peak RSS, the largest tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the export's own line: "wrote OUT: ARCH, N tensors in K shard(s), X GB in S s (P% copied file to file)"
SUMMARY = re.compile(r" GB in (\d+\.\d+) s \((\d+)% copied file to file\)")
sys.path.insert(0, str(REPO))


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def write_random_llama(folder: Path, *, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int,
                       vocab: int) -> int:
    import torch

    from megatron_rl.spec.model_shape import shape_from_hf_config
    from megatron_rl.conversion.names import expected_hf_tensors
    from megatron_rl.conversion.safetensors_io import PlannedTensor, ShardedSafetensorsWriter, plan_shards

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
              "torch_dtype": "float32"}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = expected_hf_tensors(shape_from_hf_config(config, name="bench", source="bench"))
    shards = plan_shards([[PlannedTensor(n, "F32", s)] for n, s in tensors.items()], 2 * 10**9)
    writer = ShardedSafetensorsWriter(folder, shards)
    generator = torch.Generator().manual_seed(0)
    for name, shape in tensors.items():
        writer.write(name, torch.randn(shape, generator=generator) * 0.02)
    writer.close()
    return writer.bytes_written


def run_export(ckpt: Path, out: Path, shard_size: str) -> dict:
    cmd = [sys.executable, str(REPO / "launch.py"), "convert", "megatron-to-hf", "--ckpt", str(ckpt), "--out",
           str(out), "--shard-size", shard_size]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # wait4: the child's own peak RSS
        wall = time.perf_counter() - start
        log.seek(0)
        text = log.read()
    summary = SUMMARY.search(text)
    if os.waitstatus_to_exitcode(status) != 0 or summary is None:
        raise SystemExit(f"export failed: {text.strip()[-2000:]}")
    return {"wall_s": wall, "export_call_s": float(summary.group(1)), "peak_rss_bytes": usage.ru_maxrss * 1024,
            "kernel_copy_percent": int(summary.group(2))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where the big files go (default: a temp folder in /tmp)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--shard-size", default="2GB")
    parser.add_argument("--rounds", type=int, default=3, help="copy/export pairs, alternated; medians reported")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    try:
        hf, ckpt, copy, out = work / "hf", work / "ckpt", work / "copy", work / "export"
        hf_bytes = write_random_llama(hf, hidden=args.hidden, layers=args.layers, ffn=args.ffn,
                                      heads=args.hidden // 128, kv_heads=max(1, args.hidden // 512), vocab=args.vocab)
        start = time.perf_counter()
        from megatron_rl.conversion import import_hf_to_megatron

        imported = import_hf_to_megatron(hf, ckpt, tp=args.tp)
        import_s = time.perf_counter() - start
        step = Path(imported["step_folder"])
        ckpt_bytes = sum(p.stat().st_size for p in step.iterdir() if p.is_file())
        shutil.rmtree(hf)

        copies, exports = [], []
        for _ in range(args.rounds):  # alternate, so that both sides see the same machine and disk load
            # each run follows the deletion of the other's output (on a filesystem mounted with discard, the
            # freed blocks are trimmed at the next commit: both sides pay for it alike)
            shutil.rmtree(out, ignore_errors=True)
            dropped = drop_caches()
            start = time.perf_counter()
            subprocess.run(["cp", "-r", str(step), str(copy)], check=True)
            os.sync()
            copies.append(time.perf_counter() - start)
            shutil.rmtree(copy)
            drop_caches()
            exports.append(run_export(ckpt, out, args.shard_size))
        exported = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        copy_s = statistics.median(copies)
        export_s = statistics.median(e["wall_s"] for e in exports)
        export_call_s = statistics.median(e["export_call_s"] for e in exports)
        from megatron_rl.conversion.dist_reader import CheckpointReader

        largest = max(t.nbytes for t in CheckpointReader(ckpt).index.values())
        result = {
            "checkpoint_bytes": ckpt_bytes, "hf_bytes": hf_bytes, "exported_bytes": exported,
            "import_tp": args.tp, "import_s": round(import_s, 2),
            "copy_s": round(copy_s, 3), "export_s": round(export_s, 3),
            "copy_GBps": round(ckpt_bytes / copy_s / 1e9, 3), "export_GBps": round(exported / export_s / 1e9, 3),
            "speedup": round(copy_s / export_s, 3),
            "startup_s": round(statistics.median(e["wall_s"] - e["export_call_s"] for e in exports), 3),
            "steady_GBps": round(exported / export_call_s / 1e9, 3),
            "copy_rounds_s": [round(c, 3) for c in copies],
            "export_rounds_s": [round(e["wall_s"], 3) for e in exports],
            "export_call_rounds_s": [e["export_call_s"] for e in exports],
            "peak_rss_bytes": max(e["peak_rss_bytes"] for e in exports), "largest_tensor_bytes": largest,
            "kernel_copy_percent": [e["kernel_copy_percent"] for e in exports],
            "shard_size": args.shard_size, "caches_dropped": dropped,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
