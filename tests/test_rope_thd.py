"""RoPE on packed (``thd``) rows: ``megatron_patches``' one-pass version against Megatron's per-row loop
(``rope_utils._apply_rotary_pos_emb_thd``), which it replaces on every device.

Run: ``.venv/bin/python -m pytest tests/test_rope_thd.py -q`` (a few seconds).

Checked bit for bit, output and input gradient, over uneven row lengths, at cp = 1, 2 and 4 (every rank's part),
for half-rotation, interleaved and MLA-interleaved layouts, a partial rotary dimension and a YaRN ``mscale``; without
a host read (it runs on meta tensors); and Megatron's ``apply_rotary_pos_emb`` takes the one-pass version in a CPU
process (``cpu_compat.apply()``) and in a GPU one (``distributed.initialize`` with CUDA present), whose Megatron
fusions are eager too.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_rl.runtime import megatron_patches

HEADS, DIM = 3, 16


class _Group:
    """The two questions Megatron's RoPE asks of a CP process group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _rows(cp: int) -> torch.Tensor:
    lengths = torch.tensor([6, 2, 10, 4, 8, 2]) * cp  # each a multiple of 2*cp, as Megatron's CP split needs
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)


def _apply(fn, t, cu, freqs, **kwargs):
    t = t.detach().clone().requires_grad_(True)
    out = fn(t, cu, freqs, **kwargs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), t.grad


def test_thd_rotary_positions_restart_per_row_and_follow_the_cp_chunks():
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    assert megatron_patches.thd_rotary_positions(cu, 1, 0, tokens=12).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    # cp=2: rank 0 holds chunks 0 and 3 of each row, rank 1 chunks 1 and 2
    assert megatron_patches.thd_rotary_positions(cu, 2, 0, tokens=6).tolist() == [0, 3, 0, 1, 6, 7]
    assert megatron_patches.thd_rotary_positions(cu, 2, 1, tokens=6).tolist() == [1, 2, 2, 3, 4, 5]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("layout", ["half", "interleaved", "mla", "partial_mscale"])
def test_one_pass_equals_megatrons_loop_bit_for_bit(cp, layout):
    from megatron.core.models.common.embeddings import rope_utils

    megatron = getattr(rope_utils._apply_rotary_pos_emb_thd, "megatron", rope_utils._apply_rotary_pos_emb_thd)
    ours = megatron_patches.thd_rotary(megatron)
    cu = _rows(cp)
    gen = torch.Generator().manual_seed(cp)
    rot_dim = DIM // 2 if layout == "partial_mscale" else DIM
    longest = int((cu[1:] - cu[:-1]).max())
    freqs = (torch.arange(longest, dtype=torch.float32)[:, None]
             * torch.rand(rot_dim // 2, generator=gen)[None]).repeat(1, 2)[:, None, None, :]
    kwargs = {"rotary_interleaved": layout == "interleaved", "mla_rotary_interleaved": layout == "mla",
              "mscale": 1.3 if layout == "partial_mscale" else 1.0}
    for rank in range(cp):
        t = torch.randn(int(cu[-1]) // cp, HEADS, DIM, generator=gen)
        expected = _apply(megatron, t, cu, freqs, cp_group=_Group(cp, rank), **kwargs)
        got = _apply(ours, t, cu, freqs, cp_group=_Group(cp, rank), **kwargs)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (cp, rank, layout)
        assert not torch.equal(got[0], t)  # RoPE did rotate


@pytest.mark.parametrize("cp", [1, 2])
def test_the_one_pass_version_reads_nothing_on_the_host(cp):
    """On meta tensors (no values: ``.item()``, ``.tolist()``, ``int(tensor)`` or a ``repeat_interleave`` without
    its size raise) it still runs: on a GPU it queues without waiting for the device."""
    from megatron.core.models.common.embeddings import rope_utils

    megatron = getattr(rope_utils._apply_rotary_pos_emb_thd, "megatron", rope_utils._apply_rotary_pos_emb_thd)
    cu = _rows(cp).to("meta")
    t = torch.empty(32, HEADS, DIM, device="meta")  # each rank holds 1/cp of the 32·cp tokens
    freqs = torch.empty(10 * cp, 1, 1, DIM, device="meta")
    out = megatron_patches.thd_rotary(megatron)(t, cu, freqs, cp_group=_Group(cp, cp - 1))
    assert out.shape == t.shape and out.is_meta
    with pytest.raises(Exception):  # noqa: B017  (whichever error Megatron's host read raises on meta tensors)
        megatron(t, cu, freqs, cp_group=_Group(cp, cp - 1))  # Megatron's loop reads the row lengths


def test_a_cpu_process_runs_the_one_pass_version():
    check = ("from megatron_rl.runtime import cpu_compat; assert cpu_compat.apply(); "
             "from megatron.core.models.common.embeddings import rope_utils; "
             "print(rope_utils._apply_rotary_pos_emb_thd.__module__, hasattr(rope_utils._apply_rotary_pos_emb_thd, 'megatron'))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["megatron_rl.runtime.megatron_patches", "True"]


GPU_PROCESS = """
import json, torch
torch.cuda.is_available = lambda: True  # a GPU process, as far as the project and Megatron can tell
torch.cuda.set_device = lambda device: None
class Started(Exception):
    pass
def started(*args, **kwargs):
    raise Started  # initialize() has done what precedes the process group
torch.distributed.init_process_group = started
from megatron_rl.runtime import cpu_compat, distributed
from megatron_rl.spec.parallel import ParallelDims
try:
    distributed.initialize(ParallelDims(world_size=1), seed=0)
except Started:
    pass
from megatron.core import jit
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.moe.router import TopKRouter
def fusion(x):
    return x
print(json.dumps({"cpu_redirections": cpu_compat.is_active(), "fuser_is_identity": jit.jit_fuser(fusion) is fusion,
                  "router_bias_compiled": hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable"),
                  "rope": rope_utils._apply_rotary_pos_emb_thd.__module__}))
"""


def test_a_gpu_process_gets_eager_fusions_and_the_one_pass_version():
    """``distributed.initialize`` with CUDA present (patched in a fresh process, no CPU redirection): Megatron's
    jit fuser is the identity, the MoE router's expert-bias step is not compiled, and THD RoPE is the one-pass
    version."""
    import json

    result = subprocess.run([sys.executable, "-c", GPU_PROCESS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "cpu_redirections": False, "fuser_is_identity": True, "router_bias_compiled": False,
        "rope": "megatron_rl.runtime.megatron_patches"}
