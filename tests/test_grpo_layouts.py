"""GRPO and its colocated generation at MoE TP2·EP2·SP, CP2, an uneven PP2 split and a hand-written PP2 x VPP2 pipeline
layout (real Megatron Core, gloo, CPU).

Every case runs in its own processes, started through launch.py.

* TP·EP·SP and PP: generation still has one data-parallel rank, so the first step's rewards equal the
  1-process run's (same seed, same sampling stream), and so do the losses.
* CP2: the two CP ranks generate as two rollout workers, exactly as the two DP ranks of the default 2-process
  job do (same prompts split, same per-worker seeds), so the CP2 job must reproduce the DP2 job, with a
  sequence-mean loss whose per-sequence lengths cross the CP ranks.
* Everywhere: the first mini-batch's importance ratio is 1 (generation log-probs = the training forward's).
* The MoE TP2·EP2·SP (with router replay), PP2 and DP2 runs pack their rows (parallel.micro_batch_tokens), their
  references do not: the losses above hold for packed against padded micro-batches.
* tests/dist/gen_layouts.py: generation log-probs vs the training forward at the layout, with rollout workers
  whose prompt lengths differ (EP across DP replicas must decode in lockstep); tests/dist/grpo_loss_cp.py: the
  trainer's loss on CP parts of sequences = the pure loss of the whole sequences, value and gradient.

Run: ``.venv/bin/python -m pytest tests/test_grpo_layouts.py -q``
"""

from __future__ import annotations

import json
import math

import pytest

from helpers import read_metrics, run_launch, torchrun_check

SHORT = ["cluster.executor=local", "logging.tensorboard=false", "checkpoint.save_at_end=false",
         "algorithm.sft_warmup_steps=30", "algorithm.prompts_per_step=4", "algorithm.group_size=4",
         "algorithm.global_batch_size=8", "parallel.micro_batch_size=4", "run.steps=2"]
MOE = ["model.name=tiny-cpu-moe"]
SEQ_MEAN = ["algorithm.loss_aggregation=seq-mean-token-mean"]
RATIO_TOL = 1e-5
LOGPROB_TOL = 1e-5


def _grpo(run_dir, *extra) -> list[dict]:
    result = run_launch(*SHORT, f"run.dir={run_dir}", *extra)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [m for m in read_metrics(run_dir) if m.get("phase") is None]


PACKED = ["parallel.micro_batch_tokens=40"]
"""Sequence packing (megatron_rl/rollout/packing.py): each layout run is packed, its reference padded."""

RUNS = {  # name: overrides; FIVE_LAYERS is the 5-layer tiny-cpu variant
    # router replay on in both MoE runs: after a rollout's first optimizer step the replayed routes are the
    # sampling policy's, no longer the current one's, so a run with replay is compared with a run with replay
    "moe_1proc": [*MOE, "cluster.tasks_per_node=1", "algorithm.router_replay=true"],
    "moe_tp2_ep2_sp": [*MOE, "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                       "algorithm.router_replay=true", *PACKED],
    "pp1_5layers": ["FIVE_LAYERS", "cluster.tasks_per_node=1"],
    "pp2_5layers": ["FIVE_LAYERS", "parallel.pp=2", *PACKED],
    # a hand-written uneven interleaved layout: rank 0 holds the embedding alone, then 1 layer; rank 1 holds 3, then 1
    # and the loss (0 + 3 + 1 + 1 layers over pp 2 x vpp 2)
    "pp2_vpp2_layout": ["FIVE_LAYERS", "parallel.pp=2", "parallel.pipeline_layout=E|ttt|t|tL",
                        "checkpoint.save_at_end=true"],
    "dp2_seq_mean": [*SEQ_MEAN, *PACKED],
    "cp2_seq_mean": [*SEQ_MEAN, "parallel.cp=2"],
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """job(name) -> (metrics of its GRPO steps, run folder); each job runs once, when a test first needs it."""
    import yaml

    from megatron_rl.spec.resources import presets_dir

    preset = yaml.safe_load((presets_dir() / "tiny-cpu.yaml").read_text())
    model = tmp_path_factory.mktemp("model") / "tiny-5-layers.yaml"
    model.write_text(yaml.safe_dump({**preset, "name": "tiny-5-layers", "num_layers": 5}))
    done: dict = {}

    def get(name: str):
        if name not in done:
            extra = [f"model.name={model}" if arg == "FIVE_LAYERS" else arg for arg in RUNS[name]]
            run_dir = tmp_path_factory.mktemp(name)
            done[name] = (_grpo(run_dir, *extra), run_dir)
        return done[name]

    return get


def _torchrun(out, script: str, *args: str) -> list[dict]:
    return torchrun_check(script, out, *args)


# ------------------------------------------------------------------------------------------------ GRPO runs
@pytest.mark.parametrize("name", list(RUNS))
def test_first_minibatch_ratio_is_one(job, name):
    """Generation log-probs equal the training forward's at the layout (SP/CP on in training, off while
    generating): the first mini-batch's importance ratio is 1 within 1e-5, at every step."""
    metrics, _ = job(name)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert abs(m["first_ratio_min"] - 1) < RATIO_TOL and abs(m["first_ratio_max"] - 1) < RATIO_TOL, m
        assert m["minibatches"] == 2  # the whole rollout (16 completions) trained, in mini-batches of 8
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert m["train_tokens_per_real_token"] >= 1.0


@pytest.mark.parametrize("layout, reference", [("moe_tp2_ep2_sp", "moe_1proc"), ("pp2_5layers", "pp1_5layers"),
                                               ("pp2_vpp2_layout", "pp1_5layers"), ("cp2_seq_mean", "dp2_seq_mean")])
def test_same_rollout_workers_give_the_same_run(job, layout, reference):
    """One generation worker at TP2·EP2·SP, at PP2 (3 + 2 layers) and at the PP2 x VPP2 layout, as in the 1-process
    run; two at CP2
    (the CP ranks), as in the DP2 run: the same rewards, and the same losses as the reference layout."""
    got, _ = job(layout)
    ref, _ = job(reference)
    assert got[0]["reward_mean"] == ref[0]["reward_mean"]
    assert got[0]["response_length"] == ref[0]["response_length"]
    assert any(m["grad_norm"] > 0 for m in ref), "no reward signal: the comparison would be empty"
    for a, b in zip(ref, got, strict=True):
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (key, a, b)


def test_router_replay_run_trains_on_recorded_routes(job):
    """Both MoE runs replay every trained completion's routes (2 MoE layers per position), the same ones at
    TP2·EP2·SP as in one process; a dense run has none."""
    got, _ = job("moe_tp2_ep2_sp")
    ref, _ = job("moe_1proc")
    dense, _ = job("dp2_seq_mean")
    for m, r in zip(got, ref, strict=True):
        positions = m["response_length"] * 16  # completions per step, all trained
        assert m["replayed_routes"] > 2 * positions, m  # plus the prompts' positions
        assert m["replayed_routes"] == r["replayed_routes"]
    assert all("replayed_routes" not in m for m in dense)


def test_uneven_split_is_chosen_by_the_launcher(job):
    import yaml

    _, run_dir = job("pp2_5layers")
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())["parallel"]
    assert (resolved["first_stage_layers"], resolved["last_stage_layers"]) == (3, 2)


def test_a_checkpoint_trained_at_a_pipeline_layout_exports_and_verifies(job, tmp_path):
    """Checkpoints are layout-free: the one the PP2 x VPP2 layout saved exports to HF (the converter at its own
    pipeline split), whose transformers logits equal the Megatron checkpoint's."""
    _, run_dir = job("pp2_vpp2_layout")
    result = run_launch("convert", "megatron-to-hf", "--ckpt", str(run_dir / "checkpoints"), "--out",
                        str(tmp_path / "hf"), "--verify")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    verified = json.loads(result.stdout.strip().splitlines()[-1])
    assert verified["tensors_equal"] and verified["max_abs_logit_diff"] < 1e-4, verified


# ------------------------------------------------------------------------------------------ generation checks
NEW_TOKENS = 6
"""tests/dist/gen_layouts.py's new tokens per completion."""
GEN_LAYOUTS = ("cp2", "tp2_sp", "moe_tp2_ep2_sp", "moe_tp2_etp2_sp", "moe_ep2_dp2")
"""tests/dist/gen_layouts.py's LAYOUTS, checked in one launch."""


@pytest.fixture(scope="module")
def gen_layouts(tmp_path_factory):
    """Per layout, each rank's results of tests/dist/gen_layouts.py."""
    ranks = _torchrun(tmp_path_factory.mktemp("gen_layouts"), "gen_layouts.py", "--layouts", ",".join(GEN_LAYOUTS))
    return {layout: [rank[layout] for rank in ranks] for layout in GEN_LAYOUTS}


@pytest.mark.parametrize("layout", GEN_LAYOUTS)
def test_generation_logprobs_equal_training_forward_at_the_layout(gen_layouts, layout):
    ranks = gen_layouts[layout]
    workers = {r["worker"] for r in ranks}
    assert workers == ({0, 1} if layout in ("cp2", "moe_ep2_dp2") else {0})
    for rank in ranks:
        for name in ("greedy", "sampled", "eos", "grouped"):
            run = rank[name]
            assert run["rows_checked"] == (8 if name != "grouped" else 8 * len(workers)), (name, run)
            assert run["max_logprob_diff"] < LOGPROB_TOL, (name, run)
        # grouped prompts are prefilled once per distinct prompt
        assert rank["grouped"]["prefill_rows"] == (2 if rank["worker"] == 0 else 4), rank["grouped"]
        assert rank["flags_after"] == rank["flags_before"]  # SP / CP back on for training
        assert rank["train_after_generation"]["finite"]
    # the paged engine prefills each prompt whole: one forward, then one per new token
    assert all(r["greedy"]["forward_passes"] == NEW_TOKENS for r in ranks)
    if layout == "moe_ep2_dp2":  # experts span the workers: they step together, and a worker whose rows stopped
        # early keeps its peer company
        assert ranks[0]["eos"]["forward_passes"] == ranks[1]["eos"]["forward_passes"]


def test_loss_on_context_parallel_parts_equals_whole_sequences(tmp_path):
    for rank in _torchrun(tmp_path, "grpo_loss_cp.py"):
        for mode, got in rank["modes"].items():
            assert got["got"] == pytest.approx(got["expected"], rel=1e-6), mode
            assert got["reported"] == pytest.approx(got["expected"], rel=1e-6), mode
            assert got["max_grad_diff"] < 1e-6 * max(1.0, got["grad_scale"]), mode
        assert rank["modes"]["seq-mean-token-mean"]["denominator"] == 3  # each sequence counted once
        assert rank["modes"]["seq-mean-token-mean"]["local_denominator"] == (3 if rank["cp_rank"] == 0 else 0)
