"""Colocated generation: sampling maths in process; KV-cache decoding on real Megatron engines under torchrun.

Run: ``.venv/bin/python -m pytest tests/test_generation.py -q`` (about 100 s on 2 cores).

Model variants are checked by this file's own ``--variants-worker`` mode under torchrun (TP=1 and TP=2): for
GQA, QKV bias + QK-norm, MHA + bias linears + tied embeddings and LayerNorm + GeLU without gating, parameters
perturbed so that zero-initialised biases and unit norm weights matter, and prompts of lengths 3..9 batched
together, greedy and sampled (same seed), the engine's log-probs must lie within 1e-5 of the training forward's (``sequence_logprobs``).

The distributed cases run ``tests/dist/gen_check.py`` in two torchrun launches (one per process count; each
layout makes Megatron's parallel state again): TP=1 on 2 processes (so also data parallel: each rank takes every other prompt), TP=2,
PP=2 with 2 virtual stages on a 4-layer variant, and the tiny DeepSeek-V3-like model (multi-latent attention,
whose blocks hold the latent, and MoE with a shared expert). The TP=1 and PP=2 runs train layers built with SDPA
attention (runtime.attention=auto: flash), TP=2 with Megatron's unfused DotProductAttention; the engine attends by
its own kernels (paged_attention.py, paged_mla.py). Each compares its generation with independent references
computed in the same process: step-by-step recomputation without a cache (PP=1 runs), one training-style forward
of the final sequences through Megatron's schedule (all runs), ``sequence_logprobs`` and the model's own loss; and
runs whose tokens must not move with the KV budget, the cap, prompt sharing or the pipeline parts. Tolerance for
log-probs: 1e-5 absolute in fp32 (measured: 4.8e-7, i.e. one float32 ulp at |logp| ~ 4, within a layout; 1.2e-6
between TP=1 and TP=2).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.runtime.phases import (HOST_ALIGNMENT, HostOffload, generation_phase, offload_metrics,
                                         optimizer_tensors)
from megatron_rl.runtime.training import Engine
from helpers import torchrun_check
from megatron_rl.spec.ports import free_port
from megatron_rl.generation.sampling import (SamplingParams, choose_tokens, position_draws, position_keys,
                                             sampling_logits)

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "tests" / "dist" / "gen_check.py"
LOGPROB_TOL = 1e-5


# ----------------------------------------------------------------------------------------------------------
# Sampling: in process, pure torch, against independently computed distributions.

REAL_VOCAB = 6
# 6 real tokens and 2 padded rows whose logits are the largest: they must never be chosen.
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 9.0, 9.0])


def draw(params: SamplingParams, n: int = 40000, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return choose_tokens(LOGITS.expand(n, -1), vocab_size=REAL_VOCAB, params=params, generator=gen)


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def assert_frequencies(tokens: torch.Tensor, expected: list[float]) -> None:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=len(LOGITS)).tolist()
    for token, p in enumerate(expected + [0.0] * (len(LOGITS) - len(expected))):
        if p == 0.0:
            assert counts[token] == 0, f"token {token} has probability 0 but was drawn {counts[token]} times"
        else:
            # 5 standard deviations of a binomial count: a false alarm is ~1e-6 per check
            assert abs(counts[token] / n - p) < 5 * math.sqrt(p * (1 - p) / n), (token, counts[token] / n, p)


def test_sampling_frequencies_follow_the_tempered_softmax():
    temperature = 0.7
    expected = softmax([x / temperature for x in LOGITS[:REAL_VOCAB].tolist()])
    choice = draw(SamplingParams(temperature=temperature))
    assert_frequencies(choice.tokens, expected)
    assert torch.allclose(choice.sampling_logprobs, torch.tensor(expected).log()[choice.tokens], atol=1e-6)


def test_top_k_keeps_the_k_most_likely_tokens():
    expected = softmax(LOGITS[:3].tolist()) + [0.0] * 3
    assert_frequencies(draw(SamplingParams(top_k=3)).tokens, expected)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = softmax(LOGITS[:REAL_VOCAB].tolist())  # cumulative 0.56, 0.77, 0.89, 0.97, ...: p=0.85 keeps 3
    order = sorted(range(REAL_VOCAB), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += probs[i]
        if mass >= 0.85:
            break
    assert kept == [0, 1, 2]
    expected = [probs[i] / mass if i in kept else 0.0 for i in range(REAL_VOCAB)]
    assert_frequencies(draw(SamplingParams(top_p=0.85)).tokens, expected)
    shaped = sampling_logits(LOGITS[:REAL_VOCAB].unsqueeze(0), SamplingParams(top_p=0.85))
    assert torch.isfinite(shaped[0, :3]).all() and torch.isinf(shaped[0, 3:]).all()


def test_top_k_1_and_temperature_0_are_greedy_and_never_pick_padded_rows():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    logits[:, REAL_VOCAB:] += 10.0
    greedy = choose_tokens(logits, vocab_size=REAL_VOCAB, params=SamplingParams(temperature=0.0), generator=None)
    top1 = choose_tokens(logits, vocab_size=REAL_VOCAB, params=SamplingParams(top_k=1, temperature=1.3),
                         generator=torch.Generator().manual_seed(2))
    assert torch.equal(greedy.tokens, logits[:, :REAL_VOCAB].argmax(-1))
    assert torch.equal(top1.tokens, greedy.tokens)
    assert (greedy.sampling_logprobs == 0).all()


def test_policy_logprobs_use_raw_logits_over_the_padded_vocabulary():
    """GRPO's log-probs: temperature 1, normalised over every (padded) row, like the training loss."""
    choice = draw(SamplingParams(temperature=0.5, top_k=2), n=16)
    log_norm = math.log(sum(math.exp(x) for x in LOGITS.tolist()))
    expected = torch.tensor([LOGITS[t].item() - log_norm for t in choice.tokens.tolist()])
    assert torch.allclose(choice.policy_logprobs, expected, atol=1e-6)


def test_same_generator_state_gives_the_same_tokens():
    a, b = draw(SamplingParams(temperature=0.9), n=256, seed=5), draw(SamplingParams(temperature=0.9), n=256, seed=5)
    assert torch.equal(a.tokens, b.tokens)


def test_sampling_params_are_checked():
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# Today's (34ba316) draws and choice, kept verbatim as the reference the fused, blocked sampling must match bit
# for bit: the default job's every-step reward, loss and KL (README) depend on its tokens and log-probs.
def _reference_hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _reference_position_draws(seed, rows: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    mask, device = 0xFFFFFFFF, rows.device
    seeds = torch.as_tensor(seed, dtype=torch.long, device=device).reshape(-1)
    key = _reference_hash32((seeds & mask) ^ _reference_hash32((seeds >> 32) & mask))
    key = _reference_hash32(key ^ (rows.long() & mask))
    key = _reference_hash32(key ^ (positions.long() & mask))
    tokens = _reference_hash32((torch.arange(vocab_size, dtype=torch.long, device=device) + 0x9E3779B9) & mask)
    bits = _reference_hash32(key.unsqueeze(-1) ^ tokens.unsqueeze(0))
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)


def _reference_choose_tokens(logits, *, vocab_size, params, generator=None, race=None):
    logits = logits.float()
    policy = torch.log_softmax(logits, dim=-1)
    real = logits[:, :vocab_size]
    if params.greedy:
        tokens = real.argmax(dim=-1)
        sampled_lp = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    else:
        shaped = sampling_logits(real, params)
        probs = torch.softmax(shaped, dim=-1)
        if race is None:
            race = torch.empty(probs.shape, dtype=probs.dtype, device=probs.device).exponential_(generator=generator)
        race = race.clamp_min(torch.finfo(probs.dtype).tiny)
        tokens = (probs / race).argmax(dim=-1)
        sampled_lp = torch.log_softmax(shaped, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    policy_lp = policy.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, policy_lp, sampled_lp


SAMPLING_CASES = (SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.7),
                  SamplingParams(temperature=1.3, top_k=5), SamplingParams(top_p=0.9),
                  SamplingParams(temperature=0.8, top_k=40, top_p=0.95))


def assert_same_choice(choice, expected, context) -> None:
    for name, got, want in zip(("tokens", "policy_logprobs", "sampling_logprobs"),
                               (choice.tokens, choice.policy_logprobs, choice.sampling_logprobs), expected):
        assert torch.equal(got, want), (name, context)


@pytest.mark.parametrize("block_elements", [1 << 16, 3000])
def test_sampling_is_token_identical_to_the_reference_draws_and_choice(monkeypatch, block_elements):
    """position_draws, choose_tokens(race=...), choose_tokens(race_keys=...) and the generator path against the
    reference above: the same draws, tokens and both log-probs bit for bit, over seeds (one, per-row, past 2**32),
    batch sizes, vocabularies with and without padding, logits with ties (bf16-rounded), greedy and sampled with
    temperature, top-k and top-p; whole batches in one block and split over many (block_elements=3000)."""
    from megatron_rl.generation import sampling

    monkeypatch.setitem(sampling._BLOCK_ELEMENTS, "cpu", block_elements)
    gen = torch.Generator().manual_seed(7)
    for trial, (rows, vocab, padded) in enumerate([(1, 5, 5), (3, 50, 64), (64, 1000, 1000), (37, 4099, 4160)]):
        logits = torch.randn(rows, padded, generator=gen) * 4
        if trial % 2:
            logits = logits.bfloat16()  # ties: the reference keeps every token tied with the k-th
        request, position = torch.randperm(1000, generator=gen)[:rows], torch.randint(0, 4096, (rows,), generator=gen)
        for seed in (0, 11, 2**40 + 11, torch.randint(0, 2**62, (rows,), generator=gen)):
            race = _reference_position_draws(seed, request, position, vocab)
            assert torch.equal(position_draws(seed, request, position, vocab), race), (trial, seed)
            keys = position_keys(seed, request, position)
            for params in SAMPLING_CASES:
                expected = _reference_choose_tokens(logits, vocab_size=vocab, params=params, race=race)
                for given in (dict(race=race), dict(race_keys=keys)):
                    assert_same_choice(choose_tokens(logits, vocab_size=vocab, params=params, **given), expected,
                                       (trial, seed, params, list(given)))
        for params in SAMPLING_CASES:
            expected = _reference_choose_tokens(logits, vocab_size=vocab, params=params,
                                                generator=torch.Generator().manual_seed(trial))
            assert_same_choice(choose_tokens(logits, vocab_size=vocab, params=params,
                                             generator=torch.Generator().manual_seed(trial)), expected, (trial, params))


class FullSizeWrites(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the kernels that write at least one vocabulary row's worth of elements (views excluded): ``passes``
    sums their output sizes in units of ``rows x vocab`` (each elementwise kernel over the batch is one pass, in
    place or not, whole or in blocks); ``full_size`` counts those whose single output is ``rows x vocab`` or more."""

    def __init__(self, rows: int, vocab: int):
        super().__init__()
        self.rows, self.vocab, self.passes, self.full_size = rows, vocab, 0.0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(tensor, torch.Tensor) and tensor.numel() >= self.vocab:
                    self.passes += tensor.numel() / (self.rows * self.vocab)
                    self.full_size += tensor.numel() >= self.rows * self.vocab
        return out


def test_sampling_step_writes_no_full_size_temporary_and_few_passes():
    """One paged-engine sampling step (per-row counter draws, temperature 1, 64 rows x 4096 tokens): no kernel
    writes a [rows, vocab]-sized tensor (the reference: 22), and the kernels' writes add up to at most 16 passes
    over [rows, vocab] (the reference: 22): log-softmax, softmax, 12 for the draws, clamp and divide; the
    counter hash's rounds are one eager kernel each, so token identity keeps them (issue 55)."""
    rows, vocab = 64, 4096
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    request, position, params = torch.arange(rows), torch.full((rows,), 9), SamplingParams()
    with FullSizeWrites(rows, vocab) as before:
        _reference_choose_tokens(logits, vocab_size=vocab, params=params,
                                 race=_reference_position_draws(5, request, position, vocab))
    with FullSizeWrites(rows, vocab) as after:
        choose_tokens(logits, vocab_size=vocab, params=params, race_keys=position_keys(5, request, position))
    assert (before.full_size, round(before.passes)) == (22, 22)  # the counter counts what it should
    assert after.full_size == 0, after.full_size
    assert after.passes <= 16.25, after.passes


# ----------------------------------------------------------------------------------------------------------
# Host offload round trip: in process.

def test_host_offload_frees_storage_and_restores_values_and_views_exactly():
    buffer = torch.randn(1000, dtype=torch.float64)
    view = buffer[100:200]
    moment = torch.randn(50)
    weight = torch.randn(10)
    before = (buffer.clone(), moment.clone(), weight.clone())
    kept = HostOffload(keep_values=True)
    kept.offload([view, buffer, moment, weight], device=buffer.device,
                 protected={weight.untyped_storage().data_ptr()})
    assert buffer.untyped_storage().nbytes() == 0 and moment.untyped_storage().nbytes() == 0
    assert weight.untyped_storage().nbytes() == weight.numel() * 4  # protected storages stay
    assert kept.device_bytes_freed == 1000 * 8 + 50 * 4  # the view shares the buffer's storage: counted once
    kept.restore()
    assert torch.equal(buffer, before[0]) and torch.equal(moment, before[1]) and torch.equal(weight, before[2])
    assert torch.equal(view, before[0][100:200])
    view.fill_(7.0)
    assert (buffer[100:200] == 7.0).all()  # still a view of the same storage

    dropped = HostOffload(keep_values=False)
    dropped.offload([buffer], device=buffer.device, protected=set())
    dropped.restore()
    assert buffer.shape == (1000,) and (buffer == 0).all()


def test_host_offload_goes_through_one_host_buffer_reused_with_non_blocking_copies(monkeypatch):
    """Two offload/restore cycles make one host allocation (the tensors' aligned total) and reuse it; every copy
    either way is non_blocking (on a GPU: queued on the side stream, waited for once per direction)."""
    buffer, moment = torch.randn(1000, dtype=torch.float64), torch.randn(50)
    before = (buffer.clone(), moment.clone())
    allocations, copies = [], []
    empty, copy_ = torch.empty, torch.Tensor.copy_

    def counted_empty(*size, **kwargs):
        tensor = empty(*size, **kwargs)
        if tensor.numel():  # not the zero-size views the copies are made through
            allocations.append(tensor.numel())
        return tensor

    def recorded_copy(self, src, non_blocking=False):
        copies.append(non_blocking)
        return copy_(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch, "empty", counted_empty)
    monkeypatch.setattr(torch.Tensor, "copy_", recorded_copy)
    parked = HostOffload(keep_values=True)
    for _ in range(2):
        parked.offload([buffer, moment], device=buffer.device, protected=set())
        assert buffer.untyped_storage().nbytes() == 0 and moment.untyped_storage().nbytes() == 0
        parked.restore()
        assert torch.equal(buffer, before[0]) and torch.equal(moment, before[1])
    aligned = 8000 + HOST_ALIGNMENT - 8000 % HOST_ALIGNMENT  # the moment starts at an aligned offset
    assert allocations == [aligned + 200]
    assert copies == [True] * 8  # 2 storages x 2 directions x 2 cycles
    assert parked.host_buffer.numel() == aligned + 200  # kept by the HostOffload for the next cycle


def test_the_pinned_host_buffer_is_registered_at_its_exact_size_and_unregistered_when_freed(monkeypatch):
    """On GPUs the offload's buffer is plain memory page-locked by cudaHostRegister at exactly its size (PyTorch's
    pinned cache would round it up to a power of two and keep it), and unregistered once its last view is gone."""
    import gc

    from megatron_rl.runtime.phases import host_buffer

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, address, nbytes, flags):
            calls.append(("register", address, nbytes, flags))
            return 0

        def cudaHostUnregister(self, address):
            calls.append(("unregister", address))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    buffer = host_buffer(3 * 2**20 + 5, pinned=True)
    address = buffer.data_ptr()
    assert buffer.numel() == 3 * 2**20 + 5 and calls == [("register", address, 3 * 2**20 + 5, 0)]
    view = buffer[10:20]
    del buffer
    gc.collect()
    assert len(calls) == 1  # a view still reads it
    del view
    gc.collect()
    assert calls[1] == ("unregister", address)
    assert host_buffer(100, pinned=False).numel() == 100 and len(calls) == 2  # CPU jobs: plain memory


class _DdpChunk(torch.nn.Module):
    """What generation_phase reads of a Megatron DDP chunk: the model as ``module``, contiguous grad buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(16, 8)
        self.buffers = [SimpleNamespace(grad_data=torch.randn(16 * 8 + 8), param_data=None)]


def _engine_with_adam_state() -> Engine:
    """An Engine with a Megatron fp32 optimizer's layout: torch Adam's param groups (the weights themselves) and
    state (step count, moments) inside (``torch.optim.Adam`` itself would import dynamo: seconds here)."""
    chunk = _DdpChunk()
    params = list(chunk.module.parameters())
    adam = SimpleNamespace(param_groups=[{"params": params}], state={
        p: {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
        for p in params})
    return Engine(shape=None, opts=None, chunks=[chunk], optimizer=SimpleNamespace(optimizer=adam), scheduler=None,
                  make_optimizer=None)


def test_generation_phase_empties_the_cuda_cache_once_after_offloading_not_on_restore(monkeypatch):
    """The KV pool is sized and allocated inside the phase: the freed optimizer blocks go back to the driver once,
    after the offload. At the restore the cache keeps the KV pool's memory for the restored state and the next
    training step's activations (emptying it would make that step cudaMalloc again). Without offload: never. CUDA
    is made to look present (with the peak-memory calls it brings in)."""
    engine = _engine_with_adam_state()
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    for phase in (1, 2):
        with generation_phase(engine, offload_optimizer=True):
            assert len(emptied) == phase  # after this phase's offload, before generating
        assert len(emptied) == phase  # not after its restore
    with generation_phase(engine, offload_optimizer=False):
        pass
    assert len(emptied) == 2


def test_generation_phase_metrics_count_the_parked_bytes_and_times():
    """``offload_bytes`` is the bytes of the optimizer storages parked (Adam's moments and step counts; the
    weights, its params here, stay), which come back exactly; grads are freed but not copied (they come back zero).
    Each call hands over what was moved since the last one, summed over phases and engines."""
    engine, other = _engine_with_adam_state(), _engine_with_adam_state()
    weights = {p.untyped_storage().data_ptr() for p in engine.chunks[0].parameters()}
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in optimizer_tensors(engine.optimizer)
             if t.untyped_storage().data_ptr() not in weights}
    state_before = [t.clone() for t in optimizer_tensors(engine.optimizer)]
    grads = engine.chunks[0].buffers[0].grad_data
    for _ in range(2):
        with generation_phase(engine, offload_optimizer=True) as parked, generation_phase(other, offload_optimizer=True):
            assert parked.bytes_moved == sum(state.values())
            assert parked.device_bytes_freed == sum(state.values()) + grads.numel() * 4
    assert all(torch.equal(a, b) for a, b in zip(state_before, optimizer_tensors(engine.optimizer), strict=True))
    assert (grads == 0).all()
    metrics = offload_metrics(engine, other)
    assert metrics["offload_bytes"] == 2 * 2 * sum(state.values())  # two phases of two engines
    assert metrics["offload_s"] > 0 and metrics["offload_restore_s"] > 0
    assert offload_metrics(engine, other) == {"offload_bytes": 0.0, "offload_s": 0.0, "offload_restore_s": 0.0}


# ----------------------------------------------------------------------------------------------------------
# Distributed runs.

def _torchrun(out: Path, *args: str, nproc: int = 2) -> list[dict]:
    return torchrun_check(SCRIPT.name, out, *args, nproc=nproc)


@pytest.fixture(scope="module")
def gen_checks(tmp_path_factory):
    """Per layout of tests/dist/gen_check.py's LAYOUTS, each rank's results: the two-process layouts in one launch,
    the one-process one in another."""
    results = {}
    for names, nproc in ((("tp1_dp2", "tp2", "pp2_vpp2"), 2), (("mla_moe_tp1",), 1)):
        ranks = _torchrun(tmp_path_factory.mktemp(f"gen{nproc}"), "--layouts", ",".join(names), nproc=nproc)
        results.update({name: [rank[name] for rank in ranks] for name in names})
    return results


@pytest.fixture(scope="module")
def tp1_dp2(gen_checks):
    return gen_checks["tp1_dp2"]


@pytest.fixture(scope="module")
def tp2(gen_checks):
    return gen_checks["tp2"]


@pytest.fixture(scope="module")
def mla_moe_tp1(gen_checks):
    return gen_checks["mla_moe_tp1"]


@pytest.fixture(scope="module")
def pp2_vpp2(gen_checks):
    return gen_checks["pp2_vpp2"]


def _runs(request, names):
    return [(name, rank) for name in names for rank in request.getfixturevalue(name)]


@pytest.mark.parametrize("layout", ["tp1_dp2", "tp2", "mla_moe_tp1"])
def test_kv_cache_generation_equals_recomputation(request, layout):
    """Greedy, prompts of lengths 3..9 batched together: same tokens and log-probs as decoding without cache."""
    for rank in request.getfixturevalue(layout):
        assert rank["greedy"]["tokens"] == rank["recomputed_tokens"]
        assert rank["greedy"]["tokens"] == rank["full_forward_argmax"]
        assert rank["greedy_vs_recomputed_logprobs"] < LOGPROB_TOL
        assert rank["greedy_vs_full_forward_logprobs"] < LOGPROB_TOL
        assert rank["greedy"]["finish_reasons"] == ["length"] * len(rank["prompts"])


@pytest.mark.parametrize("layout", ["tp1_dp2", "tp2", "pp2_vpp2", "mla_moe_tp1"])
def test_generation_logprobs_equal_training_forward(request, layout):
    """What makes the colocated GRPO ratio 1: log-probs of generation == training forward, greedy and sampled."""
    for rank in request.getfixturevalue(layout):
        assert rank["greedy_vs_sequence_logprobs"] < LOGPROB_TOL
        assert rank["sampled_vs_sequence_logprobs"] < LOGPROB_TOL
        if "greedy_vs_loss_path" in rank:
            assert rank["greedy_vs_loss_path"] < LOGPROB_TOL


@pytest.mark.parametrize("layout", ["tp1_dp2", "tp2", "pp2_vpp2", "mla_moe_tp1"])
def test_tokens_do_not_depend_on_budget_cap_sharing_or_pipeline_parts(request, layout):
    """GRPO groups with 4-token blocks: the unbounded pool against every row prefilled on its own, a cap of 5
    rows, budgets of 10 and 24 blocks (rows wait, are evicted and prefilled again) and, under PP2 x VPP2, 1 and 3
    pipeline parts instead of 2 (uneven): the same tokens, finish reasons and log-probs, greedy, sampled with the
    same seed and with a stop token; each group's prompt is prefilled once; the budgets hold; the unbounded run's
    log-probs are the training forward's. And a fed session (the async rollout worker's engine) under the
    24-block budget, its groups handed in two, then one per stop question while earlier rows decode: the same
    tokens, finish reasons and log-probs, each group reported whole when its last completion ends."""
    for rank in request.getfixturevalue(layout):
        paged = rank["paged"]
        parts = paged["parts"]
        graphs = layout in ("tp1_dp2", "tp2")  # generation.cuda_graphs runs at one stage on dense models
        variants = ({"unshared", "capped", "budget_10", "budget_24"} | ({"parts_1", "parts_3"} if parts > 1 else set())
                    | ({"graphs_budget_10"} if graphs else set()))
        for name in ("greedy", "sampled", "greedy_eos"):
            case = paged[name]
            assert case["vs_sequence_logprobs"] < LOGPROB_TOL, (name, case)
            assert set(case) == variants | {"block_bytes", "stopped", "vs_sequence_logprobs", "unbounded", "fed"}
            fed = case["fed"]
            assert fed["tokens_equal"] and fed["finish_reasons_equal"] and fed["logprob_diff"] < LOGPROB_TOL, fed
            assert fed["questions"] > 2  # prompts were handed in while others decoded
            assert (fed["graph_steps"] > 0) == graphs, fed
            for variant in variants:
                run = case[variant]
                assert run["tokens_equal"] and run["finish_reasons_equal"], (name, variant, run)
                assert run["logprob_diff"] < LOGPROB_TOL and run["sampling_logprob_diff"] < LOGPROB_TOL, (name, run)
            assert case["unbounded"]["evictions"] == 0 and case["unbounded"]["prefill_rows"] == paged["distinct_prompts"]
            assert case["unshared"]["prefill_rows"] == paged["rows"]
            assert case["budget_10"]["peak_blocks"] <= 10 * parts and case["budget_10"]["evictions"] > 0, (name, case)
            assert case["budget_10"]["pool_bytes"] == 10 * parts * case["block_bytes"]
            assert case["budget_24"]["peak_blocks"] <= 24 * parts
            if graphs:  # decode-only steps ran on the bucketed buffers, mixed ones (prefills) eagerly
                run = case["graphs_budget_10"]
                assert 0 < run["graph_steps"] < run["forward_passes"] and run["evictions"] > 0, (name, run)
            assert all(case[variant]["graph_steps"] == 0 for variant in variants - {"graphs_budget_10"})
        assert paged["greedy_eos"]["stopped"] >= 4  # prompt 0's group stops at its 3rd token


def test_pipeline_generation_equals_recomputation(pp2_vpp2):
    for rank in pp2_vpp2:
        assert (rank["pp"], rank["vpp"], rank["layers"]) == (2, 2, 4)
        assert rank["greedy"]["tokens"] == rank["full_forward_argmax"]
        assert rank["greedy_vs_full_forward_logprobs"] < LOGPROB_TOL
    assert pp2_vpp2[0]["greedy"] == pp2_vpp2[1]["greedy"] and pp2_vpp2[0]["sampled"] == pp2_vpp2[1]["sampled"]


def test_tp2_equals_tp1_and_data_parallel_ranks_generate_their_share(tp1_dp2, tp2):
    """Same seed and weights: TP=2 gives TP=1's greedy and sampled tokens; each DP rank did every other prompt."""
    assert tp2[0]["greedy"] == tp2[1]["greedy"] and tp2[0]["sampled"] == tp2[1]["sampled"]
    full = tp2[0]
    for rank in tp1_dp2:
        rows = slice(rank["dp_rank"], None, 2)
        assert rank["dp"] == 2 and rank["prompts"] == full["prompts"][rows]
        assert rank["greedy"]["tokens"] == full["greedy"]["tokens"][rows]
        for ours, theirs in zip(rank["greedy"]["logprobs"], full["greedy"]["logprobs"][rows], strict=True):
            assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < LOGPROB_TOL
    # sampling seeds are per call, so DP rank r's rows are drawn differently from the TP=2 run's rows
    assert all(len(t) == 8 for t in tp1_dp2[0]["sampled"]["tokens"])


def test_stop_tokens_and_sequences_end_responses(tp2):
    for rank in tp2:
        stops, greedy = rank["stops"], rank["greedy"]
        eos, seq = stops["eos"], stops["stop_sequence"]
        for row, full in enumerate(greedy["tokens"]):
            hit = next((i for i, tok in enumerate(full) if tok == eos or (i >= 1 and full[i - 1:i + 1] == seq)), None)
            end = len(full) if hit is None else hit + 1
            assert stops["tokens"][row] == full[:end]
            assert stops["lengths"][row] == end
            assert stops["finish_reasons"][row] == ("length" if hit is None else "stop")
            assert stops["logprobs"][row] == pytest.approx(greedy["logprobs"][row][:end], abs=LOGPROB_TOL)
        assert stops["finish_reasons"][0] == "stop" and stops["finish_reasons"][1] == "stop"


def test_kv_cache_is_sized_as_expected_and_released(tp1_dp2):
    """K and V for 2 layers x one 256-token block per row x batch x 2 query groups x 16 dims, fp32 (every row's
    prompt + 8 tokens fit in one block); ``generate`` raises if any cache tensor is still referenced when it
    returns."""
    for rank in tp1_dp2:
        batch = len(rank["prompts"])
        # unbounded: one 256-token block per row (every row fits in one); one forward per token
        assert rank["greedy"]["kv_cache_bytes"] == 2 * 2 * 256 * batch * 2 * 16 * 4
        assert rank["greedy"]["forward_passes"] == 8


@pytest.mark.parametrize("layout", ["tp1_dp2", "tp2", "pp2_vpp2", "mla_moe_tp1"])
def test_offload_round_trip_and_training_after_generation(request, layout):
    runs = request.getfixturevalue(layout)
    for rank in runs:
        off = rank["offload"]
        assert off["bytes_freed"] > 0 and off["bytes_moved"] == off["bytes_freed"]  # keep_grads: all copied
        assert off["grad_buffers_freed"] == off["grad_buffers"] > 0
        assert off["optimizer_tensors_freed"] > 0
        assert off["optimizer_exact"] and off["grads_exact"] and off["grads_nonzero_before"]
        assert off["grads_zero_without_keep"]
        assert off["tokens_equal_inside_phase"] and off["eval_inside"] and off["train_mode_after"]
        assert rank["weights_untouched"]
        assert math.isfinite(rank["train_after_generation"]["loss"])


@pytest.mark.parametrize("layout", ["tp1_dp2", "tp2", "pp2_vpp2"])
def test_multi_turn_replies_are_context_fed_onto_the_rows_own_blocks(request, layout):
    """turns.py ``TurnEnded``: a scripted 3-token reply after a 4-token turn, then a second turn (groups of 2,
    4-token blocks). The policy mask marks the turns; the replies' log-probs are placeholders; the policy tokens'
    log-probs equal the training forward of the whole conversation; each turn equals a single-turn generation of
    the conversation so far with the same seed; and every token was fed once (the reply onto the row's blocks,
    not the conversation again). At TP2 both ranks sample the same turns, and under PP2·VPP2 (two pipeline parts,
    steps overlapping across the stages) both stages replay the same choices: either way they hand the same turns
    over, in the same order."""
    ranks = request.getfixturevalue(layout)
    if layout != "tp1_dp2":
        assert ranks[0]["multi_turn"]["calls"] == ranks[1]["multi_turn"]["calls"]
    for rank in ranks:
        run = rank["multi_turn"]
        assert run["policy_mask"] == [[1] * 4 + [0] * 3 + [1] * 4] * len(run["policy_mask"])
        assert sorted(i for i, _, finish in run["calls"] if finish == "length") == sorted(
            list(range(len(run["policy_mask"]))) * 2)
        assert run["finish_reasons"] == ["length"] * len(run["policy_mask"])
        assert run["reply_in_place"] and set(run["reply_logprobs"]) == {0.0}
        assert run["first_turn_equal"] and run["second_turn_equal"]
        assert run["vs_sequence_logprobs"] < LOGPROB_TOL
        assert run["fed_tokens"] == run["fed_once"]
        # replies made while the other rows decode (futures, any order; at TP2 and PP2 on the first rank, settled
        # over the replica at each step): the same episodes
        assert run["overlapped_equal"] and run["overlapped_logprob_diff"] < LOGPROB_TOL


@pytest.mark.parametrize("layout", ["tp1_dp2", "tp2", "pp2_vpp2"])
def test_a_stop_abandons_the_call_and_the_next_one_decodes_as_before(request, layout):
    """A yes to the stop question mid-decode raises GenerationStopped on every rank; under PP the choices in flight
    are taken, so the stages' channels hold nothing of it and the next call gives the greedy tokens again."""
    for rank in request.getfixturevalue(layout):
        assert rank["stopped"].startswith("stopped after 16 engine steps"), rank["stopped"]
        assert rank["after_stop_equal"]


def test_training_after_generation_is_layout_independent(tp1_dp2, tp2):
    a, b = tp1_dp2[0]["train_after_generation"], tp2[0]["train_after_generation"]
    assert a["loss"] == pytest.approx(b["loss"], abs=2e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_cuda_graphs_are_refused_where_a_graph_cannot_replay_the_decode(pp2_vpp2, mla_moe_tp1):
    """generation.cuda_graphs in the engine: a pipeline's stages and an MoE model's dispatch are refused with the
    launch check's reasons (spec/parallel.py ``cuda_graph_error``)."""
    assert pp2_vpp2[0]["errors"]["cuda_graphs"].startswith(
        "NotImplementedError: generation.cuda_graphs=true with a 2-stage rollout")
    assert mla_moe_tp1[0]["errors"]["cuda_graphs"].startswith(
        "NotImplementedError: generation.cuda_graphs=true: an MoE model's token dispatch")


def test_clear_errors(tp2):
    errors = tp2[0]["errors"]
    assert errors["empty_prompt"].startswith("ValueError: every prompt needs at least one token")
    assert errors["token_out_of_vocab"].startswith("ValueError: prompt token ids")
    assert errors["too_long"].startswith("ValueError: longest prompt")
    assert errors["cuda_graphs"] == "no error"  # TP2 over gloo on CPUs: nothing is captured
    sequence_parallel = tp2[0]["sequence_parallel_config"]  # switched off for generation, then back on
    assert sequence_parallel["tokens_equal"] and sequence_parallel["flag_after_generate"]


@pytest.mark.parametrize("layout", ["tp1_dp2", "pp2_vpp2", "mla_moe_tp1"])
def test_state_a_module_first_makes_during_generation_is_updated_in_place_by_training(request, layout):
    """gen_check's ``LazyBuffer``: a buffer a module makes at its first forward, which is generation's, as Transformer
    Engine makes some, is an ordinary tensor (generation runs under no_grad, not inference_mode) that the
    following training step updates in place."""
    for rank in request.getfixturevalue(layout):
        lazy = rank["lazy_buffer"]
        assert lazy["made"] and not lazy["inference_tensor"], lazy
        assert lazy["training_updates"] > 0 and lazy["error"] is None, lazy


# ----------------------------------------------------------------------------------------------------------
# Model variants: this file's own worker under torchrun (python tests/test_generation.py --variants-worker ...).

VARIANTS = {
    "gqa": {},
    "qkv_bias_qk_norm": {"add_qkv_bias": True, "qk_layernorm": True},
    "mha_bias_tied": {"num_query_groups": 4, "add_bias_linear": True, "tie_embeddings": True},
    "layernorm_gelu": {"normalization": "LayerNorm", "gated_linear_unit": False, "activation": "gelu"},
}
VARIANT_PROMPT_LENGTHS = (5, 9, 3, 7, 9, 4)
VARIANT_NEW_TOKENS = 8
VARIANT_SAMPLING = {"greedy": (dict(temperature=0.0), None),
                    "sampled": (dict(temperature=0.8, top_k=20, top_p=0.9), 11)}
"""mode: (EngineConfig settings, seed)."""


def _max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def _variants_worker(out: Path, tp: int) -> None:
    import dataclasses

    torch.set_num_threads(1)
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.runtime.distributed import initialize, job_dims
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.trainers.common import job_engine

    cfg = load_config(overrides=[f"parallel.tp={tp}", "algorithm.name=pretrain", "parallel.micro_batch_size=1",
                                 "algorithm.global_batch_size=4", "run.seed=5"])
    initialize(job_dims(tp=tp), seed=cfg.run.seed)
    base = load_model_shape("tiny-cpu")
    gen = torch.Generator().manual_seed(99)
    prompts = [torch.randint(3, base.vocab_size, (n,), generator=gen).tolist() for n in VARIANT_PROMPT_LENGTHS]
    results = {}
    for name, overrides in VARIANTS.items():
        shape = dataclasses.replace(base, **overrides)
        engine = job_engine(cfg, shape, total_steps=1)
        noise = torch.Generator().manual_seed(7)  # same draws on every TP rank: replicated tensors stay equal
        with torch.no_grad():
            for param in engine.chunks[0].parameters():
                param.add_(torch.randn(param.shape, generator=noise) * 0.1)
        variant = {}
        for mode, (settings, seed) in VARIANT_SAMPLING.items():
            config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=VARIANT_NEW_TOKENS, **settings)
            paged = generate(engine.chunks, prompts, dataclasses.replace(config, kv_block_tokens=4), seed=seed)
            whole_blocks = generate(engine.chunks, prompts, config, seed=seed)
            rows = [p + r for p, r in zip(prompts, paged.tokens)]
            width = max(len(r) for r in rows)
            full = sequence_logprobs(engine.chunks, torch.tensor([r + [0] * (width - len(r)) for r in rows]))
            training = [full[b, len(p) - 1:len(p) - 1 + n].tolist()
                        for b, (p, n) in enumerate(zip(prompts, paged.lengths))]
            variant[mode] = {
                "tokens": paged.tokens, "tokens_equal": paged.tokens == whole_blocks.tokens, "lengths": paged.lengths,
                "vs_whole_blocks": _max_abs_diff(paged.logprobs, whole_blocks.logprobs),
                "sampling_vs_whole_blocks": _max_abs_diff(paged.sampling_logprobs, whole_blocks.sampling_logprobs),
                "vs_training_forward": _max_abs_diff(paged.logprobs, training)}
        results[name] = variant
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps({"tp": tp, "variants": results}))
    torch.distributed.barrier()


def _variants_run(out: Path, tp: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port",
           str(free_port()), str(Path(__file__).resolve()), "--variants-worker", "--tp", str(tp), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)]


@pytest.fixture(scope="module")
def variant_runs(tmp_path_factory):
    return {tp: _variants_run(tmp_path_factory.mktemp(f"variants_tp{tp}"), tp) for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_variants_generate_as_the_training_forward_scores(variant_runs, tp, variant):
    """GQA, QKV bias + QK norm, MHA + bias linears + tied embeddings, LayerNorm + GeLU without gating, parameters
    perturbed so that zero biases and unit norms matter, prompts of lengths 3..9 batched: the paged engine gives
    log-probs within 1e-5 of the training forward's, and 4-token blocks (rows spanning blocks) give the tokens and
    log-probs of one 256-token block per row, greedy and sampled."""
    for rank in variant_runs[tp]:
        for mode in VARIANT_SAMPLING:
            run = rank["variants"][variant][mode]
            assert run["tokens_equal"], (variant, mode)
            assert run["vs_whole_blocks"] < LOGPROB_TOL and run["sampling_vs_whole_blocks"] < LOGPROB_TOL
            assert run["vs_training_forward"] < LOGPROB_TOL
            assert run["lengths"] == [VARIANT_NEW_TOKENS] * len(VARIANT_PROMPT_LENGTHS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_variants_tp2_ranks_agree(variant_runs, variant):
    """Both TP=2 ranks return the same tokens (vocab-gathered logits, the same draws, TP-rank-0 broadcast).
    TP=2 is not compared with TP=1 here: the parameter perturbation is drawn per shard."""
    a, b = (rank["variants"][variant] for rank in variant_runs[2])
    for mode in a:
        assert a[mode]["tokens"] == b[mode]["tokens"], mode


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--variants-worker", action="store_true", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    cli = parser.parse_args()
    _variants_worker(cli.out, cli.tp)
