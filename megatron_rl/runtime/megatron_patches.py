"""Megatron Core changes every process gets, on every device: ``apply()`` before Megatron's first import.

``megatron_rl.runtime.distributed.initialize`` (and ``cpu_compat.apply``, which conversion calls) applies them on
GPUs and CPUs alike, so the code CI runs on the CPU is the code GPUs run (``cpu_compat`` keeps only the CPU
redirections):

* Megatron's fusion functions (``@jit_fuser``) stay plain functions. Megatron binds ``jit_fuser = torch.compile``
  at import; compiled, the MoE router's expert-bias step (``_apply_expert_bias``, every forward) and the other
  fusions recompile as the paged engine's token counts change and as grad and no-grad modes alternate (seconds
  to tens of seconds of Inductor per process, in code CI never ran), and importing Inductor costs ~2 s of CPU in
  every process. ``apply()`` imports Megatron with ``torch.compile`` as the identity; whatever else binds
  ``torch.compile`` during that import as a decorator (Transformer Engine's own ``jit_fuser``, when Megatron
  imports TE) stays eager too. The same ops run uncompiled.
* Megatron's unfused RoPE for packed (``thd``) rows, which reads the row lengths on the host (``.tolist()``,
  ``.item()``: a device sync) and loops over the rows in Python (a sin and cos of the table per row, per layer,
  for queries and keys: 9x the time of one pass at 32 rows on the CPU), becomes one pass over all tokens at each
  token's own position, without a host read; bit-identical, forward and backward (tests/test_rope_thd.py). The
  builder turns Megatron's ``apply_rope_fusion`` off, so every device runs this one.
"""

from __future__ import annotations

import sys

import torch

EAGER_FUSIONS = "core/jit.py:jit_fuser"
"""The count of Megatron functions left uncompiled (``cpu_compat.redirect_counts`` reports it under this site):
none means Megatron was imported before ``apply()``."""

_eager_fusions = 0
_applied = False


def apply() -> None:
    """Install the patches once per process. Call it before anything imports Megatron (see the module docstring):
    imported already, Megatron's fusions stay compiled (they work, and compile on first use)."""
    global _applied
    if _applied:
        return
    _import_megatron_with_eager_fusions()
    _install_thd_rotary()
    _applied = True


def is_applied() -> bool:
    return _applied


def eager_fusions() -> int:
    """How many Megatron fusion functions ``apply()`` left uncompiled in this process."""
    return _eager_fusions


def _import_megatron_with_eager_fusions() -> None:
    if "megatron.core" in sys.modules:
        return

    def eager(model=None, **options):
        global _eager_fusions
        _eager_fusions += 1
        return model if model is not None else (lambda fn: fn)

    compile_ = torch.compile
    torch.compile = eager
    try:
        import megatron.core  # noqa: F401  (megatron.core.jit binds jit_fuser = torch.compile once, here)
    finally:
        torch.compile = compile_


def thd_rotary_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, *, tokens: int) -> torch.Tensor:
    """The RoPE position of each token this CP rank holds of packed rows bounded by ``cu_seqlens`` (of the whole
    rows): positions restart at 0 in every row, and with ``cp_size`` > 1 a row's local tokens are its chunks
    ``cp_rank`` and ``2*cp_size-1-cp_rank`` (Megatron's load-balanced split). ``tokens``, the count this rank
    holds (the packed tensor's length), is known on the host: reading it from ``cu_seqlens`` would sync."""
    local = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size).long()
    start = torch.repeat_interleave(torch.cumsum(local, 0) - local, local, output_size=tokens)
    position = torch.arange(tokens, device=cu_seqlens.device) - start
    if cp_size == 1:
        return position
    half = torch.repeat_interleave(local // 2, local, output_size=tokens)
    whole = torch.repeat_interleave(local * cp_size, local, output_size=tokens)
    return torch.where(position < half, position + cp_rank * half, position + whole - (cp_rank + 2) * half)


def thd_rotary(megatron_thd_rotary):
    """Megatron's ``rope_utils._apply_rotary_pos_emb_thd`` as one pass (the module docstring); kept as
    ``.megatron`` on the result."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    def one_pass(t, cu_seqlens, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
                 cp_group=None, multi_latent_attention=None):
        # A CP rank holds 1/cp of every row (Megatron's THD split needs each a multiple of 2·cp), so t's length
        # times cp is cu_seqlens[-1]: Megatron's "packed freqs" test, on host sizes.
        if (cp_group is None or multi_latent_attention is not None
                or freqs.size(0) == t.size(0) * cp_group.size()):
            # Megatron's own answer: its error, its deprecation warning, or its one-pass "packed freqs" case
            return megatron_thd_rotary(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                                       mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale,
                                       cp_group=cp_group, multi_latent_attention=multi_latent_attention)
        position = thd_rotary_positions(cu_seqlens, cp_group.size(), cp_group.rank(), tokens=t.size(0))
        return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[position], rotary_interleaved=rotary_interleaved,
                                          mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale).squeeze(1)

    one_pass.megatron = megatron_thd_rotary
    return one_pass


def _install_thd_rotary() -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    megatron = getattr(rope_utils._apply_rotary_pos_emb_thd, "megatron", rope_utils._apply_rotary_pos_emb_thd)
    patched = thd_rotary(megatron)
    for module in (rope_utils, rotary_pos_embedding):  # each imports it by name
        if hasattr(module, "_apply_rotary_pos_emb_thd"):
            module._apply_rotary_pos_emb_thd = patched
