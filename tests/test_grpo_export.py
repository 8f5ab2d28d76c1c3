"""A GRPO checkpoint trained at TP=2 exports to Hugging Face, loads in transformers and decodes like our engine."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, folder_sha256, read_manifest

pytestmark = pytest.mark.slow


def test_tp2_grpo_checkpoint_exports_and_generates_the_same_greedy_tokens(launch, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    run_dir = tmp_path / "grpo"
    result = launch(f"run.dir={run_dir}", "parallel.tp=2", "run.steps=3", "algorithm.sft_warmup_steps=10",
                    "checkpoint.export_hf=true", "logging.tensorboard=false")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    hf_dir = run_dir / "hf" / "final"
    again = launch("convert", "megatron-to-hf", "--ckpt", str(run_dir / "checkpoints"), "--out", str(tmp_path / "hf2"))
    assert again.returncode == 0 and f"recorded the export in {run_dir / 'manifest.json'}" in again.stdout, again.stderr
    final = str((run_dir / "checkpoints" / "step_00000003").resolve())
    assert [(e["path"], e["checkpoint"], e["sha256"]) for e in read_manifest(run_dir)["exports"]] == [
        (str(hf_dir.resolve()), final, folder_sha256(hf_dir)),
        (str((tmp_path / "hf2").resolve()), final, folder_sha256(tmp_path / "hf2"))]  # the run's and convert's
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert model.config.vocab_size == 128 and not model.config.tie_word_embeddings

    from megatron_rl.data.tokenizer import CharTokenizer

    tok = CharTokenizer()
    prompts = [tok.encode(p, add_bos=True) for p in ("first of 123=", "last of 907=", "first of 555=")]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ours = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
         str(REPO_ROOT / "tests/dist/greedy_from_checkpoint.py"), str(run_dir / "checkpoints"), "2", "tiny-cpu",
         json.dumps(prompts)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert ours.returncode == 0, ours.stderr[-3000:]
    our_tokens = json.loads(ours.stdout.strip().splitlines()[-1])["tokens"]
    for prompt, expected in zip(prompts, our_tokens, strict=True):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        hf_tokens = out[0, len(prompt):].tolist()
        assert hf_tokens[:len(expected)] == expected, (prompt, hf_tokens, expected)
