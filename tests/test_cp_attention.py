"""Context parallelism on CPU: ``megatron_rl.models.cp_attention`` against Megatron's own cp=1 computation.

Run: ``.venv/bin/python -m pytest tests/test_cp_attention.py -q`` (25-50 s on 2 shared cores).

Each layout runs ``tests/dist/cp_attention_check.py`` in its own torchrun (Megatron's parallel state is
process-global): cp=2 on 2 processes and cp=4 on 4 (whose chunk order, rank r holding chunks r and 2cp-1-r of 8,
is less symmetric). In the worker, per rank:

* core attention (s=16, b=2, 4 heads, fp32; GQA with 2 groups, MHA, and an explicit causal + padding mask):
  output and d/dq, d/dk, d/dv of this rank's part against ``DotProductAttention`` on the whole sequence, and
  bit-identity with it at cp=1;
* the tiny-cpu GPTModel (RoPE, GQA): per-token losses and every parameter gradient (summed over the CP group)
  against the same weights at cp=1 with the stock local spec;
* ``build_engine`` with the recommended wiring: two Adam steps at cp=N (dp=1) and cp=1 (dp=N), loss and grad norm,
  then ``sequence_logprobs`` (whole sequences, gathered over the CP group).

Measured (cp=2 and cp=4): attention <= 7.2e-7, per-token loss 0.0, parameter grads <= 2.4e-6 (grads up to 9.0),
engine loss <= 2.7e-7, grad norm <= 1.1e-7, log-probs after the two steps <= 3.8e-6. A wrong chunk order (K/V
gathered in rank order) gives differences of order 1 (attention 1.8, per-token loss 0.69).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import torchrun_check

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "tests" / "dist" / "cp_attention_check.py"
ATTENTION_TOL = 1e-6
GRAD_TOL = 1e-5  # parameter grads reach ~9 in magnitude: 1e-5 absolute is ~1e-6 relative
ENGINE_TOL = 1e-5
AFTER_ADAM_TOL = 1e-4  # log-probs after two Adam steps (lr 0.01): Adam normalises tiny grad differences up


def _torchrun(out: Path, nproc: int) -> list[dict]:
    return torchrun_check(SCRIPT.name, out, nproc=nproc)


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ranks(request, tmp_path_factory):
    return _torchrun(tmp_path_factory.mktemp(f"cp{request.param}"), request.param)


def test_every_rank_is_in_one_cp_group(ranks):
    assert [r["cp"] for r in ranks] == [len(ranks)] * len(ranks)
    assert sorted(r["cp_rank"] for r in ranks) == list(range(len(ranks)))
    assert all(r["finite"] for r in ranks)


@pytest.mark.parametrize("case", ["gqa_causal", "mha_causal", "gqa_padded_mask"])
def test_sdpa_attention_matches_dot_product_attention(ranks, case):
    """runtime.attention=flash without TE: torch's SDPA kernel gives DotProductAttention's output and grads on the
    whole sequence, at cp > 1 on this rank's part, and for decode queries and a chunk after a cached prefix."""
    for rank in ranks:
        result = next(r for r in rank["attention"] if r["case"] == case)
        assert result["sdpa_whole"] <= ATTENTION_TOL * 10
        assert result["sdpa_cp"] <= ATTENTION_TOL * 10
        if case != "gqa_padded_mask":
            assert result["sdpa_decode"] <= ATTENTION_TOL * 10
            assert result["sdpa_chunk"] <= ATTENTION_TOL * 10


@pytest.mark.parametrize("case", ["gqa_causal", "mha_causal", "gqa_padded_mask"])
def test_core_attention_matches_dot_product_attention(ranks, case):
    """Output and q/k/v gradients of this rank's part equal DotProductAttention on the whole sequence."""
    cp = len(ranks)
    for rank in ranks:
        result = next(r for r in rank["attention"] if r["case"] == case)
        assert result["local_shape"] == [16 // cp, 2, 32]
        if case == "gqa_padded_mask":
            assert result["mask_shape"] == [2, 1, 16 // cp, 16]
        for key in ("out", "out_gathered", "dq", "dk", "dv"):
            assert result[key] < ATTENTION_TOL, (rank["cp_rank"], key, result[key])
        assert result["ref_grad_scale"] > 0.1  # the gradients compared are not trivially zero


def test_cp1_is_bit_identical_to_dot_product_attention(ranks):
    for rank in ranks:
        assert all(r["cp1_bitwise"] for r in rank["attention"])


def test_gpt_model_at_cp_matches_cp1(ranks):
    """The tiny GPT (RoPE sliced per CP rank by Megatron) gives the cp=1 per-token losses and gradients."""
    cp = len(ranks)
    for rank in ranks:
        gpt = rank["gpt"]
        assert gpt["local_tokens_shape"] == [2, 64 // cp] and gpt["per_token_shape"] == [2, 64 // cp]
        assert gpt["core_attention"] == ["CPDotProductAttention"]
        assert gpt["ref_core_attention"] == ["DotProductAttention"]
        assert gpt["state_dict_ok"]
        assert gpt["per_token_loss"] < ATTENTION_TOL
        assert abs(gpt["loss_sum_cp"] - gpt["loss_sum_ref"]) < 1e-6 * gpt["loss_sum_ref"]
        assert 4.0 < gpt["loss_mean_ref"] < 5.5  # ~ln(vocab) at initialisation
        assert gpt["grad_max_diff"] < GRAD_TOL and gpt["grad_max_abs"] > 0.1
        assert gpt["new_redirect_sites_at_cp"] == []  # CP adds no unreviewed CUDA-only call site


def test_engine_train_steps_at_cp_match_cp1(ranks):
    """Two Adam steps through Megatron's schedule, DDP and finalize_model_grads: same loss and grad norm; then
    the same log-probs from sequence_logprobs."""
    for rank in ranks:
        engine = rank["engine"]
        assert (engine["cp"][0]["cp"], engine["cp"][0]["dp"]) == (len(ranks), 1)
        assert (engine["ref"][0]["cp"], engine["ref"][0]["dp"]) == (1, len(ranks))
        assert engine["loss"] < ENGINE_TOL and engine["grad_norm"] < ENGINE_TOL
        assert engine["logp_shape"] == [4, 64] and engine["logprobs"] < AFTER_ADAM_TOL
        assert engine["cp"][1]["loss"] < engine["cp"][0]["loss"]  # the first step changed the weights
