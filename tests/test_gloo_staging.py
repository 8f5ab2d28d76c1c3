"""gloo staging (``parallel.backend=gloo`` on GPUs): real Megatron Core jobs with every collective staged through
separate CPU buffers equal the same jobs without staging, and the staged ops are the ones each layout issues.

``MEGATRON_RL_GLOO_STAGING=1`` (megatron_rl/runtime/gloo_staging.py) installs on these CPU jobs the wrappers a GPU
job with backend gloo gets, staging CPU tensors too, so the copy-in, the op on the copy and the copy-back run for
real. Each layout runs twice through launch.py (2 local gloo processes), once plain and once staged; all six jobs
run at once.

* tp2: GRPO (one SFT warm-up step, one GRPO step) at TP=2: TP mappings, vocab-parallel cross entropy, the async
  TP all-reduce of the backward pass, the distributed optimizer's buffers, and generation's own collectives;
* pp2: pretraining at PP=2: pipeline sends and receives (batch_isend_irecv of P2POps);
* dp2: pretraining at DP=2 with the distributed optimizer and overlapped grad reduce: async reduce-scatter and
  all-gather inside Megatron's coalescing manager, waited for later through its handle.

Run: ``.venv/bin/python -m pytest tests/test_gloo_staging.py -q``
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import read_metrics, run_launch, without_measurements

from megatron_rl.runtime.gloo_staging import STAGE_EVERY_TENSOR_ENV

COMMON = ["cluster.executor=local", "logging.tensorboard=false", "checkpoint.save_at_end=false", "run.steps=2"]
PRETRAIN = ["algorithm.name=pretrain", "algorithm.global_batch_size=4", "parallel.micro_batch_size=1"]
GRPO = ["algorithm.sft_warmup_steps=1", "algorithm.prompts_per_step=4", "algorithm.group_size=4",
        "algorithm.global_batch_size=8", "parallel.micro_batch_size=4"]
LAYOUTS = {
    "tp2": [*GRPO, "parallel.tp=2"],
    "pp2": [*PRETRAIN, "parallel.pp=2"],
    "dp2": [*PRETRAIN, "parallel.distributed_optimizer=true", "runtime.overlap_grad_reduce=true"],
}
MC = "megatron/core/"
STAGED_SITES = {  # per layout: op@call site that every rank must have staged
    "tp2": {f"all_reduce@{MC}tensor_parallel/mappings.py:_reduce", f"all_reduce@{MC}tensor_parallel/layers.py:backward",
            f"all_reduce@{MC}tensor_parallel/cross_entropy.py:forward",
            f"all_gather_into_tensor@{MC}tensor_parallel/mappings.py:_gather_along_last_dim",
            f"reduce_scatter_tensor@{MC}distributed/param_and_grad_buffer.py:start_grad_sync",
            f"all_gather_into_tensor@{MC}distributed/param_and_grad_buffer.py:start_param_sync",
            f"all_reduce@{MC}optimizer/clip_grads.py:get_grad_norm_fp32"},
    "pp2": {f"batch_isend_irecv@{MC}pipeline_parallel/p2p_communication.py:_batched_p2p_ops"},
    "dp2": {f"reduce_scatter_tensor@{MC}distributed/param_and_grad_buffer.py:start_grad_sync",
            f"all_gather_into_tensor@{MC}distributed/param_and_grad_buffer.py:start_param_sync"},
}


def _staged_counts(run_dir: Path) -> list[dict[str, int]]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "logs").glob("gloo_staged_rank*.json"))]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """(layout, staged) -> run folder of the finished job."""
    root = tmp_path_factory.mktemp("gloo_staging")
    cases = [(layout, staged) for layout in LAYOUTS for staged in (False, True)]

    def run(case):
        layout, staged = case
        run_dir = root / f"{layout}_{'staged' if staged else 'plain'}"
        env = {STAGE_EVERY_TENSOR_ENV: "1" if staged else "0"}
        result = run_launch(*COMMON, *LAYOUTS[layout], f"run.dir={run_dir}", env=env, timeout=240)
        assert result.returncode == 0, f"{case}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return run_dir

    with ThreadPoolExecutor(len(cases)) as pool:
        return dict(zip(cases, pool.map(run, cases)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staged_job_equals_the_plain_job(jobs, layout):
    plain, staged = (without_measurements(read_metrics(jobs[layout, s])) for s in (False, True))
    assert [m["step"] for m in staged] == [m["step"] for m in plain] and len(plain) >= 2
    for ref, got in zip(plain, staged, strict=True):
        assert set(got) == set(ref)
        for key, value in ref.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, abs=1e-6), (key, ref, got)
            else:
                assert got[key] == value, (key, ref, got)
    assert any(m.get("grad_norm", 0) > 0 for m in plain)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_staged_the_ops_of_its_layout(jobs, layout):
    per_rank = _staged_counts(jobs[layout, True])
    assert len(per_rank) == 2
    for counts in per_rank:
        assert all(n > 0 for n in counts.values())
        assert sorted(STAGED_SITES[layout] - set(counts)) == [], sorted(counts)
    assert _staged_counts(jobs[layout, False]) == []  # without the hook a CPU job installs nothing
