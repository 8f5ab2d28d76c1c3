"""Peak memory and time of ``convert hf-to-megatron`` on a several-GB MoE checkpoint, against a plain copy.

Run: ``.venv/bin/python bench/convert_import.py [--workdir DIR] [--tp 2 --ep 2] [--layers 6 --experts 32]``

1. writes a random Qwen3-MoE-shaped HF model (bf16, transformers' config names; default hidden 2048, 6 layers of
   32 experts (moe_intermediate 768), GQA 16/4 with head_dim 128, untied vocab 151936: 3.2 GB) whose largest
   tensors, the embedding and the LM head (622 MB each), are 200x an expert matrix;
2. times ``cp -r`` of the HF folder + ``sync`` (the reference: the same bytes read and written once), then
   ``python launch.py convert hf-to-megatron --tp 2 --ep 2`` as a subprocess (it fsyncs every file it writes);
   the page cache is dropped before each when ``--drop-caches`` is given and root may write
   /proc/sys/vm/drop_caches;
3. samples, every 20 ms, the resident memory of the import's whole process tree (launcher, torchrun, every
   worker and whatever they fork): the sum of their RSS at one instant, and of their PSS (shared pages split
   between the processes sharing them, so forked copies count once), and keeps the peaks; the sum of each
   process's own peak (VmHWM) is reported too, an upper bound the sampling cannot miss;
4. imports a tiny model of the same family at the same layout the same way: its peak and wall time are the
   fixed cost of the processes (interpreters, torch, Megatron, planning), reported separately as
   ``overhead_rss_bytes`` and ``overhead_s``;
5. removes every file it wrote.
The last line is one JSON object: bytes, seconds, ``speedup`` = copy_s / import_s, ``peak_rss_bytes``,
``largest_tensor_bytes``, ``peak_rss_over_largest_tensor`` (the whole tree's peak over the largest tensor) and
``peak_rss_above_overhead_over_largest_tensor`` (the same after subtracting the fixed cost).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PAGE = os.sysconf("SC_PAGE_SIZE")


def drop_caches(enabled: bool) -> bool:
    os.sync()
    if not enabled:
        return False
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def qwen3_moe_config(*, hidden: int, layers: int, experts: int, moe_ffn: int, heads: int, kv_heads: int,
                     head_dim: int, vocab: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
            "intermediate_size": 4 * moe_ffn, "moe_intermediate_size": moe_ffn, "num_experts": experts,
            "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def write_random_hf(folder: Path, config: dict) -> dict[str, int]:
    """A random bf16 model of ``config`` (2 GB shards); returns each tensor's bytes."""
    import torch

    from megatron_rl.spec.model_shape import shape_from_hf_config
    from megatron_rl.conversion.names import expected_hf_tensors
    from megatron_rl.conversion.safetensors_io import PlannedTensor, ShardedSafetensorsWriter, plan_shards

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = expected_hf_tensors(shape_from_hf_config(config, name="bench", source="bench"))
    planned = [PlannedTensor(n, "BF16", s) for n, s in tensors.items()]
    writer = ShardedSafetensorsWriter(folder, plan_shards([[t] for t in planned], 2 * 10**9))
    generator = torch.Generator().manual_seed(0)
    for name, shape in tensors.items():
        writer.write(name, torch.randn(shape, generator=generator, dtype=torch.bfloat16) * 0.02)
    writer.close()
    return {t.name: t.nbytes for t in planned}


def _tree(root: int) -> list[int]:
    """``root`` and all its descendants (from /proc/PID/task/TID/children)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return pids


def _kib_field(text: str, name: str) -> int:
    return next((int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith(name)), 0)


class TreeMemory(threading.Thread):
    """Samples the summed RSS and PSS of a process tree; keeps the peak sums and each process's VmHWM."""

    def __init__(self, root: int, interval: float = 0.02):
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peak_rss, self.peak_pss, self.process_peaks, self.done = 0, 0, {}, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            rss = pss = 0
            for pid in _tree(self.root):
                try:
                    rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
                    pss += _kib_field(Path(f"/proc/{pid}/smaps_rollup").read_text(), "Pss:")
                    hwm = _kib_field(Path(f"/proc/{pid}/status").read_text(), "VmHWM:")
                except (OSError, IndexError, ValueError):
                    continue
                self.process_peaks[pid] = max(self.process_peaks.get(pid, 0), hwm)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            time.sleep(self.interval)


def run_import(hf: Path, out: Path, tp: int, ep: int) -> dict:
    cmd = [sys.executable, str(REPO / "launch.py"), "convert", "hf-to-megatron", "--hf", str(hf), "--out",
           str(out), "--tp", str(tp), "--ep", str(ep)]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
        memory = TreeMemory(proc.pid)
        memory.start()
        proc.wait()
        wall = time.perf_counter() - start
        memory.done.set()
        memory.join()
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(f"import failed: {log.read().strip()[-2000:]}")
    return {"wall_s": wall, "peak_rss_bytes": memory.peak_rss, "peak_pss_bytes": memory.peak_pss,
            "sum_of_process_peaks_bytes": sum(memory.process_peaks.values()),
            "processes": len(memory.process_peaks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where the big files go (default: a temp folder in /tmp)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--moe-ffn", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache before each timed run")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-convert-import-", dir=args.workdir))
    try:
        big = qwen3_moe_config(hidden=args.hidden, layers=args.layers, experts=args.experts, moe_ffn=args.moe_ffn,
                               heads=args.hidden // 128, kv_heads=max(args.tp, args.hidden // 512), head_dim=128,
                               vocab=args.vocab)
        tiny = qwen3_moe_config(hidden=128, layers=2, experts=4, moe_ffn=64, heads=4, kv_heads=2, head_dim=32,
                                vocab=1024)
        sizes = write_random_hf(work / "hf", big)
        write_random_hf(work / "hf_tiny", tiny)
        hf_bytes = sum(p.stat().st_size for p in (work / "hf").glob("*.safetensors"))

        dropped = drop_caches(args.drop_caches)
        start = time.perf_counter()
        subprocess.run(["cp", "-r", str(work / "hf"), str(work / "copy")], check=True)
        os.sync()
        copy_s = time.perf_counter() - start
        shutil.rmtree(work / "copy")

        drop_caches(args.drop_caches)
        imported = run_import(work / "hf", work / "ckpt", args.tp, args.ep)
        ckpt_bytes = sum(p.stat().st_size for p in (work / "ckpt").rglob("*") if p.is_file())
        overhead = run_import(work / "hf_tiny", work / "ckpt_tiny", args.tp, args.ep)
        largest = max(sizes.values())
        result = {
            "hf_bytes": hf_bytes, "checkpoint_bytes": ckpt_bytes, "tp": args.tp, "ep": args.ep,
            "largest_tensor": max(sizes, key=sizes.get), "largest_tensor_bytes": largest,
            "copy_s": round(copy_s, 3), "import_s": round(imported["wall_s"], 3),
            "copy_GBps": round(hf_bytes / copy_s / 1e9, 3),
            "import_GBps": round(hf_bytes / imported["wall_s"] / 1e9, 3),
            "overhead_s": round(overhead["wall_s"], 3), "speedup": round(copy_s / imported["wall_s"], 3),
            "peak_rss_bytes": imported["peak_rss_bytes"], "peak_pss_bytes": imported["peak_pss_bytes"],
            "sum_of_process_peaks_bytes": imported["sum_of_process_peaks_bytes"],
            "processes": imported["processes"],
            "overhead_rss_bytes": overhead["peak_rss_bytes"], "overhead_pss_bytes": overhead["peak_pss_bytes"],
            "peak_rss_over_largest_tensor": round(imported["peak_rss_bytes"] / largest, 3),
            "peak_rss_above_overhead_over_largest_tensor":
                round((imported["peak_rss_bytes"] - overhead["peak_rss_bytes"]) / largest, 3),
            "peak_pss_over_largest_tensor": round(imported["peak_pss_bytes"] / largest, 3),
            "caches_dropped": dropped,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
