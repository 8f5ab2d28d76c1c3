"""Oracle: the project's paged engine decodes as Megatron Core 0.19's own ``DynamicInferenceEngine`` does.

Run: ``.venv/bin/python -m pytest tests/test_megatron_engine_oracle.py -q`` (two torchrun launches, TP=1 on one
process and TP=2 on two gloo processes; about 27 s on 2 busy cores, nearly all of it process start-up and imports:
each engine decodes in under 0.3 s).

Each launch runs ``tests/dist/megatron_engine_oracle.py``: the tiny Llama-like model of gen_check.py (tiny-cpu: GQA
4/2, RoPE, RMSNorm, SwiGLU, untied embeddings; two training steps, then a fixed perturbation so that the tokens
depend on the context), 17 rows (groups of 4 identical prompts of 21, 13, 6 and 30 tokens, and a prompt sharing
the 30-token prompt's first two blocks), 10 greedy tokens each, decoded by the project's engine and by Megatron's
engine with ``InferenceConfig(enable_prefix_caching=True)``, both with 8-token KV blocks so that the prompts hold
whole blocks to share. Asserted: the same tokens, exactly; log-probs within ``LOGPROB_TOL``; Megatron's engine
served each row's shared whole prompt blocks from its prefix cache (per-row counts computed here from the
prompts), the project's engine prefilled each distinct prompt once; both engines agree with one no-cache forward
of the final sequences (the training attention path, not the paged kernels).

What the oracle covers: Megatron's engine's own scheduling, block allocation and prefix caching (chained block
hashes, reference counts), its token packing, RoPE positions, KV append, last-token logits and raw log-probs,
against the project's, on a dense GPT at TP=1 and TP=2 (DP=1), greedy. Both engines attend by the same torch
stand-ins for flash-attn's kernels (megatron_rl/generation/paged_attention.py; Megatron's engine needs the CPU
patches listed in the worker), so the oracle checks everything around the kernels; the kernels themselves are
checked against flash-attn on GPUs where it is installed (bench/gpu_check.sh), and here against the no-cache
forward.

Not covered, because Megatron's engine does not serve them as the project's engine does (rollout-engine-facts
notes): pipeline parallelism (its stages run in turn, with its own schedule) and virtual pipeline stages (it refuses
model lists), multi-latent attention (it needs ``cache_mla_latents``: Transformer Engine and FlashMLA only, and it
deletes training weights), MoE with expert parallelism (its EP lockstep lives in its coordinator loop only),
context parallelism (none), sequence parallelism; nor sampling (Megatron draws from one global generator, the
project per request and position: only greedy decoding is comparable), stop tokens and KV budgets small enough to
pause or evict rows. tests/test_generation.py checks those against recomputation instead.

Tolerance: 1e-5 absolute in fp32, the project's generation tolerance (tests/test_generation.py). Measured here: the
two engines' log-probs differ by at most 9.5e-7 at TP=1 and 7.2e-7 at TP=2, each engine from the no-cache forward
by at most 1.4e-6: a few float32 ulps (2.4e-7 at |log p| in [2, 4), 4.8e-7 in [4, 8)), as the engines pack, pad and
sum in different orders. The tolerance leaves ~7x headroom and stays far below the smallest top-1/top-2 logit margin of the greedy choices
(0.012 at TP=1, 0.0032 at TP=2; asserted above ``MIN_MARGIN``), so exact token equality is not a matter of luck.
"""

from __future__ import annotations

import pytest

from helpers import torchrun_check

SCRIPT = "megatron_engine_oracle.py"
LOGPROB_TOL = 1e-5
MIN_MARGIN = 100 * LOGPROB_TOL
"""Greedy choices must win by more than this (in logits), or equal tokens would hinge on rounding."""
LAYOUTS = ["tp1", "tp2"]


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    return torchrun_check(SCRIPT, tmp_path_factory.mktemp("oracle_tp1"), "--tp", "1", nproc=1)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return torchrun_check(SCRIPT, tmp_path_factory.mktemp("oracle_tp2"), "--tp", "2", nproc=2)


def expected_cached_tokens(rows: list[list[int]], block: int) -> list[int]:
    """Per row, the prompt tokens a prefix cache of whole blocks can serve: the longest run of leading whole
    blocks the row's prompt shares with an earlier row's prompt."""
    cached = []
    for i, row in enumerate(rows):
        best = 0
        for earlier in rows[:i]:
            blocks = 0
            while (blocks + 1) * block <= len(row) and row[:(blocks + 1) * block] == earlier[:(blocks + 1) * block]:
                blocks += 1
            best = max(best, blocks)
        cached.append(best * block)
    return cached


@pytest.mark.parametrize("layout", LAYOUTS)
def test_project_engine_equals_megatron_dynamic_engine(request, layout):
    """Greedy, prefix caching on: the same tokens exactly and log-probs within LOGPROB_TOL, on every rank."""
    runs = request.getfixturevalue(layout)
    for rank in runs:
        ours, theirs = rank["project"], rank["megatron"]
        assert ours["tokens"] == theirs["tokens"], (layout, ours["tokens"], theirs["tokens"])
        assert rank["logprob_diff"] < LOGPROB_TOL, (layout, rank["logprob_diff"])
        assert theirs["status"] == ["Status.COMPLETED"] * len(rank["rows"])
        assert ours["finish_reasons"] == ["length"] * len(rank["rows"])
    if len(runs) > 1:  # TP ranks of one replica return the same responses from both engines
        for other in runs[1:]:
            for engine in ("project", "megatron"):
                assert other[engine]["tokens"] == runs[0][engine]["tokens"]
                assert other[engine]["logprobs"] == runs[0][engine]["logprobs"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_both_engines_equal_the_no_cache_forward(request, layout):
    """Against the training forward of the final sequences: which engine moved, should the oracle fail."""
    for rank in request.getfixturevalue(layout):
        for engine in ("project", "megatron"):
            out = rank[engine]
            assert out["no_cache_argmax_equal"], (layout, engine)
            assert out["vs_no_cache"] < LOGPROB_TOL, (layout, engine, out["vs_no_cache"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_oracle_is_not_vacuous(request, layout):
    """The layout asked for, every row decoded to full length, greedy choices clear of ties, responses that
    depend on the prompt, and prompt sharing that really happened: Megatron's prefix cache served every shared
    whole block (and only those), the project's engine prefilled each distinct prompt once."""
    runs = request.getfixturevalue(layout)
    tp = int(layout[2:])
    assert len(runs) == tp
    for rank in runs:
        assert (rank["tp"], rank["world"], rank["dp"]) == (tp, tp, 1)
        assert rank["megatron_core"].startswith("0.19.")
        assert rank["padded_vocab_size"] == rank["vocab_size"]  # no padded ids for either engine to pick
        rows, block, new = rank["rows"], rank["block_tokens"], rank["new_tokens"]
        ours, theirs = rank["project"], rank["megatron"]
        assert len(rows) == 17 and new == 10 and block == 8
        assert ours["block_tokens"] == theirs["block_size_tokens"] == block
        for out in (ours, theirs):
            assert len(out["tokens"]) == len(rows) and all(len(t) == new for t in out["tokens"])
            assert len(out["logprobs"]) == len(rows) and all(len(lp) == new for lp in out["logprobs"])
            assert out["min_greedy_margin"] > MIN_MARGIN, (layout, out["min_greedy_margin"])
        # GRPO-like groups: rows with the same prompt; every distinct prompt gets its own response
        distinct = {tuple(r) for r in rows}
        assert len(distinct) == rank["distinct_prompts"] == 5 and len(rows) - len(distinct) == 12
        assert len({tuple(t) for t in ours["tokens"]}) == len(distinct)
        # prefix caching: per row, whole prompt blocks served from Megatron's cache
        cached = expected_cached_tokens(rows, block)
        assert sum(cached) == 160 and sum(c > 0 for c in cached) == 10  # 3 groups share blocks, and the sibling
        assert theirs["prefix_caching"] is True
        # Megatron's attention ran the stand-ins: prefill/mixed steps and decode-only steps (a layer call each)
        assert theirs["kernel_calls"]["varlen"] > 0 and theirs["kernel_calls"]["kvcache"] > 0
        assert theirs["num_cached_tokens"] == cached
        assert theirs["prefix_cache_hits"] == sum(c > 0 for c in cached)
        assert theirs["prefix_cache_blocks_matched"] * block == theirs["prefill_tokens_skipped"] == sum(cached)
        assert theirs["prefill_tokens_computed"] == sum(len(r) for r in rows) - sum(cached)
        assert ours["prefill_rows"] == len(distinct)  # one prefill per group (identical prompts only)
