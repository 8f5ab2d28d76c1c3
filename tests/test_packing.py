"""Sequence packing (parallel.micro_batch_tokens, megatron_rl/rollout/packing.py): the packer's guarantees, the
packed micro-batch's row view against the padded one's, the attention boundaries (built on the host), the packed
core attention without TE (one attention per row, one SDPA launch, no host sync), the launch check's refusals;
and, on real Megatron Core over gloo (tests/dist/packing_check.py), packed against padded GRPO steps at TP2 and
PP2·VPP2 (the same log-probs, losses and gradients; the first step's ratio 1). The job-level runs at MoE
TP2·EP2·SP, PP2 and DP2 are packed in tests/test_grpo_layouts.py.

    .venv/bin/python -m pytest tests/test_packing.py -q
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import pytest
import torch

from helpers import REPO_ROOT, torchrun_check
from megatron_rl.models.packed_sequences import as_rows, attention_inputs, with_padding_segments
from megatron_rl.rollout.batch import RolloutRow, collate_rollout, old_logprob_key, old_logprobs, store_logprobs
from megatron_rl.rollout.packing import collate_packed, pack_minibatch, pack_rows
from megatron_rl.runtime.probes import host_syncs
from megatron_rl.spec.config import load_config
from megatron_rl.spec.config.validate import check_layout
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import load_model_shape


def long_tail(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([12, 20, 40, 90, 300, 1200]) + rng.randrange(8) for _ in range(count)]


@pytest.mark.parametrize("dp, budget, multiple, count_multiple", [(1, 512, 1, 1), (2, 512, 4, 1), (4, 256, 8, 2),
                                                                  (2, 4096, 1, 1)])
def test_every_row_once_within_the_budget_at_one_length_and_count(dp, budget, multiple, count_multiple):
    lengths = long_tail(64, seed=dp + budget)
    per_rank, packed = pack_rows(lengths, dp=dp, token_budget=budget, multiple=multiple,
                                 count_multiple=count_multiple)
    assert len(per_rank) == dp
    counts = {len(bins) for bins in per_rank}
    assert len(counts) == 1 and counts.pop() % count_multiple == 0
    placed = sorted(i for bins in per_rank for b in bins for i in b if i >= 0)
    assert placed == list(range(len(lengths)))  # every row exactly once (copies are negative)
    assert packed % multiple == 0 and packed <= -(-max(budget, max(lengths)) // multiple) * multiple
    for bins in per_rank:
        for b in bins:
            assert b and sum(lengths[i if i >= 0 else -1 - i] for i in b) <= packed
    loads = [sum(lengths[i] for b in bins for i in b if i >= 0) for bins in per_rank]
    assert max(loads) - min(loads) <= max(lengths)  # shared by tokens, not by rows


def test_packing_a_long_tail_computes_few_padding_tokens():
    """64 rows whose lengths span 12..1207 tokens: padding to the longest computes ~3x the rows' tokens; packed
    into 2048-token micro-batches, within 10% of them."""
    lengths = long_tail(64, seed=7)
    per_rank, packed = pack_rows(lengths, dp=2, token_budget=2048)
    computed = sum(len(bins) for bins in per_rank) * packed
    assert computed / sum(lengths) < 1.10
    assert len(lengths) * max(lengths) / sum(lengths) > 2.5


def test_a_rank_with_fewer_rows_than_micro_batches_gets_a_copy_outside_the_loss():
    """Three rows of 100 tokens in micro-batches of 100 on 2 ranks: rank 0 runs two micro-batches, so rank 1
    runs its one row and a copy of it that adds nothing to the loss."""
    per_rank, packed = pack_rows([100, 100, 100], dp=2, token_budget=100)
    assert per_rank == [[[0], [2]], [[1], [-2]]] and packed == 100
    rows = [RolloutRow(prompt_ids=[1] * 41, response_ids=[2] * 60, logprobs=[-1.0] * 60, advantage=1.0)
            for _ in range(3)]
    micro, figures = pack_minibatch(rows, dp=2, dp_rank=1, token_budget=100, multiple=1, count_multiple=1,
                                    pad_id=0, thd=False)
    assert [float(b["loss_mask"].sum()) for b in micro] == [60.0, 0.0]
    assert figures == {"train_tokens": 400.0, "real_tokens": 300.0}


def test_a_rank_without_rows_runs_a_copy_outside_the_loss():
    """Fewer rows than data-parallel ranks (a packed job needs no global batch divisible by dp)."""
    per_rank, packed = pack_rows([30, 20, 10], dp=4, token_budget=64)
    assert per_rank == [[[0]], [[1]], [[2]], [[-3]]] and packed == 30


def _rows(seed: int) -> list[RolloutRow]:
    rng = random.Random(seed)
    rows = []
    for i in range(7):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randint(2, 6))]
        response = [rng.randrange(3, 100) for _ in range(rng.randint(1, 9))]
        rows.append(RolloutRow(prompt_ids=prompt, response_ids=response, advantage=rng.uniform(-1, 1),
                               logprobs=[-rng.random() for _ in response], in_loss=i != 4))
    return rows


def test_the_packed_row_view_equals_the_padded_micro_batch():
    rows = _rows(1)
    width = max(r.forward_tokens for r in rows)
    padded = collate_rollout(rows, seq_length=width + 3, pad_id=0)
    packed = collate_packed(rows, packed_length=sum(r.forward_tokens for r in rows) + 5, pad_id=0,
                            thd=False)
    assert packed["tokens"].shape == (1, sum(r.forward_tokens for r in rows) + 5)
    for key in ("loss_mask", "behav_logp"):
        assert torch.equal(packed[key], padded[key][:, :width]) and not padded[key][:, width:].any()
    assert torch.equal(packed["advantages"], padded["advantages"])
    valid = packed["row_valid"]
    for key in ("labels", "tokens", "position_ids"):
        assert torch.equal(as_rows(packed[key], packed)[valid], padded[key][:, :width][valid]), key
    assert as_rows(torch.arange(packed["tokens"].shape[1])[None], packed)[~valid].eq(0).all()
    assert torch.equal(as_rows(padded["labels"], padded), padded["labels"])  # a padded batch passes through


def test_a_rollout_micro_batch_is_typed_and_reads_as_a_mapping_of_its_set_entries():
    """Trainers and losses read RolloutBatch's fields; Megatron's schedule (shared with the dict batches of SFT,
    DPO and RM) reads the set entries by name. Log-probs are set by name only among LOGPROB_KEYS, and pi_old is
    the recomputation when there is one."""
    rows = _rows(2)
    padded = collate_rollout(rows, seq_length=max(r.forward_tokens for r in rows), pad_id=0, row_ids=[6, 5, 4, 3, 2, 1, 0])
    assert isinstance(padded, Mapping) and set(padded) == {"tokens", "labels", "position_ids", "loss_mask",
                                                           "advantages", "behav_logp", "row_ids"}
    assert padded["row_ids"].tolist() == [6, 5, 4, 3, 2, 1, 0] and "routes" not in padded
    assert padded.get("attention_mask") is None and "attention_mask" in collate_packed(rows, packed_length=64,
                                                                                       pad_id=0, thd=False)
    with pytest.raises(KeyError):
        padded["old_logp"]  # not set: absent from the mapping, None as a field
    assert old_logprob_key(padded) == "behav_logp" and old_logprobs(padded) is padded.behav_logp
    recomputed = padded.behav_logp + 0.5
    store_logprobs([padded], "old_logp", [recomputed])
    assert old_logprob_key(padded) == "old_logp" and old_logprobs(padded) is recomputed
    assert padded.behav_logp is not recomputed  # the rollout's own log-probs keep their meaning
    with pytest.raises(KeyError, match="behav_logp, old_logp, ref_logp, teacher_logp"):
        store_logprobs([padded], "advantages", [recomputed])
    with pytest.raises(AttributeError):
        padded.old_logprobs = recomputed  # a misspelt field is an error, not a new entry


def test_each_row_attends_to_itself_causally_and_the_padding_to_itself():
    starts = with_padding_segments([0, 3, 5], 8)  # rows of 3 and 2 tokens, then a 3-token padding tail
    assert starts == [0, 3, 5, 8]
    masked = attention_inputs(starts, thd=False)["attention_mask"][0, 0]
    allowed = ~masked
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for start, end in ((0, 3), (3, 5), (5, 8)):
        expected[start:end, start:end] = torch.tril(torch.ones(end - start, end - start, dtype=torch.bool))
    assert torch.equal(allowed, expected)


def test_transformer_engine_gets_thd_boundaries_with_the_longest_known_on_the_host(monkeypatch):
    """max_seqlen (which TE's THD attention, Megatron's THD RoPE and packed_context take) comes from the host
    boundaries: building the parameters reads nothing back from the device."""
    pytest.importorskip("megatron.core.packed_seq_params")
    with host_syncs() as reads:
        params = attention_inputs([0, 3, 5, 8], thd=True)["packed_seq_params"]
        mask = attention_inputs([0, 3, 5, 8], thd=False)["attention_mask"]
    assert reads == [] and mask.shape == (1, 1, 8, 8)
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 5, 8]
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == params.max_seqlen_kv == 3


def test_the_padding_tail_is_cut_into_segments_no_longer_than_the_longest_row():
    """Per-sequence attention pads every segment to the longest (packed_context): a tail of 9 after rows of 3 and
    2 tokens is 3 segments of 3; a tail that does not divide ends short; a micro-batch of padding only is one."""
    assert with_padding_segments([0, 3, 5], 14) == [0, 3, 5, 8, 11, 14]
    assert with_padding_segments([0, 3, 5], 12) == [0, 3, 5, 8, 11, 12]
    assert with_padding_segments([0, 3, 5], 5) == [0, 3, 5]
    assert with_padding_segments([0], 6) == [0, 6]
    rows = [RolloutRow(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-1.0, -1.0], advantage=0.0)]
    batch = collate_packed(rows, packed_length=10, pad_id=0, thd=True)
    assert batch.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 6, 9, 10]
    assert batch.packed_seq_params.max_seqlen_q == 3


# ------------------------------------------------ packed attention without TE (SDPADotProductAttention, THD)
PACKED_HEADS, PACKED_DIM = 4, 8
PACKED_ROWS = [1, 17, 3, 1, 40, 2]  # very different lengths, two of 1 token; then a padding tail
PACKED_LENGTH = 120


def attention_module(groups: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models.sdpa_attention import SDPADotProductAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=PACKED_HEADS * PACKED_DIM, num_attention_heads=PACKED_HEADS,
        num_query_groups=groups, kv_channels=PACKED_DIM, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        params_dtype=torch.float32)
    return SDPADotProductAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                   attention_type="self")


def packed_attention_inputs(groups: int):
    """THD queries, keys, values and an output gradient of the packed rows, and the rows' boundaries."""
    starts = [0]
    for length in PACKED_ROWS:
        starts.append(starts[-1] + length)
    starts = with_padding_segments(starts, PACKED_LENGTH)
    gen = torch.Generator().manual_seed(groups)
    q, k, v = (torch.randn(PACKED_LENGTH, heads, PACKED_DIM, generator=gen)
               for heads in (PACKED_HEADS, groups, groups))
    dout = torch.randn(PACKED_LENGTH, PACKED_HEADS * PACKED_DIM, generator=gen)
    return starts, q, k, v, dout


def attend(module, q, k, v, dout, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, None, **kwargs)
    (out * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The textbook reference for one sequence: softmax(q k^T * scale, causal) v, keys and values repeated per query
    group; [s, np, hn] queries -> [s, np * hn]."""
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    causal = torch.ones(q.size(0), q.size(0), dtype=torch.bool).triu(1)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(causal, float("-inf")).softmax(-1), v).flatten(1)


@pytest.mark.parametrize("groups", [2, 4], ids=["gqa", "mha"])
def test_packed_attention_equals_one_attention_per_sequence(tensor_parallel_group, groups):
    """SDPADotProductAttention on a THD pack (one SDPA over the rows padded to the longest) gives the output and
    q/k/v gradients of causal attention run on each row alone, to 1e-5 in fp32."""
    starts, q, k, v, dout = packed_attention_inputs(groups)
    params = attention_inputs(starts, thd=True)["packed_seq_params"]
    module = attention_module(groups)
    packed = attend(module, q, k, v, dout, packed_seq_params=params)

    def per_sequence(q, k, v, *_):
        return torch.cat([causal_attention(q[a:b], k[a:b], v[a:b], module.softmax_scale)
                          for a, b in zip(starts[:-1], starts[1:])])

    expected = attend(per_sequence, q, k, v, dout)
    assert float(expected[1].abs().max()) > 0.1 and float(expected[2].abs().max()) > 0.1  # not trivially zero
    for got, want in zip(packed, expected):
        assert got.shape == want.shape
        assert float((got - want).abs().max()) < 1e-5


def test_packed_attention_reads_nothing_from_the_device_and_runs_one_sdpa_per_length_class(tensor_parallel_group,
                                                                                           monkeypatch):
    """The layer's forward and backward over 8 packed segments: no value read back to the host (each a sync per
    layer on GPUs) and one SDPA launch forward and one backward per length class, not one per sequence."""
    import torch.nn.functional as F

    starts, q, k, v, dout = packed_attention_inputs(2)
    params = attention_inputs(starts, thd=True)["packed_seq_params"]
    module = attention_module(2)
    calls = []

    def counted_sdpa(*args, _original=F.scaled_dot_product_attention, **kwargs):
        calls.append(1)
        return _original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted_sdpa)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    with host_syncs() as reads:
        out = module(q, k, v, None, packed_seq_params=params)
        backward_nodes = sdpa_backward_nodes(out.grad_fn)
        (out * dout).sum().backward()
    classes = len(params.padded_segments.shapes)
    assert len(starts) - 1 == 8 and reads == [] and 1 < classes < 8
    assert len(calls) == classes and backward_nodes == classes
    assert q.grad is not None and float(q.grad.abs().max()) > 0


def test_length_classes_pad_fewer_than_twice_the_tokens_and_map_every_token_back():
    """PaddedSegments of a long-tailed GRPO pack (12 to 1,200 tokens; one padded batch of the longest would be ~5x
    the tokens): every class pads to less than twice its tokens, each token's output slot reads that token, and
    the padding of a segment reads its own tokens only."""
    from megatron_rl.models.packed_sequences import padded_segments

    gen = torch.Generator().manual_seed(3)
    lengths = (12 * torch.exp(torch.rand(60, generator=gen) * math.log(100))).long().tolist()
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    plan = padded_segments(starts)
    padded = sum(count * length for count, length in plan.shapes)
    assert padded < 2 * starts[-1] < len(lengths) * max(lengths) / 2
    assert len(plan.shapes) <= 1 + math.ceil(math.log2(max(lengths)))
    assert torch.equal(plan.gather[plan.scatter], torch.arange(starts[-1]))
    segment_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    start = 0
    for count, length in plan.shapes:
        slots = plan.gather[start:start + count * length].view(count, length)
        assert (segment_of[slots] == segment_of[slots[:, :1]]).all()  # padding reads its own segment
        start += count * length


def sdpa_backward_nodes(node) -> int:
    """The attention backward kernels in the autograd graph from ``node``."""
    seen, stack, found = set(), [node], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += "ScaledDotProduct" in type(node).__name__ or "Attention" in type(node).__name__
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


@pytest.mark.parametrize("overrides, words", [
    (["algorithm.name=rm"], "algorithm.name=rm does not pack its rows"),
    (["algorithm.name=sft"], "algorithm.name=sft does not pack its rows"),
    (["parallel.cp=2"], "parallel.micro_batch_tokens=64 with parallel.cp=2"),
])
def test_the_launch_check_refuses_what_does_not_pack(overrides, words):
    cfg = load_config(overrides=["parallel.micro_batch_tokens=64", *overrides])
    with pytest.raises(ConfigError, match=words):
        check_layout(cfg, load_model_shape(cfg.model.name))


def test_a_packed_grpo_job_needs_no_micro_batch_size_that_divides_the_batch():
    cfg = load_config(overrides=["parallel.micro_batch_tokens=64", "parallel.micro_batch_size=5"])
    assert check_layout(cfg, load_model_shape(cfg.model.name)) == 2


# ------------------------------------------------------------------------------------ real Megatron, gloo
@pytest.fixture(scope="module")
def packing_checks(tmp_path_factory):
    """Per layout, each rank's results of tests/dist/packing_check.py (both layouts in one launch)."""
    ranks = torchrun_check("packing_check.py", tmp_path_factory.mktemp("packing"), "--layouts", "tp2,pp2_vpp2")
    return {layout: [rank[layout] for rank in ranks] for layout in ("tp2", "pp2_vpp2")}


@pytest.mark.parametrize("layout", ["tp2", "pp2_vpp2"])
def test_packed_grpo_steps_equal_padded_ones(packing_checks, layout):
    """Two engines with the same weights take two GRPO steps on the same 24 rows (3..30 tokens): one on 6 padded
    micro-batches, one on 8 packed ones of at most 40 tokens, as the trainer packs them (THD into SDPA's
    per-sequence attention); the block-diagonal mask gives the same log-probs. Log-probs agree within 1e-6, losses
    and grad norms within fp32 rounding (1e-6 at the first step), and after two Adam steps the weights within 1e-5
    (Adam's eps is 1e-4 there: at 1e-8 it turns rounding-level differences of near-zero gradients into steps of up
    to lr). At PP2·VPP2 the first step's ratio is 1: it was not, before batched p2p went off under interleaving
    (megatron_rl/models/builder.py)."""
    ranks = packing_checks[layout]
    last = [r for r in ranks if r["rows_compared"]]
    assert last and all(r["rows_compared"] == 24 and r["max_logprob_diff"] < 1e-6 for r in last)
    # the trainer's path: THD into SDPA's per-sequence attention; the block-diagonal mask gives the same log-probs
    assert all(r["thd"] and r["mask_vs_thd_diff"] < 1e-6 for r in last)
    for rank in ranks:
        assert rank["microbatches"] == 8 and rank["packed_length"] <= 40
        assert rank["figures"]["train_tokens"] < rank["figures"]["real_tokens"] * 1.25
        for step, rel in zip(rank["steps"], (1e-6, 1e-4)):  # step 2 starts from weights Adam moved apart a little
            a, b = step["padded"], step["packed"]
            assert b["loss"] == pytest.approx(a["loss"], rel=rel, abs=1e-7)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel)
        first = rank["steps"][0]
        for side in ("padded", "packed"):
            assert first[side]["ratio_min"] == pytest.approx(1.0, abs=1e-6)
            assert first[side]["ratio_max"] == pytest.approx(1.0, abs=1e-6)
        assert rank["max_param_diff"] < 1e-5


def test_the_planner_plans_packed_training_at_the_mean_row():
    """The shipped 70B GRPO job with a long tail (responses up to 2,048 tokens, 512 on average, prompts of 1,024):
    padded, every row trains at 3,072 tokens; packed, at the mean row's 1,536 (x PACKING_SLACK), so the
    log-prob passes and optimizer steps take about half the time, and generation is unchanged."""
    from launcher.job import plan_job
    from launcher.planner.rl_step import PACKING_SLACK

    from megatron_rl.spec.config.loader import given_keys

    plans = {}
    config = REPO_ROOT / "configs" / "grpo_llama70b.yaml"
    for name, extra in (("padded", []), ("packed", ["parallel.micro_batch_tokens=16384"])):
        if name == "packed":  # the padded plan's model-parallel sizes: the same generation
            extra += [f"parallel.{key}={plans["padded"].layout.value(key)}" for key in ("tp", "pp", "vpp", "cp")]
        cfg = load_config(config, overrides=extra, allow_missing=True)
        plans[name] = plan_job(cfg, load_model_shape(cfg.model.name), given=given_keys(config, extra),
                               mean_response_length=512, top_k=0).estimate
    padded, packed = plans["padded"].time_terms.rl_parts, plans["packed"].time_terms.rl_parts
    assert packed["generation_decode"] == padded["generation_decode"]
    ratio = packed["logprob_passes"] / padded["logprob_passes"]
    assert 0.4 < ratio < 1536 * PACKING_SLACK / 3072 + 0.05, ratio
    assert plans["packed"].step_time_s < 0.75 * plans["padded"].step_time_s
