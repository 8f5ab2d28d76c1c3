"""Reward model: Bradley-Terry math, last-token pick, preference data, layouts (TP/PP), scorer, tiny training run.

    .venv/bin/python -m pytest tests/test_rm.py -q            # everything: ~70 s of CPU, 3.4 min wall at load ~20
    .venv/bin/python -m pytest tests/test_rm.py -q -m "not slow"   # pure functions only (seconds)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.spec.errors import ConfigError
from megatron_rl.data.preferences import (
    PreferenceRecord,
    SequenceEncoder,
    read_preference_records,
    synthetic_preference_records,
    tokenize_pairs,
)
from megatron_rl.data.tokenizer import CharTokenizer, load_tokenizer
from megatron_rl.models.reward_model import last_token_index, padded_length, pick_last_tokens, right_padded_batch
from megatron_rl.algorithms.reward_model import bradley_terry_terms, preference_loss
from megatron_rl.trainers.pairs import pair_order
from helpers import REPO_ROOT, read_metrics, run_launch


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


# ----- loss and metrics against hand computation -----

def test_bradley_terry_matches_hand_computation():
    chosen, rejected = [2.0, 0.0, 1.0, -0.5], [1.0, 0.0, 3.0, -2.0]
    margin, coef = 0.5, 0.01
    terms = bradley_terry_terms(torch.tensor(chosen), torch.tensor(rejected), margin=margin, centering_coef=coef)
    # -log sigmoid(d - m) = log(1 + exp(-(d - m)))
    expected_bt = [softplus(-(c - r - margin)) for c, r in zip(chosen, rejected)]
    expected_loss = [bt + coef * (c + r) ** 2 for bt, c, r in zip(expected_bt, chosen, rejected)]
    assert terms["bt_loss"].tolist() == pytest.approx(expected_bt, rel=1e-6)
    assert terms["loss"].tolist() == pytest.approx(expected_loss, rel=1e-6)
    assert terms["correct"].tolist() == [1.0, 0.0, 0.0, 1.0]  # the tie (0 vs 0) counts as wrong
    assert terms["margin"].tolist() == pytest.approx([1.0, 0.0, -2.0, 1.5])
    # margin 0, no centering: the textbook values ln(1 + e^-1), ln 2, ln(1 + e^2)
    plain = bradley_terry_terms(torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 3.0]))
    assert plain["loss"].tolist() == pytest.approx([0.3132617, 0.6931472, 2.1269280], rel=1e-6)


def test_bradley_terry_is_stable_for_large_gaps():
    terms = bradley_terry_terms(torch.tensor([-200.0, 200.0]), torch.tensor([0.0, 0.0]))
    assert terms["loss"].tolist() == pytest.approx([200.0, 0.0], abs=1e-6)


def test_preference_loss_sums_real_pairs_and_reports_means():
    # micro-batch of 3 pairs (the third a weight-0 filler): rewards = 3 chosen, then 3 rejected
    rewards = torch.tensor([2.0, 0.0, 9.0, 1.0, 0.0, -9.0])
    batch = {"pair_weight": torch.tensor([1.0, 1.0, 0.0])}
    loss_sum, count, reports = preference_loss(rewards, batch, margin=0.0, centering_coef=0.1)
    bt = [softplus(-1.0), math.log(2.0)]
    centering = [0.1 * 9.0, 0.0]
    assert int(count) == 2 and count.dtype == torch.int
    assert float(loss_sum) == pytest.approx(sum(bt) + sum(centering), rel=1e-6)

    def mean(name):
        total, n = reports[name]
        return float(total) / int(n)

    assert mean("accuracy") == pytest.approx(0.5)
    assert mean("bt_loss") == pytest.approx(sum(bt) / 2, rel=1e-6)
    assert mean("reward_margin") == pytest.approx(0.5)
    assert mean("reward_chosen") == pytest.approx(1.0)
    assert mean("reward_rejected") == pytest.approx(0.5)


# ----- last real token -----

def test_last_token_pick_right_and_left_padding():
    lengths = [5, 2, 7, 1]
    seq = 7
    right = torch.zeros(len(lengths), seq, dtype=torch.bool)
    left = torch.zeros_like(right)
    for row, n in enumerate(lengths):
        right[row, :n] = True
        left[row, seq - n:] = True
    assert last_token_index(right).tolist() == [4, 1, 6, 0]
    assert last_token_index(left).tolist() == [6, 6, 6, 6]
    # a hidden-state tensor [seq, batch, hidden] whose value names its (position, row)
    hidden = torch.tensor([[[10.0 * s + b] for b in range(len(lengths))] for s in range(seq)])
    assert pick_last_tokens(hidden, last_token_index(right)).squeeze(-1).tolist() == [40.0, 11.0, 62.0, 3.0]
    assert pick_last_tokens(hidden, last_token_index(left)).squeeze(-1).tolist() == [60.0, 61.0, 62.0, 63.0]
    # a mask with a hole (not a padding pattern) still gives the LAST true position
    assert last_token_index(torch.tensor([[1, 0, 1, 0]])).tolist() == [2]


def test_right_padded_batch_and_lengths():
    batch = right_padded_batch([[5, 6, 7], [8]], pad_id=0, length=4)
    assert batch["tokens"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch["last_index"].tolist() == [2, 0]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    assert padded_length(5, multiple=4) == 8
    assert padded_length(5, fixed=12, multiple=8) == 16
    with pytest.raises(ValueError):
        padded_length(9, fixed=8)


# ----- preference data -----

def test_jsonl_text_and_chat_formats(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
         "rejected": "go away"},
        {"messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"},
        {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
         "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    records = read_preference_records(path)
    assert len(records) == 4 and records[1].source == f"{path}:2"
    enc = SequenceEncoder(CharTokenizer())
    tok = CharTokenizer()
    assert enc.encode(records[0].prompt, records[0].chosen) == tok.encode("2+2=4", add_bos=True)
    # chat without a template: role-prefixed lines; a text response becomes the assistant turn
    assert tok.decode(enc.encode(records[1].prompt, records[1].rejected)) == "user: hi\nassistant: go away\n"
    assert tok.decode(enc.encode(records[2].prompt, records[2].chosen)) == "user: q\nassistant: a\n"
    assert tok.decode(enc.encode(records[3].prompt, records[3].chosen)) == "user: q\nassistant: a\n"


@pytest.mark.parametrize("line, message", [
    (b"{not json", "not valid JSON"),
    (b'["a"]', "expected a JSON object"),
    (b'{"prompt": "p", "chosen": "a"}', "no 'rejected' field"),
    (b'{"prompt": "p", "chosen": "", "rejected": "b"}', "'chosen' is an empty string"),
    (b'{"prompt": "p", "chosen": [{"role": "x"}], "rejected": "b"}', "'chosen' must be a string"),
    (b'{"prompt": "p", "messages": [], "chosen": "a", "rejected": "b"}', "not both"),
    (b"\xff\xfe", "not UTF-8"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "p", "chosen": "a", "rejected": "b"}\n\n' + line + b"\n")
    with pytest.raises(ConfigError, match=message) as err:
        read_preference_records(path)
    assert str(err.value).startswith(f"{path}:3: ")


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        read_preference_records(tmp_path / "nope.jsonl")


def test_truncate_keeps_bos_and_end_and_drop_counts():
    enc = SequenceEncoder(CharTokenizer())
    tok = CharTokenizer()
    records = [PreferenceRecord(prompt="abcdefgh", chosen="XY", rejected="Z", source="s:1"),
               PreferenceRecord(prompt="ab", chosen="c", rejected="d", source="s:2")]
    truncated = tokenize_pairs(records, enc, max_length=6, truncation="truncate", vocab_size=128, name="t")
    assert (truncated.num_read, truncated.num_truncated, truncated.num_dropped, len(truncated)) == (2, 1, 0, 2)
    assert truncated.chosen[0] == [tok.bos_id] + tok.encode("efghXY")[-5:]
    assert tok.decode(truncated.rejected[0]) == "efghZ"  # the shorter side fits: kept whole
    dropped = tokenize_pairs(records, enc, max_length=6, truncation="drop", vocab_size=128, name="t")
    assert (dropped.num_truncated, dropped.num_dropped, len(dropped)) == (0, 1, 1)
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        tokenize_pairs(records, enc, max_length=64, truncation="drop", vocab_size=50, name="t")
    with pytest.raises(ConfigError, match="every pair"):
        tokenize_pairs(records[:1], enc, max_length=3, truncation="drop", vocab_size=128, name="t")


def test_hf_tokenizer_chat_template_and_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "hi", "hello", "bye", "2+2=", "4"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 unk_token="<unk>")
    hf.chat_template = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    hf.save_pretrained(tmp_path / "tok")
    enc = SequenceEncoder(load_tokenizer(str(tmp_path / "tok")))
    assert enc.has_chat_template and enc.pad_id == 0
    ids = enc.encode([{"role": "user", "content": "hi"}], "hello")
    assert ids == [4, 6, 2, 5, 7, 2]  # the template's tokens, no extra BOS/EOS
    assert enc.encode("2+2=", " 4") == [9, 10, 2]  # text: EOS appended
    with pytest.raises(ConfigError, match="model.tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))


def test_pair_order_is_a_permutation_per_epoch_and_deterministic():
    first_epoch = [i for step in (1, 2, 3) for i in pair_order(12, step=step, global_batch_size=4, seed=7)]
    assert sorted(first_epoch) == list(range(12))
    assert pair_order(12, step=2, global_batch_size=4, seed=7) == first_epoch[4:8]
    crossing = pair_order(10, step=3, global_batch_size=4, seed=7)  # positions 8..11: two from each epoch
    assert len(crossing) == 4
    assert pair_order(12, step=1, global_batch_size=4, seed=8) != first_epoch[:4]


def test_synthetic_pairs_are_seeded_and_held_out_problems_disjoint():
    train = synthetic_preference_records("prefer_last_digit", split="train", num_pairs=2000, seed=3)
    test = synthetic_preference_records("prefer_last_digit", split="test", num_pairs=300, seed=3)
    assert train == synthetic_preference_records("prefer_last_digit", split="train", num_pairs=2000, seed=3)
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    assert all(r.chosen == r.prompt[-2] for r in train + test)  # "last of 387=" -> "7"
    assert all(r.rejected != r.chosen for r in train + test)
    with pytest.raises(ConfigError, match="not a preference task"):
        synthetic_preference_records("addition", split="train", num_pairs=1, seed=0)


# ----- multi-process: layouts, scorer, training runs -----

@pytest.mark.slow
def test_layouts_tp2_pp2_padding_and_scorer(tmp_path):
    """TP=2 and PP=2 give TP=1's rewards and train as TP=1 x DP=2; padding does not change rewards; policy init
    loads the trunk only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--standalone", str(REPO_ROOT / "tests/dist/rm_layouts.py"), str(tmp_path)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    # the same seed at TP=1 and TP=2
    assert res["seed_tp2"] == pytest.approx(res["seed_tp1"], abs=1e-6)
    assert max(res["seed_tp1"]) - min(res["seed_tp1"]) > 0.1  # rewards differ across rows: a real comparison
    # right padding, left padding with a mask, and one sequence at a time agree
    pad = res["padding"]
    assert pad["right"] == pytest.approx(pad["single"], abs=1e-5)
    assert pad["left"] == pytest.approx(pad["single"], abs=1e-5)
    # scorer: one checkpoint, three layouts, padded, unpadded and packed micro-batches
    reference = res["scorer_tp1_dp2_mbs1"]
    for key in ("scorer_tp1_dp2", "scorer_tp2", "scorer_tp2_mbs1", "scorer_pp2", "scorer_pp2_mbs1",
                *(f"scorer_{name}_packed" for name in ("tp1_dp2", "tp2", "pp2"))):
        assert res[key] == pytest.approx(reference, abs=1e-5), key
    # untruncated rows score as the direct model; row 2 is cut to max_length 24 keeping its end
    assert res["scorer_tp1_dp2_lengths"] == [14, 13, 24, 4, 18, 5]
    for row in (0, 1, 3, 4, 5):
        assert reference[row] == pytest.approx(pad["single"][row], abs=1e-5)
    assert all(res[f"rng_kept_{name}"] for name in ("tp1_dp2", "tp2", "pp2"))
    assert res["init_from_policy_head_loaded"] is False and res["init_from_policy_trunk_equal"] is True
    assert res["init_from_rm_head_loaded"] is True and res["init_from_rm_head_equal"] is True
    # two training steps (Megatron DDP, distributed optimizer, head grads) at TP=1 x DP=2, TP=2 and PP=2
    one = res["train_tp1_dp2"]
    assert one["loss2"] != one["loss1"]  # the step changed the weights
    for other in (res["train_tp2"], res["train_pp2"]):
        for key in ("loss1", "grad_norm1"):  # the same weights: only the reductions' order differs
            assert other[key] == pytest.approx(one[key], rel=1e-5), key
        # after an Adam step, as the weights below: Adam divides each grad by its own magnitude, so a last-bit
        # difference of a near-zero grad moves its weight by up to lr (measured 1.05e-5 relative at TP2 here)
        for key in ("loss2", "grad_norm2"):
            assert other[key] == pytest.approx(one[key], rel=1e-4), key
        for key, value in one["after"].items():
            assert other["after"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key  # after 2 Adam steps


def _evals(run_dir: Path) -> list[dict]:
    return [m for m in read_metrics(run_dir) if m.get("phase") == "eval"]


@pytest.mark.slow
def test_tiny_rm_reaches_held_out_accuracy_across_a_requeue(tmp_path):
    """configs/rm_tiny.yaml (DP=2), preempted after step 50 (exit 3, checkpoint), requeued, finished at 100:
    held-out accuracy goes from chance to >= 0.9 (measured: 0.51 at step 0, 0.90 at 50, 0.99 at 100)."""
    run_dir = tmp_path / "run"
    args = ("--config", "configs/rm_tiny.yaml", f"run.dir={run_dir}", "run.steps=100", "logging.console=quiet")
    first = run_launch(*args, env={"MEGATRON_RL_STOP_AFTER_STEP": "50"}, timeout=240)
    assert first.returncode == 3, first.stdout[-3000:] + first.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_00000050").is_dir()
    second = run_launch(*args, timeout=240)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if "phase" not in m] == list(range(1, 101))
    evals = _evals(run_dir)
    assert [m["step"] for m in evals] == [0, 50, 100]
    assert 0.35 <= evals[0]["accuracy"] <= 0.65
    assert evals[-1]["accuracy"] >= 0.9
    assert evals[-1]["reward_margin"] > 1.0 and evals[-1]["bt_loss"] < 0.35
    data = [m for m in metrics if m.get("phase") == "data"]
    assert data == [{"step": 0, "phase": "data", "train_pairs": 4096, "train_truncated": 0, "train_dropped": 0,
                     "eval_pairs": 256, "eval_truncated": 0, "eval_dropped": 0}]
    assert (run_dir / "checkpoints" / "step_00000100").is_dir()
