"""bench/grpo_step.py: the tokenizer TRL gets equals ours, and a 1-step run of both sides prints its JSON.

Run: ``.venv/bin/python -m pytest tests/test_bench_grpo_step.py -q`` (skipped without trl: the ``bench`` extra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "bench"))


def test_hf_tokenizer_matches_char_tokenizer():
    pytest.importorskip("tokenizers")
    from grpo_step import char_tokenizer_as_hf

    from megatron_rl.data.tokenizer import CharTokenizer

    hf = char_tokenizer_as_hf(128)
    text = "last of 387= ~\n"
    # Independent ids: <bos>=1, '\n'=4, printable c -> ord(c) - 27 (' ' is 5, '~' is 99).
    expected = [1] + [4 if c == "\n" else ord(c) - 27 for c in text]
    assert hf(text)["input_ids"] == expected == CharTokenizer().encode(text, add_bos=True)
    assert hf.decode(expected, skip_special_tokens=True) == text
    assert (len(hf), hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (128, 0, 1, 2)
    assert hf.decode([120, 2, 0], skip_special_tokens=True) == ""  # padding ids and specials decode to nothing


@pytest.mark.slow
def test_one_step_each_side_prints_the_ratio(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "grpo_step.py"), "--sizes", "tiny", "--steps", "2", "--warmup",
         "1", "--block", "1", "--threads", "1", "--prompts", "2", "--group", "2", "--new-tokens", "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    tiny = summary["sizes"]["tiny"]
    assert tiny["steps_timed"] == 2 and len(tiny["ours_s_all"]) == len(tiny["trl_s_all"]) == 2
    assert tiny["threads"] == {"ours": [1], "trl": [1]}
    assert tiny["ours_s"] > 0 and tiny["trl_s"] > 0
    assert summary["speedup"] == pytest.approx(tiny["trl_s"] / tiny["ours_s"])
    ratios = [t / o for o, t in zip(tiny["ours_s_all"], tiny["trl_s_all"])]
    spread = summary["speedup_spreads"]["tiny"]
    assert spread["min"] == pytest.approx(min(ratios)) and spread["max"] == pytest.approx(max(ratios))
    assert spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]
    split = tiny["ours_split_s"]
    assert sum(split.values()) == pytest.approx(tiny["ours_s"], rel=0.2)
    # Colocated generation log-probs match the training forward: the first importance ratio is 1.
    assert tiny["first_ratio_ours"] == pytest.approx([1.0, 1.0], abs=1e-4)
