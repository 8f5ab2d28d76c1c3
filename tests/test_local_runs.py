"""Real Megatron Core jobs started through launch.py with the local executor (processes over gloo, CPU).

Each job is its own set of processes, so Megatron's process-global state never leaks between cases.
"""

from __future__ import annotations

import json

import pytest

from helpers import check_run_manifest, read_metrics, without_measurements

from megatron_rl.runtime.cpu_compat import EAGER_FUSIONS, KNOWN_SITES

PRETRAIN = ["cluster.executor=local", "algorithm.name=pretrain", "run.steps=4", "algorithm.global_batch_size=4",
            "parallel.micro_batch_size=1",
            "logging.tensorboard=false", "checkpoint.save_at_end=false"]


def _run(launch, run_dir, *extra, env=None):
    result = launch(*PRETRAIN, f"run.dir={run_dir}", *extra, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_metrics(run_dir)


WHOLE = ["run.steps=5"]
"""The step count of the shared uninterrupted run and of every run compared with it step by step."""


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """One uninterrupted 5-step run at TP=PP=1 (DP=2), shared by the layout comparisons and by the preemption and
    killed-save tests as their uninterrupted run. It saves with checkpoint.save_interval=auto and no warning
    window, whose rule saves the first step (to measure a save) and then waits 10 save durations, and at the end
    (keep_last=10 keeps every save); saves change no metric."""
    from helpers import run_launch
    run_dir = tmp_path_factory.mktemp("tp1")
    return _run(run_launch, run_dir, *BASELINE), run_dir


BASELINE = ["parallel.tp=1", "parallel.pp=1", *WHOLE, "checkpoint.save_at_end=true", "checkpoint.save_interval=auto",
            "cluster.signal_delay_s=0", "checkpoint.keep_last=10"]


def test_metrics_are_logged_per_step(baseline):
    metrics, _ = baseline
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert all(m["loss"] > 0 and m["grad_norm"] > 0 for m in metrics)
    assert metrics[0]["loss"] == pytest.approx(4.85, abs=0.1)  # ln(128): a fresh model is near-uniform
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_a_rerun_of_the_finished_run_starts_nothing_and_changes_nothing(launch, baseline):
    """The baseline ran its 5 steps and saved step 5: the same command again says so and exits 0 before any process
    starts, so its metrics, manifest, config and checkpoints stay as they were (never a restart from step 0, nor a
    resumed no-op that re-saves); its dry run says so above the usual output. With run.steps raised it would run on
    from step 5."""
    _, run_dir = baseline
    files = ("metrics.jsonl", "manifest.json", "config.yaml", "checkpoints/latest")
    before = {name: (run_dir / name).read_bytes() for name in files}
    again = launch(*PRETRAIN, f"run.dir={run_dir}", *BASELINE)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert (f"run.dir={run_dir} is complete: metrics.jsonl and its latest checkpoint reached run.steps=5. Nothing to "
            "run;") in again.stdout and "starting" not in again.stdout, again.stdout
    assert {name: (run_dir / name).read_bytes() for name in files} == before
    dry = launch(*PRETRAIN, f"run.dir={run_dir}", *BASELINE, "--dry-run")  # says so, and shows the job as ever
    assert dry.returncode == 0 and dry.stdout.startswith(f"# run.dir={run_dir} is complete")
    assert "# what would run" in dry.stdout
    longer = launch(*PRETRAIN, f"run.dir={run_dir}", *BASELINE, "run.steps=6", "--dry-run")
    assert longer.returncode == 0 and "is complete" not in longer.stdout and "# what would run" in longer.stdout


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.recompute=full", "parallel.recompute_num_layers=1"],
                                    ["parallel.pp=2", "runtime.attention=unfused"]],
                         ids=["tp2_block_recompute", "pp2_unfused_attention"])
def test_model_parallel_matches_data_parallel(launch, tmp_path, baseline, layout):
    """TP=2 (or PP=2) on 2 processes vs TP=PP=1 (DP=2): same seed, same global batch -> same losses; the TP run
    with a partial (block) recompute of 1 of its 2 layers, the PP run with Megatron's unfused attention against
    the baseline's SDPA (runtime.attention=auto: flash). Each differs from the baseline in two ways at once, to
    start two jobs rather than four; either way off would show."""
    reference, _ = baseline
    metrics = _run(launch, tmp_path / "run", *WHOLE, *layout)
    for ref, got in zip(reference, metrics, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], abs=2e-5), (ref, got)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_overlapped_grad_reduce_equals_the_reduce_after_backward(launch, tmp_path, baseline):
    """runtime.overlap_grad_reduce (on in the baseline: DP=2, 2 micro-batches per rank, so the first runs under
    no_sync) reduces the same buckets during the backward pass: the same metrics, bit for bit."""
    reference, _ = baseline
    metrics = _run(launch, tmp_path / "run", *WHOLE, "parallel.tp=1", "parallel.pp=1",
                   "runtime.overlap_grad_reduce=false")
    assert without_measurements(metrics) == without_measurements(reference)


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    """Two bf16-parameter runs (DP=2), with fp32 and with bf16 main grads; each saves its last step."""
    from helpers import run_launch
    root = tmp_path_factory.mktemp("bf16")
    return {dtype: (_run(run_launch, root / dtype, "model.dtype=bf16", f"runtime.grad_dtype={dtype}",
                         "checkpoint.save_at_end=true"), root / dtype) for dtype in ("fp32", "bf16")}


def test_bf16_gradients_reach_the_optimizer(bf16_runs):
    """runtime.grad_dtype=bf16 (bf16 parameters, DP=2): main grads and their reduce in bf16 train like fp32 grads,
    to bf16 precision, and not identically (the setting reaches Megatron's DDP)."""
    (fp32, _), (bf16, _) = bf16_runs["fp32"], bf16_runs["bf16"]
    for ref, got in zip(fp32, bf16, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=2e-2)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-2)
    assert [m["grad_norm"] for m in bf16] != [m["grad_norm"] for m in fp32]


def test_bf16_run_from_init_from_steps_from_the_loaded_weights(launch, tmp_path, bf16_runs):
    """model.init_from is loaded after the optimizer is built; with bf16 parameters the optimizer's fp32 main
    copies must be refreshed from the loaded weights (Megatron's reload_model_params), or the first step writes
    the fresh random init (here seed 7, not the checkpoint's) back into the model."""
    import torch

    from megatron_rl.conversion.dist_reader import CheckpointReader

    start = bf16_runs["fp32"][1] / "checkpoints"
    _run(launch, tmp_path / "next", "model.dtype=bf16", "run.steps=1", "run.seed=7", "checkpoint.save_at_end=true",
         f"model.init_from={start}")
    before, after = CheckpointReader(start), CheckpointReader(tmp_path / "next" / "checkpoints")
    refs = [ref for ref in before.index if ref in after.index]
    assert len(refs) >= 4
    moved = max(float((a - b).abs().max()) for a, b in zip(before.read(refs, dtype=torch.float32).values(),
                                                             after.read(refs, dtype=torch.float32).values()))
    assert 0 < moved < 3 * 2e-3  # one Adam step of at most ~lr (optimizer.lr) per weight, plus bf16 rounding


def test_cpu_redirections_are_all_reviewed(baseline):
    """The CPU shim counts every Megatron call site it rewrites; a site nobody reviewed fails here."""
    _, run_dir = baseline
    counts = {}
    for path in sorted((run_dir / "logs").glob("cpu_redirects_rank*.json")):
        counts.update(json.loads(path.read_text()))
    assert counts, "the CPU redirection recorded nothing: is it still applied?"
    assert sorted(set(counts) - KNOWN_SITES) == []
    assert counts.get(EAGER_FUSIONS, 0) > 0, "Megatron was imported before cpu_compat.apply(): its fusions compile"
    deferred = [json.loads(path.read_text()) for path in sorted((run_dir / "logs").glob("deferred_imports_rank*.json"))]
    assert deferred and all(d == {"wandb": True} for d in deferred), "logging.wandb is off, yet wandb was imported"


def test_preempted_run_resumes_with_identical_metrics(launch, tmp_path, baseline):
    """Stop after step 2 (the preemption path: save, exit 3), rerun: metrics equal the uninterrupted run's (the
    shared baseline, which saved with checkpoint.save_interval=auto: saves change no metric)."""
    whole, whole_dir = baseline
    assert (whole_dir / "checkpoints" / "step_00000001").is_dir()
    run_dir = tmp_path / "interrupted"
    first = launch(*PRETRAIN, f"run.dir={run_dir}", *WHOLE, env={"MEGATRON_RL_STOP_AFTER_STEP": "2"})
    assert first.returncode == 3, first.stdout[-2000:] + first.stderr[-2000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    resumed = _run(launch, run_dir, *WHOLE)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    assert without_measurements(whole) == without_measurements(resumed)
    audit = check_run_manifest(whole_dir, statuses=["completed"])  # every save listed: keep_last=10 kept them all
    saved = sorted(int(p.name.removeprefix("step_")) for p in (whole_dir / "checkpoints").glob("step_*"))
    assert sorted(c["step"] for c in audit["checkpoints"]) == saved and len(saved) >= 2
    audit = check_run_manifest(run_dir, statuses=["preempted", "completed"])  # the rerun added an attempt
    assert [a["resumed_from_step"] for a in audit["attempts"]] == [None, 2]
    assert [(c["step"], c["attempt"]) for c in audit["checkpoints"]][:1] == [(2, 1)]


def test_sigkill_during_a_save_resumes_from_the_previous_complete_checkpoint(launch, tmp_path, baseline):
    """Every rank is SIGKILLed after writing step 4's files but before publishing them: the half-written save
    must not count, the rerun resumes from step 2 and ends where the uninterrupted run (the shared baseline)
    ends. The last step (5) is not saved (checkpoint.save_at_end=false): step 4 is the rerun's only save."""
    whole, _ = baseline
    run_dir = tmp_path / "killed"
    args = (*PRETRAIN, f"run.dir={run_dir}", *WHOLE, "checkpoint.save_interval=2", "checkpoint.keep_last=5")
    killed = launch(*args, env={"MEGATRON_RL_FAULT": "kill-during-save:4"})
    assert killed.returncode != 0
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert (ckpts / ".tmp-step_00000004").is_dir() and not (ckpts / "step_00000004").exists()
    resumed = launch(*args)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "step_00000002 (step 2" in resumed.stdout
    assert not (ckpts / ".tmp-step_00000004").exists()
    assert without_measurements(read_metrics(run_dir)) == without_measurements(whole)
    audit = check_run_manifest(run_dir, statuses=["lost: ended without recording its end", "completed"])
    assert [(c["step"], c["attempt"]) for c in audit["checkpoints"]] == [(2, 1), (4, 2)]  # no half-written 4


def test_tp2_pp2_checkpoint_resumes_at_tp1_with_the_same_loss(launch, tmp_path, baseline):
    """Save at TP=2 x PP=2 (4 processes), resume at TP=1 on one process: the next losses match a TP=1 run's (the
    shared baseline, same global batch)."""
    reference, _ = baseline
    run_dir = tmp_path / "resharded"
    _run(launch, run_dir, "run.steps=3", "parallel.tp=2", "parallel.pp=2", "cluster.tasks_per_node=4",
         "checkpoint.save_at_end=true")
    resumed = _run(launch, run_dir, *WHOLE, "cluster.tasks_per_node=1")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    for ref, got in zip(reference[3:], resumed[3:], strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-4), (ref, got)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)


def _tiny_with_layers(folder, num_layers: int) -> str:
    """model.name of a tiny-cpu variant with ``num_layers`` layers (a Megatron-style YAML in ``folder``)."""
    import yaml

    from megatron_rl.spec.resources import presets_dir

    preset = yaml.safe_load((presets_dir() / "tiny-cpu.yaml").read_text())
    model = folder / f"tiny-{num_layers}-layers.yaml"
    model.write_text(yaml.safe_dump({**preset, "name": f"tiny-{num_layers}-layers", "num_layers": num_layers}))
    return f"model.name={model}"


def _assert_same_losses(reference, metrics):
    for ref, got in zip(reference, metrics, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-3), (ref, got)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)


def test_uneven_pipeline_split_matches_one_stage(launch, tmp_path):
    """5 layers on pp=2: the launcher picks the 3 + 2 split itself, and training equals the 1-stage run (DP=2)."""
    import yaml

    model = _tiny_with_layers(tmp_path, 5)
    one_stage = _run(launch, tmp_path / "pp1", model)
    two_stages = _run(launch, tmp_path / "pp2", model, "parallel.pp=2")
    resolved = yaml.safe_load((tmp_path / "pp2" / "config.yaml").read_text())["parallel"]
    assert (resolved["first_stage_layers"], resolved["last_stage_layers"]) == (3, 2)
    _assert_same_losses(one_stage, two_stages)


def test_embedding_and_loss_counted_as_layers_matches_one_stage(launch, tmp_path):
    """4 layers on pp=3 with the embedding and the loss counted as layers (the split the planner picks for the
    405B): stages of 1, 2 and 1 decoder layers, trained like one stage (DP=3)."""
    model, batch = _tiny_with_layers(tmp_path, 4), ["cluster.tasks_per_node=3", "algorithm.global_batch_size=6"]
    one_stage = _run(launch, tmp_path / "pp1", model, *batch)
    three_stages = _run(launch, tmp_path / "pp3", model, *batch, "parallel.pp=3", "parallel.account_for_embedding=true",
                        "parallel.account_for_loss=true")
    _assert_same_losses(one_stage, three_stages)
