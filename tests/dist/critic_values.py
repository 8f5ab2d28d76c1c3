"""PPO's critic read back from its checkpoint at TP=2: per-token values and, at each row's last token, the
reward-model reading of the same head. tests/test_ppo.py compares them with the critic's HF export.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/critic_values.py --out OUT --ckpt DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dist_common import write_rank_result  # noqa: E402
from megatron_rl.spec.model_shape import load_model_shape  # noqa: E402
from megatron_rl.data.tokenizer import CharTokenizer  # noqa: E402
from megatron_rl.models.builder import ModelOptions  # noqa: E402
from megatron_rl.models.reward_model import (  # noqa: E402
    build_reward_model_chunks,
    load_reward_model_weights,
    right_padded_batch,
    value_forward,
)
from megatron_rl.runtime.distributed import current_dims, initialize, job_dims, shutdown  # noqa: E402

TEXTS = ["last of 387=7", "last of 12=2", "last of 905=3x"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    initialize(job_dims(tp=2), seed=1)
    chunks = build_reward_model_chunks(load_model_shape("tiny-cpu"), ModelOptions(dims=current_dims()))
    head_loaded = load_reward_model_weights(args.ckpt, chunks)
    model = chunks[0].eval()
    tok = CharTokenizer()
    seqs = [tok.encode(text, add_bos=True) for text in TEXTS]
    batch = right_padded_batch(seqs, pad_id=tok.pad_id, length=max(map(len, seqs)))
    with torch.no_grad():
        values = value_forward(model, batch)
        rewards = model(batch["tokens"], batch["position_ids"], None, last_index=batch["last_index"])
    write_rank_result(args.out, {"head_loaded": head_loaded, "tokens": batch["tokens"].tolist(),
                                 "lengths": [len(s) for s in seqs], "values": values.tolist(),
                                 "rewards": rewards.tolist()})
    shutdown()


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
