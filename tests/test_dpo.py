"""DPO: the loss against TRL and hand values, response starts, layouts (TP/PP/CP/EP), config errors, the tiny run.

    .venv/bin/python -m pytest tests/test_dpo.py -q                  # ~1.5 min on 2 cores
    .venv/bin/python -m pytest tests/test_dpo.py -q -m "not slow"    # the pure functions and config errors only
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algorithms.dpo import DPOLossConfig, dpo_loss, dpo_pair_terms
from megatron_rl.data.preferences import PreferenceRecord, SequenceEncoder, tokenize_pairs
from megatron_rl.data.tokenizer import CharTokenizer
from helpers import read_metrics, run_launch, torchrun_check

LOG2 = math.log(2.0)


# ----- the loss against TRL, on the same log-probs -----

def _pairs(seed: int = 0, pairs: int = 6, length: int = 9):
    """Per-token policy log-probs [2B, T] (zero off the response), the completion mask [2B, T + 1] as TRL has it
    (a prompt token first), and reference sums per side, in float64."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * pairs, length + 1, dtype=torch.float64)
    for row in range(2 * pairs):
        start = int(torch.randint(1, 4, (), generator=gen))
        end = int(torch.randint(start + 1, length + 2, (), generator=gen))
        mask[row, start:end] = 1.0
    logp = -torch.rand(2 * pairs, length, generator=gen, dtype=torch.float64) * 3 * mask[:, 1:]
    ref = (logp.sum(1) + torch.randn(2 * pairs, generator=gen, dtype=torch.float64)).chunk(2)
    return logp, mask, ref


def _ours(logp, mask, ref, config):
    sums, tokens = logp.sum(1).chunk(2), mask[:, 1:].sum(1).chunk(2)
    return dpo_loss(sums[0], sums[1], ref[0], ref[1], chosen_tokens=tokens[0], rejected_tokens=tokens[1],
                    config=config)


def trl_dpo_loss(logp, mask, ref, *, beta: float, loss_types: list[str], loss_weights: list[float]):
    """TRL's DPOTrainer._compute_loss (its own code) with precomputed reference log-probs, on a stand-in model
    that returns ``logp`` as its per-token log-probs. Returns (loss, TRL's logged metrics)."""
    from trl import DPOTrainer

    class Model:
        def __call__(self, **kwargs):
            zeros = torch.zeros_like(logp)
            return SimpleNamespace(log_probs=logp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    accelerator = SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x)
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False,
                              ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", beta=beta,
                              loss_types=loss_types, loss_weights=loss_weights, label_smoothing=0.0,
                              use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
                              _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(mask.shape, dtype=torch.long), "attention_mask": torch.ones_like(mask),
              "completion_mask": mask, "ref_chosen_logps": ref[0], "ref_rejected_logps": ref[1]}
    loss = DPOTrainer._compute_loss(trainer, Model(), inputs, return_outputs=False)
    return loss, {key: values[-1] for key, values in trainer._metrics["train"].items()}


def trl_conservative_dpo(chosen_logratios, rejected_logratios, *, beta: float, label_smoothing: float):
    """Per-pair conservative-DPO loss of TRL's CPOTrainer.cpo_loss (sigmoid), given the log-ratios pi - ref as its
    'policy log-probs' (its logits are their difference: beta (c - r), DPO's). TRL 1.16's DPOTrainer has no label
    smoothing in its sigmoid loss."""
    from trl.experimental.cpo import CPOTrainer

    trainer = SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=label_smoothing, loss_type="sigmoid",
                              accelerator=SimpleNamespace(device="cpu"))
    losses, _, _ = CPOTrainer.cpo_loss(trainer, chosen_logratios, rejected_logratios)
    return losses


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("beta", [0.01, 0.1, 0.5, 2.0])
@pytest.mark.parametrize("sft_coef", [0.0, 0.3])
def test_loss_and_metrics_match_trl(loss_type, beta, sft_coef):
    logp, mask, ref = _pairs(seed=int(beta * 100) + (loss_type == "ipo"))
    types, weights = ([loss_type, "sft"], [1.0, sft_coef]) if sft_coef else ([loss_type], [1.0])
    expected, trl_metrics = trl_dpo_loss(logp, mask, ref, beta=beta, loss_types=types, loss_weights=weights)
    got, metrics = _ours(logp, mask, ref, DPOLossConfig(beta=beta, loss_type=loss_type, sft_coef=sft_coef))
    assert float(got) == pytest.approx(float(expected), abs=1e-6, rel=1e-9)
    for ours, theirs in (("reward_chosen", "rewards/chosen"), ("reward_rejected", "rewards/rejected"),
                         ("reward_margin", "rewards/margins"), ("accuracy", "rewards/accuracies")):
        assert float(metrics[ours]) == pytest.approx(trl_metrics[theirs], abs=1e-6), ours


@pytest.mark.parametrize("beta", [0.05, 0.1, 1.0])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3, 0.49])
def test_label_smoothing_matches_trl_conservative_dpo(beta, smoothing):
    logp, mask, ref = _pairs(seed=7)
    sums, tokens = logp.sum(1).chunk(2), mask[:, 1:].sum(1).chunk(2)
    terms = dpo_pair_terms(sums[0], sums[1], ref[0], ref[1], chosen_tokens=tokens[0], rejected_tokens=tokens[1],
                           config=DPOLossConfig(beta=beta, label_smoothing=smoothing))
    expected = trl_conservative_dpo(sums[0] - ref[0], sums[1] - ref[1], beta=beta, label_smoothing=smoothing)
    assert (terms["dpo_loss"] - expected).abs().max() < 1e-6


# ----- hand cases -----

def test_equal_log_probs_give_log_2_and_count_as_wrong():
    zero = torch.zeros(3)
    tokens = torch.tensor([2.0, 5.0, 1.0])
    for smoothing in (0.0, 0.2):
        terms = dpo_pair_terms(zero - 4, zero - 7, zero - 4, zero - 7, chosen_tokens=tokens, rejected_tokens=tokens,
                               config=DPOLossConfig(beta=0.3, label_smoothing=smoothing))
        assert terms["dpo_loss"].tolist() == pytest.approx([LOG2] * 3)
        assert terms["correct"].tolist() == [0.0] * 3 and terms["margin"].tolist() == [0.0] * 3
    ipo = dpo_pair_terms(zero, zero, zero, zero, chosen_tokens=tokens, rejected_tokens=tokens,
                         config=DPOLossConfig(beta=0.25, loss_type="ipo"))
    assert ipo["dpo_loss"].tolist() == pytest.approx([4.0] * 3)  # (0 - 1 / (2 * 0.25))^2


def test_hand_values_of_sigmoid_ipo_and_sft():
    # chosen log-ratio +2 over 4 tokens, rejected -1 over 2 tokens; beta 0.5
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-3.0, -6.0, -5.0, -5.0))
    nc, nr = torch.tensor([4.0]), torch.tensor([2.0])
    sig = dpo_pair_terms(pc, pr, rc, rr, chosen_tokens=nc, rejected_tokens=nr, config=DPOLossConfig(beta=0.5))
    assert float(sig["dpo_loss"]) == pytest.approx(math.log1p(math.exp(-1.5)))  # -log sigmoid(0.5 * 3)
    assert (float(sig["reward_chosen"]), float(sig["reward_rejected"]), float(sig["correct"])) == (1.0, -0.5, 1.0)
    smooth = dpo_pair_terms(pc, pr, rc, rr, chosen_tokens=nc, rejected_tokens=nr,
                            config=DPOLossConfig(beta=0.5, label_smoothing=0.1))
    assert float(smooth["dpo_loss"]) == pytest.approx(0.9 * math.log1p(math.exp(-1.5)) + 0.1 * math.log1p(math.exp(1.5)))
    ipo = dpo_pair_terms(pc, pr, rc, rr, chosen_tokens=nc, rejected_tokens=nr,
                         config=DPOLossConfig(beta=0.5, loss_type="ipo"))
    assert float(ipo["dpo_loss"]) == pytest.approx((2 / 4 + 1 / 2 - 1.0) ** 2)  # length-averaged ratios: 0
    loss, metrics = dpo_loss(pc, pr, rc, rr, chosen_tokens=nc, rejected_tokens=nr,
                             config=DPOLossConfig(beta=0.5, sft_coef=0.2))
    assert float(metrics["sft_loss"]) == pytest.approx(3.0 / 4)
    assert float(loss) == pytest.approx(math.log1p(math.exp(-1.5)) + 0.2 * 0.75)


def test_large_margins_are_stable():
    terms = dpo_pair_terms(torch.tensor([0.0, -900.0]), torch.tensor([-900.0, 0.0]), torch.zeros(2), torch.zeros(2),
                           chosen_tokens=torch.ones(2), rejected_tokens=torch.ones(2), config=DPOLossConfig(beta=1.0))
    assert terms["dpo_loss"].tolist() == pytest.approx([0.0, 900.0])


# ----- response starts -----

def test_response_starts_mask_the_prompt():
    tok = CharTokenizer()
    enc = SequenceEncoder(tok)
    records = [PreferenceRecord(prompt="last of 387=", chosen="7", rejected="7ab", source="s:1"),  # shared "7"
               PreferenceRecord(prompt=None, chosen=[{"role": "user", "content": "q"}, {"role": "assistant",
                                "content": "yes"}], rejected=[{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "no"}], source="s:2"),
               PreferenceRecord(prompt="abcdefghijklmnopqrstuvwxyz0123", chosen="XY", rejected="Z", source="s:3")]
    data = tokenize_pairs(records, enc, max_length=26, truncation="truncate", vocab_size=128, name="t",
                          response_starts=True)
    assert tok.decode(data.chosen[0][data.chosen_starts[0]:]) == "7"
    assert tok.decode(data.rejected[0][data.rejected_starts[0]:]) == "7ab"
    # a whole conversation: the shared user turn is the prompt, the assistant turn the response
    assert tok.decode(data.chosen[1][data.chosen_starts[1]:]) == "yes\n"
    assert tok.decode(data.rejected[1][data.rejected_starts[1]:]) == "no\n"
    # truncation cuts the prompt's start (after BOS): the response keeps its place at the end
    assert data.num_truncated == 1 and data.chosen[2][0] == tok.bos_id and len(data.chosen[2]) == 26
    assert tok.decode(data.chosen[2][data.chosen_starts[2]:]) == "XY"
    assert tok.decode(data.rejected[2][data.rejected_starts[2]:]) == "Z"


# ----- config errors -----

@pytest.mark.parametrize("override, message", [
    ("algorithm.dpo_beta=0", "algorithm.dpo_beta=0"),
    ("algorithm.dpo_label_smoothing=0.5", "algorithm.dpo_label_smoothing=0.5 must be in [0, 0.5)"),
    ("algorithm.dpo_loss=hinge", "algorithm.dpo_loss='hinge' is not valid; use one of: sigmoid, ipo"),
    ("algorithm.dpo_sft_coef=-1", "algorithm.dpo_sft_coef=-1"),
])
def test_bad_dpo_settings_exit_2_with_one_line(override, message):
    result = run_launch("--config", "configs/dpo_tiny.yaml", override, "--dry-run", timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_ipo_with_label_smoothing_is_refused():
    result = run_launch("--config", "configs/dpo_tiny.yaml", "algorithm.dpo_loss=ipo",
                        "algorithm.dpo_label_smoothing=0.1", "--dry-run", timeout=60)
    assert result.returncode == 2 and "applies to dpo_loss=sigmoid only" in result.stderr


# ----- layouts and the tiny run (multi-process) -----

@pytest.mark.slow
def test_layouts_give_the_same_reference_losses_and_metrics(tmp_path):
    """TP2, PP2 and CP2 equal TP1 x DP2 (tiny-cpu), EP2 equals DP2 (tiny-cpu-moe): the reference pass, three DPO
    steps (label smoothing and the NLL term on) and the held-out metrics."""
    ranks = torchrun_check("dpo_layouts.py", tmp_path)
    for res in ranks:
        for base, others in (("dp2", ("tp2", "pp2", "cp2")), ("moe_dp2", ("moe_ep2",))):
            one = res[base]
            first = one["steps"][0]  # policy = reference: the DPO term is log 2
            assert first["dpo_loss"] == pytest.approx(LOG2, abs=1e-6)
            assert first["loss"] == pytest.approx(LOG2 + 0.3 * first["sft_loss"], rel=1e-6)
            assert one["steps"][2]["loss"] < one["steps"][0]["loss"]
            for name in others:
                other = res[name]
                assert torch.tensor(other["reference"]).sub(torch.tensor(one["reference"])).abs().max() < 1e-5, name
                assert other["steps"][0]["loss"] == pytest.approx(first["loss"], abs=1e-6), name
                for key in ("loss", "grad_norm", "reward_margin"):
                    assert [s[key] for s in other["steps"]] == pytest.approx([s[key] for s in one["steps"]],
                                                                             rel=1e-4, abs=1e-5), (name, key)
                # step 1's accuracy counts float-noise ties (policy = reference), so it is left out
                assert [s["accuracy"] for s in other["steps"][1:]] == [s["accuracy"] for s in one["steps"][1:]]
                assert other["eval"] == pytest.approx(one["eval"], rel=1e-4, abs=1e-5), name


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """configs/dpo_tiny.yaml (DP=2, 40 steps), preempted after step 20 (exit 3, checkpoint) and requeued."""
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    args = ("--config", "configs/dpo_tiny.yaml", f"run.dir={run_dir}", "logging.console=quiet")
    first = run_launch(*args, env={"MEGATRON_RL_STOP_AFTER_STEP": "20"}, timeout=240)
    second = run_launch(*args, timeout=240)
    return run_dir, first, second


@pytest.mark.slow
def test_tiny_dpo_reaches_held_out_accuracy_across_a_requeue(tiny_run):
    run_dir, first, second = tiny_run
    assert first.returncode == 3, first.stdout[-3000:] + first.stderr[-3000:]
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if "phase" not in m] == list(range(1, 41))
    evals = [m for m in metrics if m.get("phase") == "eval"]
    assert [m["step"] for m in evals] == [0, 20, 40]
    assert evals[0]["accuracy"] == 0.0 and evals[0]["dpo_loss"] == pytest.approx(LOG2, abs=1e-6)
    assert evals[-1]["accuracy"] >= 0.9
    assert evals[-1]["reward_margin"] > 0.5 and evals[-1]["reward_chosen"] > evals[-1]["reward_rejected"]
    assert set(evals[-1]) >= {"loss", "dpo_loss", "sft_loss", "accuracy", "reward_margin", "reward_chosen",
                              "reward_rejected"}
    data = [m for m in metrics if m.get("phase") == "data"]
    assert data == [{"step": 0, "phase": "data", "train_pairs": 4096, "train_truncated": 0, "train_dropped": 0,
                     "eval_pairs": 256, "eval_truncated": 0, "eval_dropped": 0}]


@pytest.mark.slow
def test_tiny_dpo_checkpoint_holds_the_reference(tiny_run):
    from megatron.core import dist_checkpointing

    run_dir = tiny_run[0]
    common = dist_checkpointing.load_common_state_dict(str(run_dir / "checkpoints" / "step_00000040"))
    reference = common["extra"]["dpo_reference"]
    assert tuple(reference["train"].shape) == (4096, 2) and tuple(reference["eval"].shape) == (256, 2)
    assert reference["train"].dtype == torch.float32 and bool((reference["train"] < 0).all())
