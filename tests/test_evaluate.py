"""Held-out evaluation: the pass@k estimator against hand values and enumeration, and ``launch.py eval`` on a real
GRPO checkpoint at two layouts, with its eval.json, table, gate and bad input.

Run: ``.venv/bin/python -m pytest tests/test_evaluate.py -q`` (~1-2 min on 2 cores).
"""

from __future__ import annotations

import itertools
import json
import random
import stat

import pytest

from helpers import run_launch

from megatron_rl.algorithms.pass_at_k import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n,c,k,expected", [(5, 0, 1, 0.0), (5, 5, 3, 1.0), (10, 3, 1, 0.3), (4, 1, 2, 0.5),
                                            (3, 1, 3, 1.0), (6, 2, 5, 1.0)])
def test_pass_at_k_hand_values(n, c, k, expected):
    # (4, 1, 2): 1 - C(3, 2) / C(4, 2) = 1 - 3/6; (6, 2, 5): any 5 of 6 include a correct one
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_chance_that_a_k_subset_holds_a_correct_sample():
    rng = random.Random(3)
    for _ in range(40):
        n = rng.randint(1, 9)
        c, k = rng.randint(0, n), rng.randint(1, n)
        outcomes = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    assert mean_pass_at_k([[True, False], [False, False]], 1) == pytest.approx(0.25)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (3, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("train")
    proc = run_launch(f"run.dir={run_dir}", "run.steps=10", "algorithm.sft_warmup_steps=10",
                      "logging.console=quiet", "logging.tensorboard=false")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return run_dir / "checkpoints"


GREEDY = ["generation.temperature=0", "eval.samples=1", "eval.max_prompts=40"]


def _eval(out_dir, checkpoint, *extra):
    return run_launch("eval", "--ckpt", str(checkpoint), f"run.dir={out_dir}", "logging.tensorboard=false", *extra)


def test_eval_writes_one_entry_per_stage_and_runs_at_tp2_like_dp2(tmp_path, checkpoint):
    """Greedy pass@1 of the same checkpoint at TP=1 x DP=2 and at TP=2: the same completions, so the same figures;
    a sampled stage beside it in the same eval.json, with pass@k >= pass@1."""
    out = tmp_path / "eval"
    for stage, extra in (("dp2", GREEDY), ("tp2", [*GREEDY, "parallel.tp=2"]),
                         ("sampled", ["eval.samples=4", "eval.max_prompts=40"])):
        proc = _eval(out, checkpoint, f"eval.stage={stage}", *extra)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "pass@1  pass@4" in proc.stdout and "sampled" in proc.stdout
    path = out / "eval.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    entries = json.loads(path.read_text())
    assert sorted(entries) == ["dp2", "sampled", "tp2"]
    for entry in entries.values():
        assert {"pass@1", "pass@k", "k", "mean_reward", "mean_response_length", "n_prompts"} <= set(entry)
        assert entry["n_prompts"] == 40 and entry["kept"] is True
    dp2, tp2, sampled = entries["dp2"], entries["tp2"], entries["sampled"]
    assert (dp2["pass@1"], dp2["mean_response_length"]) == (tp2["pass@1"], tp2["mean_response_length"])
    assert dp2["k"] == 1 and dp2["pass@k"] == dp2["pass@1"]
    assert sampled["k"] == 4 and sampled["pass@k"] >= sampled["pass@1"]


def test_a_missed_gate_marks_the_stage_discarded_and_exits_with_the_gate_code(tmp_path, checkpoint):
    """The gate's own exit code (4), not the requeue code (3) that Slurm's job script would requeue on."""
    from megatron_rl.spec.run_files import GATE_EXIT_CODE, REQUEUE_EXIT_CODE

    proc = _eval(tmp_path / "eval", checkpoint, *GREEDY, "eval.stage=gated", "eval.min_pass_at_1=1.0")
    entry = json.loads((tmp_path / "eval" / "eval.json").read_text())["gated"]
    assert entry["pass@1"] < 1.0  # ten steps do not solve the task
    assert proc.returncode == GATE_EXIT_CODE != REQUEUE_EXIT_CODE and entry["kept"] is False
    assert "eval gate: pass@1" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["eval"], "the following arguments are required: --ckpt"),
    (["eval", "--ckpt", "/no/such/ckpt"], "--ckpt /no/such/ckpt: no such checkpoint folder"),
    (["eval", "--ckpt", ".", "eval.min_pass_at_1=2"], "eval.min_pass_at_1=2.0 must be in [0, 1]"),
    (["eval", "--ckpt", ".", "eval.samples=0"], "eval.samples=0 must be positive"),
])
def test_bad_eval_input_is_one_line_and_exit_2(args, message):
    proc = run_launch(*args, "--dry-run")
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_reward_model_checkpoint_is_scored_by_held_out_pair_accuracy(tmp_path):
    """An rm run's checkpoint: eval reports the rm trainer's own held-out accuracy for the same weights."""
    train = tmp_path / "rm"
    proc = run_launch("--config", "rm_tiny", f"run.dir={train}", "run.steps=10", "data.eval_interval=10",
                      "logging.console=quiet", "logging.tensorboard=false")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    proc = _eval(tmp_path / "eval", train / "checkpoints", "--config", "rm_tiny", "eval.stage=rm")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    entry = json.loads((tmp_path / "eval" / "eval.json").read_text())["rm"]
    last_eval = _last_eval(train)
    assert last_eval["step"] == 10
    assert entry["accuracy"] == pytest.approx(last_eval["accuracy"], abs=1e-6) and entry["n_pairs"] > 0
    assert "pass@1" not in entry and "accuracy" in proc.stdout


LORA_RM = "model.lora={rank: 4}"


@pytest.fixture(scope="module")
def lora_reward_model(tmp_path_factory):
    """An rm run (4 steps) with model.lora: its run folder, whose metrics hold the trainer's eval at step 4."""
    train = tmp_path_factory.mktemp("lora_rm")
    proc = run_launch("--config", "rm_tiny", LORA_RM, f"run.dir={train}", "run.steps=4", "data.eval_interval=4",
                      "logging.console=quiet", "logging.tensorboard=false")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return train


def _last_eval(run_dir) -> dict:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"phase": "eval"' in line][-1]


def test_a_lora_reward_model_is_scored_with_its_adapters_or_refused_without_them(tmp_path, lora_reward_model):
    """A reward model trained with model.lora: loaded without adapters it would silently score with the bare base,
    so that is a one-line error; with the same model.lora, eval gives the trainer's own held-out accuracy."""
    train, lora = lora_reward_model, LORA_RM
    bare = _eval(tmp_path / "bare", train / "checkpoints", "--config", "rm_tiny", "eval.stage=rm")
    assert bare.returncode == 2 and "holds LoRA adapters" in bare.stderr, bare.stderr[-3000:]
    assert "Traceback" not in bare.stderr and not (tmp_path / "bare" / "eval.json").exists()
    proc = _eval(tmp_path / "eval", train / "checkpoints", "--config", "rm_tiny", lora, "eval.stage=rm")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last_eval = _last_eval(train)
    entry = json.loads((tmp_path / "eval" / "eval.json").read_text())["rm"]
    assert entry["accuracy"] == pytest.approx(last_eval["accuracy"], abs=1e-6)
    assert entry["reward_margin"] == pytest.approx(last_eval["reward_margin"], abs=1e-5)


def test_the_grpo_rm_reward_scores_a_lora_reward_model_with_its_adapters(tmp_path, lora_reward_model):
    """RewardModelScorer (the GRPO `rm` reward) rebuilds the RM with the adapters its checkpoint records and scores
    the held-out pairs as the rm trainer's own eval of the same checkpoint did, at TP1 x DP2 and TP2."""
    from helpers import torchrun_check

    ranks = torchrun_check("lora_rm_scorer.py", tmp_path, "--rm-dir", str(lora_reward_model))
    last_eval = _last_eval(lora_reward_model)
    assert last_eval["step"] == 4
    for name in ("dp2", "tp2"):
        scored = ranks[0][name]
        assert scored["adapters"] == 8 and scored["pairs"] > 0, name  # tiny-cpu: 2 layers x 4 linears
        assert scored["accuracy"] == pytest.approx(last_eval["accuracy"], abs=1e-6), name
        for key in ("reward_margin", "reward_chosen", "reward_rejected"):
            assert scored[key] == pytest.approx(last_eval[key], abs=1e-5), (name, key)
    # the adapters change the scores: the bare base would not match the trainer
    off = ranks[0]["adapters_off"]
    assert min(abs(off[key] - last_eval[key]) for key in ("reward_margin", "reward_chosen")) > 1e-3
