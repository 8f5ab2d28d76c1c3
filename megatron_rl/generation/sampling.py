"""Token selection from one decoding step's logits: greedy, temperature, top-k, top-p; and the log-probs.

Two log-probs are reported per generated token:

* ``policy_logprobs``: log-softmax of the raw logits (temperature 1) over the WHOLE padded vocabulary, exactly
  the normaliser of the training loss (Megatron's ``vocab_parallel_cross_entropy`` runs over the padded
  vocabulary). These are the log-probs of pi_theta that GRPO's ratio and KL need; with them the colocated
  ratio is 1 on the first update.
* ``sampling_logprobs``: log-prob under the distribution the token was actually drawn from (temperature,
  top-k and top-p applied, padded rows removed). 0 for greedy decoding.

Padded vocabulary rows (ids >= ``vocab_size``) are never selected. Sampling uses the exponential race
(``argmax(p / E)`` with ``E ~ Exp(1)``), which draws exactly from ``p`` without a host synchronisation and
with one generator call per step, so every tensor-parallel rank holding the same generator state draws the
same token.

Test: ``.venv/bin/python -m pytest tests/test_generation.py -q -k sampling``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How the next token is chosen from the logits."""

    temperature: float = 1.0
    """Divides the logits before sampling; 0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1 disables."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0 or top_k 1."""
        return self.temperature == 0.0 or self.top_k == 1


def sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits of the sampling distribution (real vocabulary only): temperature, then top-k, then top-p.

    Removed tokens get -inf. ``logits`` is ``[batch, vocab_size]`` (padded rows already cut off).
    """
    logits = logits / params.temperature if params.temperature not in (0.0, 1.0) else logits
    if params.top_k and params.top_k < logits.size(-1):
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # the token that crosses top_p is kept, so never empty
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass(frozen=True, kw_only=True)
class StepChoice:
    """The tokens chosen at one step and their log-probs, one entry per batch row."""

    tokens: torch.Tensor
    """[batch] int64 token ids, all < vocab_size."""
    policy_logprobs: torch.Tensor
    """[batch] float32: log-softmax of the raw logits over the padded vocabulary at the chosen token."""
    sampling_logprobs: torch.Tensor
    """[batch] float32: log-prob under the sampling distribution (0 for greedy)."""

    def host_lists(self) -> tuple[list, list, list]:
        """Tokens, policy and sampling log-probs as lists, read back to the host in one copy (one sync): token ids
        below 2**53 and float32 log-probs are exact in float64."""
        tokens, policy, sampling = torch.stack([self.tokens.double(), self.policy_logprobs.double(),
                                                self.sampling_logprobs.double()]).tolist()
        return [int(t) for t in tokens], policy, sampling

    def scattered(self, rows: torch.Tensor, batch: int) -> "StepChoice":
        """This choice of batch rows ``rows``, placed in a ``batch``-row choice (the other rows 0)."""
        def place(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros(batch, dtype=values.dtype, device=values.device).index_copy_(0, rows, values)

        return StepChoice(tokens=place(self.tokens), policy_logprobs=place(self.policy_logprobs),
                          sampling_logprobs=place(self.sampling_logprobs))


_MASK32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x7FEB352D, 0x5BD1E995
_TOKEN_SALT = 0x9E3779B9
_TINY = torch.finfo(torch.float32).tiny


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 tensors holding values below 2**32; the
    multipliers are below 2**31, so no product leaves int64 and CPUs and GPUs compute the same bits."""
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _MASK32
    return x ^ (x >> 16)


def position_keys(seed, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The ``[len(rows)]`` int64 keys of ``position_draws``: a hash of seed, request ``rows[i]`` and position
    ``positions[i]``, already put through the first xor-shift of the per-token hash (``choose_tokens(race_keys=)``
    draws from these without materialising the race)."""
    seeds = torch.as_tensor(seed, dtype=torch.long, device=rows.device).reshape(-1)
    key = _hash32((seeds & _MASK32) ^ _hash32((seeds >> 32) & _MASK32))
    key = _hash32(key ^ (rows.long() & _MASK32))
    key = _hash32(key ^ (positions.long() & _MASK32))
    return key ^ (key >> 16)


def _token_codes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[vocab_size]`` int64: each token id's hash, through the first xor-shift of the per-token hash (which
    distributes over the xor with the row key, so it is paid per row and per token instead of per pair)."""
    tokens = _hash32((torch.arange(vocab_size, dtype=torch.long, device=device) + _TOKEN_SALT) & _MASK32)
    return tokens ^ (tokens >> 16)


def _log_uniforms(keys: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``log(u)`` ``[len(keys), len(codes)]`` float32, ``u`` the uniform in (0, 1] of ``position_draws``, bit for bit:
    the rest of the hash in place (10 elementwise kernels) and ``u = ((bits >> 8) + 0.5) / 2**24`` in one."""
    x = keys.unsqueeze(-1) ^ codes
    x.mul_(_MIX1).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_MIX2).bitwise_and_(_MASK32)
    x ^= x >> 16
    x >>= 8
    # (v + 0.5) * 2**-24 as one fused add: v < 2**24, the product is exact, and a power-of-two scale does not
    # change where float32 rounds, so this is ((v.float() + 0.5) * 2**-24) to the bit
    uniform = torch.add(torch.tensor(2.0 ** -25, dtype=torch.float32), x, alpha=2.0 ** -24)
    return uniform.log_()


def position_draws(seed, rows: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The exponential race ``[len(rows), vocab_size]`` of request ``rows[i]`` writing position ``positions[i]``:
    counter-based (a hash of seed, request, position and token id), so a row's draws do not depend on which other
    rows share its batch, in what order rows are admitted, on eviction and re-prefill, or on the device. ``seed``:
    one int for every row, or an int64 tensor of one seed per row (rows of several calls decoding together).
    Sampling need not materialise it: ``choose_tokens(race_keys=position_keys(...))`` picks the same tokens."""
    return _log_uniforms(position_keys(seed, rows, positions), _token_codes(vocab_size, rows.device)).neg_()


def draw_seed(seed: Optional[int], generator: Optional[torch.Generator]) -> int:
    """The seed of one generation call's draws: the next 62 bits of ``generator``, else ``seed`` (0 when None)."""
    if generator is not None:
        return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return 0 if seed is None else int(seed)


_BLOCK_ELEMENTS = {"cpu": 1 << 16, "cuda": 1 << 21}
"""Elements of one block of rows that choose_tokens works on at a time: the block's temporaries (about a dozen
kernels each) stay in the L2 cache (a CPU core's ~1 MiB; an H100's 50 MB), so ``[rows, vocab]`` itself is read
from memory once. Every kernel used is row-wise, so the blocks give the same bits as one whole-batch pass."""


def _block_rows(rows: int, width: int, device: torch.device) -> int:
    return max(1, min(rows, _BLOCK_ELEMENTS.get(device.type, _BLOCK_ELEMENTS["cuda"]) // max(width, 1)))


def choose_tokens(logits: torch.Tensor, *, vocab_size: int, params: SamplingParams,
                  generator: Optional[torch.Generator] = None, race: Optional[torch.Tensor] = None,
                  race_keys: Optional[torch.Tensor] = None) -> StepChoice:
    """Pick the next token of every row from ``logits`` ``[batch, padded_vocab]``.

    Sampling draws its exponential race from ``generator``, or takes ``race`` ``[batch, vocab_size]`` (a
    ``position_draws`` of the rows), or ``race_keys`` ``[batch]`` (their ``position_keys``: the same tokens as
    ``race=position_draws(...)``, drawn block by block inside the choice, never materialised). The work runs over
    blocks of rows (``_BLOCK_ELEMENTS``): with ``race_keys`` no temporary is ``[batch, vocab]``-sized."""
    sampled = not params.greedy
    if sampled and race is None and race_keys is None:
        race = torch.empty((logits.size(0), vocab_size), dtype=torch.float32,
                           device=logits.device).exponential_(generator=generator)
    codes = _token_codes(vocab_size, logits.device) if sampled and race is None else None
    step = _block_rows(logits.size(0), logits.size(-1), logits.device)
    parts = [_choose_block(logits[start:start + step], vocab_size=vocab_size, params=params,
                           race=None if race is None else race[start:start + step],
                           keys=None if codes is None else race_keys[start:start + step], codes=codes)
             for start in range(0, logits.size(0), step)]
    if len(parts) == 1:
        return parts[0]
    return StepChoice(tokens=torch.cat([p.tokens for p in parts]),
                      policy_logprobs=torch.cat([p.policy_logprobs for p in parts]),
                      sampling_logprobs=torch.cat([p.sampling_logprobs for p in parts]))


def _choose_block(logits: torch.Tensor, *, vocab_size: int, params: SamplingParams, race: Optional[torch.Tensor],
                  keys: Optional[torch.Tensor], codes: Optional[torch.Tensor]) -> StepChoice:
    """choose_tokens on one block of rows; exactly one of ``race`` and ``keys`` (with ``codes``) when sampling."""
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
            # -(probs / max(-log u, tiny)) to the bit (negation is exact): its argmin is the race's argmax,
            # first index on ties alike. A zero draw (u = 1) is clamped, else a removed token's 0/0 is NaN.
            scores = _log_uniforms(keys, codes).clamp_(max=-_TINY)
            tokens = torch.div(probs, scores, out=scores).argmin(dim=-1)
        else:
            # A zero draw would turn a removed token's 0/0 into NaN, which argmax would pick.
            tokens = (probs / race.clamp_min(_TINY)).argmax(dim=-1)
        # temperature 1, no filter, no padding: the sampling distribution is the policy's, same kernel, same bits
        unshaped = shaped is real and vocab_size == logits.size(-1)
        sampled_log = policy if unshaped else torch.log_softmax(shaped, dim=-1)
        sampled_lp = sampled_log.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    policy_lp = policy.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return StepChoice(tokens=tokens, policy_logprobs=policy_lp, sampling_logprobs=sampled_lp)
