"""The paged engine's pieces in process: the paged attention reference against dense causal attention, what it
refuses, its host syncs (none) and peak memory (the K/V it reads, no copy per head), the block pool's reference
counts, the counter-based sampling draws, and the decode graphs' buffers and capture.

The engine itself runs on real Megatron models under torchrun in tests/test_generation.py (TP1 x DP2, TP2,
PP2 x VPP2, MLA with MoE; greedy, sampled, stop tokens, caps and budgets small enough to evict, against the
training forward).

Run: ``.venv/bin/python -m pytest tests/test_paged_engine.py -q``
"""

from __future__ import annotations

import contextlib
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers import torchrun_check
from megatron_rl.generation import paged_attention
from megatron_rl.generation.paged import BlockPool, LayerCache
from megatron_rl.generation.paged_attention import check_paged, reference_kvcache, reference_mla, reference_varlen
from megatron_rl.generation.runner import LONG_INPUTS, send_step
from megatron_rl.generation.sampling import position_draws
from megatron_rl.runtime.probes import PeakBytes, host_syncs

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One row: ``q`` [Lq, H, D] against ``k``/``v`` [Lk, Hk, D], query i seeing keys 0 .. Lk - Lq + i (by hand,
    with the KV heads repeated)."""
    lq, lk = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
    allowed = torch.arange(lk).view(1, -1) <= (lk - lq + torch.arange(lq)).view(-1, 1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def _paged_rows(kv_lens: list[int], seed: int = 0):
    """Random K/V for rows of ``kv_lens`` keys, scattered over shuffled blocks of a pool; returns (k_cache,
    v_cache, block_table, per-row dense K, per-row dense V)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in kv_lens]
    total = sum(blocks) + 3
    order = torch.randperm(total, generator=gen).tolist()
    k_cache = torch.randn(total, BLOCK, KV_HEADS, DIM, generator=gen)  # unused slots hold noise, never read
    v_cache = torch.randn(total, BLOCK, KV_HEADS, DIM, generator=gen)
    table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for row, n in enumerate(kv_lens):
        ids = order[used:used + blocks[row]]
        used += blocks[row]
        table[row, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        dense_k.append(k_cache[ids].flatten(0, 1)[:n])
        dense_v.append(v_cache[ids].flatten(0, 1)[:n])
    return k_cache, v_cache, table, dense_k, dense_v


def test_varlen_reference_equals_dense_causal_attention_on_mixed_rows():
    """A mixed step: a prompt prefill (q = k), a re-prefill spanning blocks, decode rows (q = 1) and a chunk
    (q < k): each row's output equals dense attention with the bottom-right causal mask; tokens past the last
    row's queries come back as zeros."""
    q_lens, kv_lens = [7, 1, 3, 1, 9], [7, 5, 10, 1, 9]
    k_cache, v_cache, table, dense_k, dense_v = _paged_rows(kv_lens)
    tokens = sum(q_lens) + 2  # two padding tokens at the end
    q = torch.randn(tokens, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    cu_q = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.cumsum(torch.tensor(kv_lens), 0)), dtype=torch.int32)
    out = reference_varlen(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(kv_lens), block_table=table)
    for row, (start, stop) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        torch.testing.assert_close(out[start:stop], _dense(q[start:stop], dense_k[row], dense_v[row]),
                                   rtol=1e-5, atol=1e-5)
    assert (out[sum(q_lens):] == 0).all()


def test_kvcache_reference_equals_dense_attention_and_zeroes_padding_rows():
    kv_lens = [5, 12, 1, 0, 8]
    k_cache, v_cache, table, dense_k, dense_v = _paged_rows([max(n, 1) for n in kv_lens], seed=2)
    q = torch.randn(len(kv_lens), 1, HEADS, DIM, generator=torch.Generator().manual_seed(3))
    out = reference_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(kv_lens, dtype=torch.int32),
                            block_table=table)
    for row, n in enumerate(kv_lens):
        if n == 0:
            assert (out[row] == 0).all()
        else:
            torch.testing.assert_close(out[row], _dense(q[row], dense_k[row][:n], dense_v[row][:n]),
                                       rtol=1e-5, atol=1e-5)


def test_the_reference_agrees_with_sdpa_for_one_full_prompt():
    """Independent of the hand-written dense attention: torch's own causal SDPA on one contiguous row."""
    k_cache, v_cache, table, dense_k, dense_v = _paged_rows([11], seed=4)
    q = torch.randn(11, HEADS, DIM, generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 11], dtype=torch.int32)
    out = reference_varlen(q, k_cache, v_cache, cu, cu, 11, 11, block_table=table)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), dense_k[0].transpose(0, 1),
                                              dense_v[0].transpose(0, 1), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_the_mla_reference_is_expanded_attention_through_the_latent():
    """Absorbed multi-latent attention over a paged latent cache (rows mixing prefill, decode and a chunk) equals
    expanded attention computed by hand: per head, keys ``[W_UK c, k_pe]`` and values ``W_UV c`` from the latent
    ``c`` and the shared rope key, queries ``[q_nope, q_pe]``, the bottom-right causal mask; the absorbed query is
    ``[W_UK^T q_nope, q_pe]`` and the output ``W_UV`` of the kernel's latent output."""
    rank, rope, nope, v_dim, heads, block = 12, 4, 8, 6, 3, 4
    gen = torch.Generator().manual_seed(6)
    q_lens, kv_lens = [5, 1, 3], [5, 9, 7]
    blocks = [-(-n // block) for n in kv_lens]
    order = torch.randperm(sum(blocks) + 2, generator=gen).tolist()
    cache = torch.randn(sum(blocks) + 2, block, 1, rank + rope, generator=gen)
    table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
    for row, count in enumerate(blocks):
        table[row, :count] = torch.tensor(order[sum(blocks[:row]):sum(blocks[:row + 1])], dtype=torch.int32)
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=gen), torch.randn(heads, v_dim, rank, generator=gen)
    q_nope, q_pe = torch.randn(sum(q_lens), heads, nope, generator=gen), torch.randn(sum(q_lens), heads, rope,
                                                                                     generator=gen)
    scale = 0.3
    absorbed = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe], dim=-1)
    cu_q = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    latent_out = reference_mla(absorbed, cache, cu_q, torch.tensor(kv_lens, dtype=torch.int32), max(q_lens),
                               max(kv_lens), block_table=table, head_dim_v=rank, softmax_scale=scale)
    out = torch.einsum("thr,hvr->thv", latent_out, w_uv)
    for row, (start, stop) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        ids = table[row, :blocks[row]].long()
        latent = cache[ids].flatten(0, 1)[:kv_lens[row], 0]  # [keys, rank + rope]
        c, k_pe = latent[:, :rank], latent[:, rank:]
        keys = torch.cat([torch.einsum("hdr,kr->khd", w_uk, c), k_pe.unsqueeze(1).expand(-1, heads, -1)], dim=-1)
        values = torch.einsum("hvr,kr->khv", w_uv, c)
        queries = torch.cat([q_nope[start:stop], q_pe[start:stop]], dim=-1)
        lq, lk = stop - start, kv_lens[row]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        allowed = torch.arange(lk).view(1, -1) <= (lk - lq + torch.arange(lq)).view(-1, 1)
        expected = torch.einsum("hqk,khv->qhv", torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1),
                                values)
        torch.testing.assert_close(out[start:stop], expected, rtol=1e-4, atol=1e-4)


def _kernel_case(kernel: str, *, rows: int = 4, heads: int = 16, kv_heads: int = 2, dim: int = 64, keys: int = 256,
                 q_len: int = 1, latent: int = 576, value_dim: int = 512):
    """One call of a reference kernel over ``rows`` rows of ``keys`` keys in shuffled blocks of 16 (``kernel``:
    "decode", "mixed" or "mla"; ``q_len`` queries per row): (the call, K/V or latent bytes it reads, bytes of its
    queries, output and scores)."""
    gen = torch.Generator().manual_seed(11)
    block = 16
    table = torch.randperm(rows * keys // block, generator=gen).view(rows, -1).to(torch.int32)
    lens = torch.full((rows,), keys, dtype=torch.int32)
    cu_q = torch.arange(rows + 1, dtype=torch.int32) * q_len
    size = 4  # fp32
    scores = rows * heads * q_len * keys * size
    if kernel == "mla":
        cache = torch.randn(table.numel(), block, 1, latent, generator=gen)
        q = torch.randn(rows * q_len, heads, latent, generator=gen)
        call = lambda: reference_mla(q, cache, cu_q, lens, q_len, keys, block_table=table,  # noqa: E731
                                     head_dim_v=value_dim, softmax_scale=0.1)
        return call, rows * keys * latent * size, q.numel() * size + rows * q_len * heads * value_dim * size + scores
    k_cache, v_cache = (torch.randn(table.numel(), block, kv_heads, dim, generator=gen) for _ in range(2))
    if kernel == "decode":
        q = torch.randn(rows, q_len, heads, dim, generator=gen)
        call = lambda: reference_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)  # noqa: E731
    else:
        q = torch.randn(rows * q_len, heads, dim, generator=gen)
        call = lambda: reference_varlen(q, k_cache, v_cache, cu_q, cu_q // q_len * keys, q_len, keys,  # noqa: E731
                                        block_table=table)
    return call, 2 * rows * keys * kv_heads * dim * size, 2 * q.numel() * size + scores


@pytest.mark.parametrize("kernel, q_len", [("decode", 1), ("mixed", 32), ("mla", 1), ("mla", 32)])
def test_the_reference_kernels_hold_the_kv_they_read_not_a_copy_per_head(kernel, q_len):
    """Peak extra memory of a kernel call <= 3 x the K/V (MLA: latent) bytes it reads + 3 x the bytes of its
    queries, output and scores, on SDPA's math backend (CUDA's when no fused kernel takes the call: everything is
    materialised there). The gather is 1x, the math backend's scaled and contiguous K/V at most 2x; K/V copied
    per query head would be 8x (GQA, 16 heads over 2) and the latent per head 16x."""
    call, kv_bytes, other_bytes = _kernel_case(kernel, q_len=q_len)
    with sdpa_kernel(SDPBackend.MATH), PeakBytes() as memory:
        call()
    assert memory.peak <= 3 * kv_bytes + 3 * other_bytes, (memory.peak / kv_bytes, other_bytes / kv_bytes)


@pytest.mark.parametrize("kernel", ["decode", "mixed", "mla"])
def test_the_reference_kernels_read_nothing_back_to_the_host(monkeypatch, kernel):
    """No host sync in a kernel (each would stop a GPU's queue on every layer of every step): key lengths come from
    the table's width, and packed rows are scattered back without boolean indexing. The counter itself sees a
    scalar read, a boolean mask's indexing and ``tolist``."""
    call, _, _ = _kernel_case(kernel, rows=3, heads=4, kv_heads=2, dim=16, keys=32, q_len=1 if kernel == "decode"
                              else 5, latent=24, value_dim=16)
    with host_syncs() as syncs:
        call()
    assert syncs == []
    values = torch.arange(4.0)
    with host_syncs() as seen:
        int(values.max()), values[values > 1], values.tolist()
    assert seen == ["aten._local_scalar_dense.default", "aten.index.Tensor", "tolist"]


def test_flash_attn_runs_half_precision_caches_only(monkeypatch):
    """flash-attn computes in fp16/bf16 only: a GPU with flash-attn gets it for those, the torch reference for an
    fp32 model (flash-attn would refuse it); a CPU always the reference."""
    found = object()
    monkeypatch.setattr(paged_attention, "_flash_kernels", lambda: found)
    cuda = torch.device("cuda")
    assert paged_attention.kernels(cuda, torch.bfloat16) is found
    assert paged_attention.kernels(cuda, torch.float16) is found
    assert paged_attention.kernels(cuda, torch.float32) is paged_attention.REFERENCE
    assert paged_attention.kernels(torch.device("cpu"), torch.bfloat16) is paged_attention.REFERENCE


@pytest.mark.parametrize("case, message", [
    ("block", "multiple of 256"),
    ("head_dim", "head size 260"),
    ("groups", "3 KV heads do not divide 4 query heads"),
    ("table", "int32"),
])
def test_what_the_gpu_kernels_refuse_is_refused(case, message):
    q = torch.zeros(2, HEADS, DIM)
    cache = torch.zeros(4, BLOCK, KV_HEADS, DIM)
    table = torch.zeros(1, 2, dtype=torch.int32)
    flash = False
    if case == "block":
        flash = True
    elif case == "head_dim":
        q, cache = torch.zeros(2, HEADS, 260), torch.zeros(4, BLOCK, KV_HEADS, 260)
    elif case == "groups":
        cache = torch.zeros(4, BLOCK, 3, DIM)
    else:
        table = table.long()
    with pytest.raises(ValueError, match=message):
        check_paged(q, cache, cache, table, flash=flash)
    check_paged(torch.zeros(2, HEADS, DIM), torch.zeros(4, 256, KV_HEADS, DIM), torch.zeros(4, 256, KV_HEADS, DIM),
                torch.zeros(1, 2, dtype=torch.int32), flash=True)  # what flash-attn takes passes


def test_block_pool_counts_references_and_frees_shared_blocks_last():
    layers = {1: LayerCache(kv_heads=KV_HEADS, head_dim=DIM), 3: LayerCache(kv_heads=KV_HEADS, head_dim=DIM)}
    pool = BlockPool(layers, num_blocks=3, block_tokens=BLOCK, dtype=torch.float32, device=torch.device("cpu"))
    assert pool.nbytes == 3 * BlockPool.block_bytes(layers, block_tokens=BLOCK, dtype=torch.float32)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert (a, b, c) == (0, 1, 2) and pool.take() is None and pool.most_taken == 3
    pool.caches[3][0][a, :2] = 5.0
    pool.copy(a, c, 2)
    assert (pool.caches[3][0][c, :2] == 5.0).all() and (pool.caches[3][0][c, 2:] == 0).all()
    pool.share(a)  # a second completion of the prompt holds block a
    pool.release([a, b])
    assert pool.taken == 2 and pool.take() == b
    pool.release([a])
    assert pool.take() == a
    pool.release([a, b, c])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a])


def _scheduler(num_blocks: int, prompts: list, *, max_new_tokens: int = 8):
    """A scheduler over a pool of ``num_blocks`` blocks of BLOCK tokens, its prompts' rows grouped as a GRPO call
    groups them."""
    from megatron_rl.generation.block_manager import BlockManager
    from megatron_rl.generation.scheduler import Scheduler
    from megatron_rl.generation.sequence import Sequence, group_sequences

    pool = BlockPool({1: LayerCache(kv_heads=KV_HEADS, head_dim=DIM)}, num_blocks=num_blocks, block_tokens=BLOCK,
                     dtype=torch.float32, device=torch.device("cpu"))
    rows = [Sequence.of_prompt(p, index=i, max_new_tokens=max_new_tokens, max_total_tokens=1 << 62, seed=0, request=i)
            for i, p in enumerate(prompts)]
    counters = {"admitted": 0, "evictions": 0}
    scheduler = Scheduler(group_sequences(rows, share_prefill=True), blocks=BlockManager(pool), budget=num_blocks,
                          max_concurrent=None, counters=counters)
    return scheduler, rows, pool


def test_a_group_shares_its_prompt_blocks_from_admission_and_copies_only_the_partial_one():
    """Three completions of a 6-token prompt (blocks of 4): admission gives the lead the prompt's 2 blocks and each
    other member the lead's full block (shared, reference count 3) and a block of its own for the partial one; only
    the lead is fed, and after its prefill the members' own blocks hold the lead's partial block."""
    scheduler, rows, pool = _scheduler(8, [[1, 2, 3, 4, 5, 6]] * 3)
    step = scheduler.schedule(ready=lambda row: True)
    lead, *members = rows
    assert [group.rows for group in step.admitted] == [rows] and step.fed == [lead]
    assert all(m.blocks[0] == lead.blocks[0] and m.blocks[1] != lead.blocks[1] for m in members)
    assert pool.refs[lead.blocks[0]] == 3 and pool.taken == 4
    pool.caches[1][0][lead.blocks[1], :2] = 7.0  # the lead's prefill wrote its partial block
    scheduler.blocks.copy_prompt_tail(lead, members)
    assert all((pool.caches[1][0][m.blocks[1], :2] == 7.0).all() for m in members)
    for row in rows:
        scheduler.finish(row)
    assert pool.taken == 0 and pool.refs == [0] * 8


def test_the_newest_row_is_preempted_when_a_row_needs_a_block_and_none_is_free():
    """Two rows of 4 tokens in a pool of 3 blocks: when both grow into a second block, the older one gets the last
    free block and the newer one is preempted (its block returned), waiting at the head of the queue with nothing
    cached; it is admitted again, whole, once a row ends."""
    scheduler, (old, new), pool = _scheduler(3, [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert scheduler.schedule(ready=lambda row: True).fed == [old, new]
    for row in (old, new):
        row.cached = len(row.tokens)
        row.tokens.append(9)
    step = scheduler.schedule(ready=lambda row: True)
    assert step.fed == [old] and len(old.blocks) == 2 and scheduler.running == [old]
    assert new.blocks == [] and new.cached == 0 and scheduler.waiting[0].rows == [new]
    assert scheduler.counters["evictions"] == 1 and pool.taken == 2
    old.finish = "stop"
    scheduler.finish(old)
    step = scheduler.schedule(ready=lambda row: True)
    assert step.fed == [new] and new.uncached == 5 and len(new.blocks) == 2


def _reply_joins_at(*, reply_steps: int, ready_at) -> int:
    """The step at which a multi-turn reply joins its row: the turn ends before step 1, its environment step's
    Future is done at step ``ready_at`` (``"late"``: by a thread 50 ms after the engine starts waiting for it)."""
    import threading
    from concurrent.futures import Future

    from megatron_rl.generation.sequence import Sequence
    from megatron_rl.generation.turns import TurnHandover

    made: list = []
    handover = TurnHandover(lambda place, turn, finish: made.append(Future()) or made[-1], settle_replies=None,
                            replies_may_wait=True, reply_steps=reply_steps, end=lambda row: None)
    row = Sequence(index=0, tokens=[1, 2, 3], prompt_len=1, max_len=50, turn_start=1, turn_finish="stop")
    handover.ended.append(row)
    for step in range(1, 8):
        handover.turn_over()
        if ready_at == "late" and step == 1:
            threading.Timer(0.05, made[0].set_result, args=([7, 8],)).start()
        elif ready_at == step:
            made[0].set_result([7, 8])
        handover.take_replies([row])
        if row.reply is None:
            assert row.tokens == [1, 2, 3, 7, 8] and row.turn_start == 5 and row.finish is None
            return step
    raise AssertionError("the reply never joined")


def test_a_reply_joins_its_row_at_a_fixed_step_whenever_its_thread_finishes():
    """With reply_steps 2 (environment.reply_steps) the reply of a turn ended before step 1 joins at step 3
    whether its thread finished at once, at step 3, or only while the engine waited for it there: every step's rows
    (and the log-probs computed in its batch) do not depend on the environment's timing. With 0 it joins at the
    first step it is ready."""
    assert {_reply_joins_at(reply_steps=2, ready_at=ready) for ready in (1, 2, 3, "late")} == {3}
    assert [_reply_joins_at(reply_steps=0, ready_at=ready) for ready in (1, 2, 4)] == [1, 2, 4]


def test_position_draws_do_not_depend_on_the_batch_around_a_row():
    rows, positions = torch.tensor([0, 5, 9, 5]), torch.tensor([3, 3, 3, 4])
    together = position_draws(11, rows, positions, 50)
    alone = torch.cat([position_draws(11, rows[i:i + 1], positions[i:i + 1], 50) for i in range(4)])
    assert torch.equal(together, alone)
    assert not torch.equal(together[1], together[3])  # same request, next position: new draws
    assert not torch.equal(together, position_draws(12, rows, positions, 50))  # another seed
    assert not torch.equal(position_draws(2**40 + 11, rows, positions, 50), together)  # the seed's high bits count


def test_position_draws_are_exponential():
    """Mean 1 and P(E > 1) = e^-1 within 5 standard errors over 200,000 draws."""
    draws = position_draws(3, torch.arange(400), torch.full((400,), 7), 500).flatten()
    n = draws.numel()
    assert abs(float(draws.mean()) - 1.0) < 5 / math.sqrt(n)
    tail = float((draws > 1.0).float().mean())
    assert abs(tail - math.exp(-1)) < 5 * math.sqrt(math.exp(-1) * (1 - math.exp(-1)) / n)
    assert float(draws.min()) > 0


def test_sampling_with_position_draws_follows_the_tempered_softmax():
    """choose_tokens on position_draws races (the paged engine's sampling): token frequencies within 5 standard
    deviations of softmax(logits / T) over 40,000 rows; padded vocabulary rows never drawn."""
    from megatron_rl.generation.sampling import SamplingParams, choose_tokens

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 9.0, 9.0])
    n, real, temperature = 40000, 6, 0.7
    race = position_draws(21, torch.arange(n), torch.full((n,), 4), real)
    tokens = choose_tokens(logits.expand(n, -1), vocab_size=real, params=SamplingParams(temperature=temperature),
                           race=race).tokens
    expected = torch.softmax(logits[:real] / temperature, dim=-1).tolist()
    counts = torch.bincount(tokens, minlength=len(logits)).tolist()
    assert counts[real:] == [0, 0]
    for token, p in enumerate(expected):
        assert abs(counts[token] / n - p) < 5 * math.sqrt(p * (1 - p) / n), (token, counts[token] / n, p)


def test_decode_graph_buckets_and_their_fixed_buffers():
    """A decode step of n rows runs at the smallest bucket >= n (None past the largest, or past the part's rows);
    every bucket's inputs are views of one set of buffers (a captured graph reads fixed addresses)."""
    from megatron_rl.generation.graphs import GRAPH_ROWS, DecodeGraphs, bucket_rows

    assert [bucket_rows(n) for n in (1, 3, 8, 9, 25, 512, 513)] == [1, 4, 8, 16, 32, 512, None]
    assert all(b / a <= 2 for a, b in zip(GRAPH_ROWS, GRAPH_ROWS[1:]))
    graphs = DecodeGraphs(rows=20, width=5, device=torch.device("cpu"))
    assert graphs.top == 24 and graphs.bucket(20) == 24 and graphs.bucket(25) is None
    small, large = graphs.inputs(4), graphs.inputs(24)
    for name, view in small.items():
        assert view.data_ptr() == large[name].data_ptr(), name
    assert small["table"].shape == (4, 5) and small["cu_q"].tolist() == [0, 1, 2, 3, 4]
    assert small["last"].tolist() == [0, 1, 2, 3]


def keys_read(monkeypatch) -> list:
    """The number of keys each gather of the paged kernels reads, as they run."""
    read, gathered = [], paged_attention._gathered
    monkeypatch.setattr(paged_attention, "_gathered",
                        lambda cache, table, keys: read.append(keys) or gathered(cache, table, keys))
    return read


def test_decode_steps_read_the_whole_table_without_a_host_sync(monkeypatch):
    """The decode kernel reads the longest row's keys where the host marked them on the lengths (an eager engine
    step), else its table's whole width: the table cut to the longest row's blocks, and the steps of
    generation.cuda_graphs
    (DecodeGraphs.run: eager on a CPU, captured or replayed on a GPU) and gpu_check's bucketed eager run of the same
    steps, which both read the fixed wide table, so a replay and its eager run read the same keys (bf16 results
    then agree bitwise in gpu_check's part 4c). No host sync; extra columns of any block ids change nothing."""
    from megatron_rl.generation.graphs import DecodeGraphs

    kv_lens = [5, 11, 1]  # the longest row ends inside its third block
    k_cache, v_cache, table, _, _ = _paged_rows(kv_lens, seed=6)
    wide = torch.cat([table, torch.randint(0, k_cache.shape[0], (len(kv_lens), 4), dtype=torch.int32)], dim=1)
    q = torch.randn(len(kv_lens), 1, HEADS, DIM, generator=torch.Generator().manual_seed(7))
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    read = keys_read(monkeypatch)

    def step(block_table):
        return reference_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=block_table)

    with host_syncs() as syncs:
        eager = step(table)
        assert read == [3 * BLOCK] * 2  # K and V: the cut table's 3 blocks, 12 keys for the longest row's 11
        read.clear()
        lens.host_max = 11  # an eager engine step's lengths carry their longest (PagedContext.set_step)
        bounded = step(wide)
        assert read == [11] * 2
        del lens.host_max
        read.clear()
        replayed = DecodeGraphs(rows=4, width=wide.shape[1], device=torch.device("cpu")).run(4, lambda: step(wide))
        bucketed = step(wide)
    assert read == [wide.shape[1] * BLOCK] * 4 and syncs == []
    torch.testing.assert_close(replayed, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bounded, eager, rtol=1e-6, atol=1e-6)
    assert torch.equal(replayed, bucketed)


class _FakeCapture:
    """Just enough of torch.cuda's stream and graph API for DecodeGraphs.run's capture branch on a CPU."""

    def __init__(self):
        self.graph_kwargs, self.replays = None, 0
        fake = self

        class Stream:
            def __init__(self, *args, **kwargs): pass
            def wait_stream(self, other): pass

        class CUDAGraph:
            def replay(self): fake.replays += 1

        @contextlib.contextmanager
        def graph(cuda_graph, **kwargs):
            fake.graph_kwargs = kwargs
            yield

        self.patches = {"Stream": Stream, "CUDAGraph": CUDAGraph, "graph": graph,
                        "stream": lambda stream: contextlib.nullcontext(),
                        "current_stream": lambda device=None: Stream()}


def test_decode_graphs_capture_thread_local_and_read_what_eager_reads(monkeypatch):
    """The capture uses capture_error_mode="thread_local" (other threads' CUDA calls, e.g. environment steps or a
    weight receiver, would invalidate a global-mode capture); warm-up and capture run the decode kernel on the fixed
    buffers and read the keys the same step run eagerly reads (the table's whole width); a replay runs nothing."""
    from megatron_rl.generation.graphs import DecodeGraphs

    fake = _FakeCapture()
    for name, value in fake.patches.items():
        monkeypatch.setattr(torch.cuda, name, value)
    graphs = DecodeGraphs(rows=4, width=3, device=torch.device("cpu"))
    graphs.pool = object()  # as on a GPU: capture, then replay
    buffers = graphs.inputs(4)
    k_cache = v_cache = torch.randn(6, BLOCK, KV_HEADS, DIM)
    q = torch.randn(4, 1, HEADS, DIM)
    read = keys_read(monkeypatch)

    def forward():
        return reference_kvcache(q, k_cache, v_cache, cache_seqlens=buffers["k_lens"], block_table=buffers["table"])

    logits = graphs.run(4, forward)
    assert graphs.run(4, forward) is logits
    assert fake.graph_kwargs == {"pool": graphs.pool, "capture_error_mode": "thread_local"}
    forward()  # the same step, eager
    assert read == [3 * BLOCK] * 6 and fake.replays == 2  # warm-up, capture, eager (K and V); replays run nothing


def test_rotary_tables_read_while_capturing_stay_referenced(monkeypatch):
    """A captured graph bakes in the address of the rotary table it read; Megatron keeps those tables in an LRU of
    32, so the context holds each table read under capture for as long as it (and its graphs) lives. The rotation is
    Megatron's unfused one to the bit, its cos and sin made once a step for every layer, and again inside a capture
    (a replay must compute them from its own step's positions, not reuse the warm-up's)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_rl.generation import paged
    from megatron_rl.generation.paged import BlockPool, PagedContext

    pool = BlockPool({1: LayerCache(kv_heads=KV_HEADS, head_dim=DIM)}, num_blocks=4, block_tokens=BLOCK,
                     dtype=torch.float32, device=torch.device("cpu"))
    context = PagedContext(pool, max_sequence_length=8, device=torch.device("cpu"))
    host = {name: [] for name in LONG_INPUTS} | dict(ids=[5], positions=[2], slot_block=[0], slot_offset=[2], last=[0],
                                                    cu_q=[0, 1], cu_k=[0, 3], k_lens=[3], table=[0])
    context.set_step(send_step(host, width=1, device=torch.device("cpu")), max_q=1, max_k=3)
    config = types.SimpleNamespace(rope_type="rope", rotary_interleaved=False)
    table = torch.randn(8, 1, 1, DIM)
    query = torch.randn(1, 1, HEADS, DIM)
    eager = context.apply_rotary_emb_query(query, table, config)
    assert torch.equal(eager, _apply_rotary_pos_emb_bshd(query, table[torch.tensor([2])], rotary_interleaved=False))
    assert torch.equal(context.apply_rotary_emb_key(query, table, config), eager) and len(context._rope) == 1
    assert context.graph_tables == []
    monkeypatch.setattr(paged, "capturing", lambda: True)
    assert torch.equal(context.apply_rotary_emb_query(query, table, config), eager) and len(context._rope) == 2
    assert len(context.graph_tables) == 1 and context.graph_tables[0] is table


def test_a_decode_step_reads_back_to_the_host_once_whatever_the_layer_count(tmp_path):
    """Host reads (syncs on a GPU: ``item``, ``tolist``, ``int()``, ``bool()``, ``nonzero``, boolean indexing) per
    decode step of the engine on real Megatron models of 2 and 8 layers (tests/dist/engine_syncs.py: top-p
    sampling, a GRPO group sharing its prompt, rows taking blocks as they grow): the same count for both, at most
    3. The step's inputs reach the device in one copy, the choice comes back in one (``StepChoice.host_lists``),
    and neither the kernels nor the sampling read anything."""
    result, = torchrun_check("engine_syncs.py", tmp_path, nproc=1)
    assert len(result["2"]) == len(result["8"]) == 11, result
    assert set(result["2"]) == set(result["8"]) and max(result["8"]) <= 3, result


def test_the_engine_config_is_built_once_from_the_generation_section_and_refuses_bad_values():
    """EngineConfig.from_generation carries every engine setting of the job's generation section (the tokenizer's
    eos and encoded stops beside them); a bad value is refused naming its field."""
    from megatron_rl.generation.config import EngineConfig
    from megatron_rl.spec.config.schema import GenerationConfig

    gen = GenerationConfig(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=5, stop=["x"], max_concurrent=3,
                           kv_memory_gib=0.5, kv_block_tokens=16, cuda_graphs=True)
    config = EngineConfig.from_generation(gen, vocab_size=100, eos_id=2, stop_sequences=[[7, 8]], record_routes=True)
    assert (config.max_new_tokens, config.temperature, config.top_p, config.top_k, config.max_concurrent,
            config.kv_memory_gib, config.kv_block_tokens, config.cuda_graphs) == (12, 0.7, 0.9, 5, 3, 0.5, 16, True)
    assert config.stop_ids == [2] and config.stop_sequences == ((7, 8),) and config.record_routes
    assert config.kv_memory_bytes == 2**29
    for field, value in (("max_new_tokens", 0), ("kv_block_tokens", 0), ("max_concurrent", 0), ("reply_steps", -1),
                         ("kv_memory_gib", 0.0)):
        with pytest.raises(ValueError, match=field):
            EngineConfig(vocab_size=100, **{"max_new_tokens": 4, field: value})
