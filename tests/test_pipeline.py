"""``launch.py pipeline``: configs/pipeline_tiny.yaml (SFT -> RM -> GRPO -> eval of SFT and GRPO) run locally to
the end, interrupted and resumed, re-run (every stage skipped), shown by --dry-run and ``status``, bad pipeline
files; and on the dev Slurm cluster a short chain submitted with afterok that runs in order, and a failing first
stage that leaves the later ones cancelled.

    .venv/bin/python -m pytest tests/test_pipeline.py -q      # ~4 min on 2 cores (Slurm part: dev cluster up)

One local pipeline run is shared by the assertions: it is first stopped in the SFT stage
(MEGATRON_RL_STOP_AFTER_STEP), then re-run, which resumes SFT and runs the rest; a third run skips everything.
The Slurm tests use the ``slurm_cluster`` fixture of tests/slurm/conftest.py (skip without a cluster, fail with
REQUIRE_SLURM=1).
"""

from __future__ import annotations

import importlib.util
import json
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from helpers import REPO_ROOT, run_launch

_spec = importlib.util.spec_from_file_location("slurm_fixtures", REPO_ROOT / "tests" / "slurm" / "conftest.py")
slurm_fixtures = sys.modules.setdefault("slurm_fixtures", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(slurm_fixtures)
slurm_cluster = slurm_fixtures.slurm_cluster  # the Slurm tests' own fixture, reused as is

STAGES = ["sft", "rm", "grpo", "eval_sft", "eval_grpo"]
STOP_AT = 10
"""The SFT step after which the first run is stopped (as a preemption: checkpoint, exit)."""


def pipeline(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_launch("pipeline", "--config", "configs/pipeline_tiny.yaml", *args, env=env, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: ")
    for word in words:
        assert word in result.stderr, result.stderr


def read_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@dataclass(frozen=True, kw_only=True)
class LocalPipeline:
    """pipeline_tiny run three times into one folder."""

    dir: Path
    """The pipeline folder."""
    stopped: subprocess.CompletedProcess
    """The first run, stopped after SFT step STOP_AT."""
    resumed: subprocess.CompletedProcess
    """The second run: resumes SFT, runs the rest to the end."""
    resumed_s: float
    """Its wall time."""
    again: subprocess.CompletedProcess
    """The third run: every stage complete."""
    again_s: float
    """Its wall time."""
    stopped_checkpoints: list[str]
    """SFT's checkpoint folders after the first run."""
    stopped_stages: list[str]
    """The stage folders after the first run."""


@pytest.fixture(scope="module")
def local_pipeline(tmp_path_factory: pytest.TempPathFactory) -> LocalPipeline:
    folder = tmp_path_factory.mktemp("pipeline") / "tiny pipeline"
    stopped = pipeline(f"pipeline.dir={folder}", env={"MEGATRON_RL_STOP_AFTER_STEP": str(STOP_AT)})
    checkpoints = sorted(p.name for p in (folder / "sft" / "checkpoints").glob("step_*"))
    stopped_stages = sorted(p.name for p in folder.iterdir() if p.is_dir())
    start = time.monotonic()
    resumed = pipeline(f"pipeline.dir={folder}")
    resumed_s = time.monotonic() - start
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    start = time.monotonic()
    again = pipeline(f"pipeline.dir={folder}")
    return LocalPipeline(dir=folder, stopped=stopped, resumed=resumed, resumed_s=resumed_s, again=again,
                         again_s=time.monotonic() - start, stopped_checkpoints=checkpoints,
                         stopped_stages=stopped_stages)


@pytest.mark.slow
def test_a_failing_stage_stops_the_pipeline_with_one_line(local_pipeline: LocalPipeline) -> None:
    stopped, folder = local_pipeline.stopped, local_pipeline.dir
    assert stopped.returncode != 0
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("error: pipeline stopped: stage sft failed"), stopped.stderr[-2000:]
    assert str(folder / "sft" / "logs" / "rank0.log") in last
    assert local_pipeline.stopped_checkpoints == [f"step_{STOP_AT:08d}"]
    assert local_pipeline.stopped_stages == ["sft"]  # nothing after the failed stage started


@pytest.mark.slow
def test_the_interrupted_stage_resumes_and_the_pipeline_runs_to_the_end(local_pipeline: LocalPipeline) -> None:
    out, folder = local_pipeline.resumed.stdout, local_pipeline.dir
    assert f"resumed from {folder / 'sft' / 'checkpoints' / f'step_{STOP_AT:08d}'} (step {STOP_AT}" in out
    assert f"step   {STOP_AT + 1}/30" in out and "step    1/30" not in out
    for number, name in enumerate(STAGES, 1):
        assert f"pipeline: stage {name} ({number}/5)" in out
        assert (folder / name / "config.yaml").is_file()
        assert read_yaml(folder / name / "config.yaml")["run"]["dir"] == str(folder / name)
    assert (folder / "stages.txt").read_text().split() == STAGES
    assert "pipeline: complete in" in out
    print(f"pipeline_tiny resumed run: {local_pipeline.resumed_s:.0f} s")


@pytest.mark.slow
def test_stage_references_resolve_to_the_earlier_stage_folders(local_pipeline: LocalPipeline) -> None:
    folder = local_pipeline.dir
    grpo = read_yaml(folder / "grpo" / "config.yaml")
    assert grpo["model"]["init_from"] == str(folder / "sft" / "checkpoints")
    assert grpo["algorithm"]["reward_model"] == str(folder / "rm" / "checkpoints")
    assert set(grpo["algorithm"]["rewards"]) == {"exact", "rm"}
    assert read_yaml(folder / "eval_grpo" / "config.yaml")["model"]["init_from"] == str(folder / "grpo" / "checkpoints")


@pytest.mark.slow
def test_eval_json_shows_grpo_well_above_sft(local_pipeline: LocalPipeline) -> None:
    path = local_pipeline.dir / "eval.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    entries = json.loads(path.read_text())
    assert sorted(entries) == ["grpo", "sft"]
    for entry in entries.values():
        assert {"pass@1", "pass@k", "k", "mean_reward", "mean_response_length", "n_prompts"} <= set(entry)
    sft, grpo = entries["sft"], entries["grpo"]
    assert sft["n_prompts"] == grpo["n_prompts"] > 0
    assert grpo["pass@1"] >= sft["pass@1"] + 0.3, entries
    print(f"pass@1 sft {sft['pass@1']:.3f} -> grpo {grpo['pass@1']:.3f}")


@pytest.mark.slow
def test_a_re_run_skips_every_completed_stage(local_pipeline: LocalPipeline) -> None:
    again = local_pipeline.again
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    for number, name in enumerate(STAGES, 1):
        assert f"pipeline: stage {name} ({number}/5) skipped: " in again.stdout
    assert "starting" not in again.stdout and local_pipeline.again_s < 20


@pytest.mark.slow
def test_status_shows_every_stage_completed(local_pipeline: LocalPipeline) -> None:
    status = json.loads(run_launch("status", str(local_pipeline.dir), "--json").stdout)
    assert status["kind"] == "pipeline"
    assert [stage["stage"] for stage in status["stages"]] == STAGES  # stages.txt's order
    states = {stage["stage"]: stage["state"] for stage in status["stages"]}
    assert all(state == "COMPLETED" for state in states.values()), states  # eval stages: by their eval.json
    assert status["state"] == "COMPLETED", states


def test_dry_run_shows_each_resolved_stage_and_the_chain(tmp_path: Path) -> None:
    folder = tmp_path / "p"
    result = pipeline(f"pipeline.dir={folder}", "--dry-run", "stages.grpo.run.steps=7", "logging.console=quiet")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for number, name in enumerate(STAGES, 1):
        assert f"# ---- stage {number}/5: {name} (" in out
    assert "sft -> rm -> grpo -> eval_sft -> eval_grpo" in out
    assert f"init_from: {folder / 'sft' / 'checkpoints'}" in out
    assert f"reward_model: {folder / 'rm' / 'checkpoints'}" in out
    assert f"dir: {folder / 'eval_grpo'}" in out and "${stages." not in out
    grpo = out.split("stage 3/5: grpo")[1].split("# ---- stage 4/5")[0]
    assert "steps: 7" in grpo and "console: quiet" in grpo
    assert not folder.exists()  # nothing started, nothing written


def test_dry_run_on_slurm_shows_the_afterok_chain_and_keeps_env_references(tmp_path: Path) -> None:
    result = pipeline(f"pipeline.dir={tmp_path / 'p'}", "--dry-run", "cluster.executor=slurm",
                      "stages.sft.cluster.job_name=${oc.env:PIPELINE_TEST_NAME}", env={"PIPELINE_TEST_NAME": "sekrit"})
    assert result.returncode == 0, result.stderr
    assert "--dependency=afterok:" in result.stdout and "--kill-on-invalid-dep=yes" in result.stdout
    assert "executor: slurm" in result.stdout and "executor: local" not in result.stdout
    assert "job_name: ${oc.env:PIPELINE_TEST_NAME}" in result.stdout and "sekrit" not in result.stdout


BAD_STAGES = {
    "unknown reference": ("  b:\n    config: sft_tiny\n    model: {init_from: '${stages.nope.checkpoint}'}\n",
                          "names no earlier stage"),
    "later reference": ("  b:\n    config: sft_tiny\n    model: {init_from: '${stages.c.checkpoint}'}\n"
                        "  c:\n    config: sft_tiny\n", "names no earlier stage"),
    "name used twice": ("  a:\n    config: sft_tiny\n", "'a' is given twice"),
    "missing config": ("  b:\n    config: no_such_config\n", "stages.b.config: config file no_such_config not found"),
    "unknown stage key": ("  b:\n    config: sft_tiny\n    rnu: {steps: 3}\n", "did you mean 'stages.b.run'"),
}


@pytest.mark.parametrize("case", sorted(BAD_STAGES))
def test_bad_pipeline_files_are_one_line_errors(tmp_path: Path, case: str) -> None:
    stages, words = BAD_STAGES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(f"pipeline: {{dir: {tmp_path / 'p'}}}\nstages:\n  a:\n    config: sft_tiny\n{stages}")
    assert_one_line_error(run_launch("pipeline", "--config", str(path), "--dry-run"), words)


def test_a_pipeline_file_given_to_run_or_plan_is_a_one_line_error() -> None:
    for command in (("plan",), ("--dry-run",)):
        assert_one_line_error(run_launch(*command, "--config", "configs/pipeline_tiny.yaml"), "is a pipeline",
                              "launch.py pipeline --config configs/pipeline_tiny.yaml")


def test_bad_command_line_keys_are_one_line_errors(tmp_path: Path) -> None:
    assert_one_line_error(pipeline("stages.grop.run.steps=3", "--dry-run"), "no stage 'grop'", "did you mean 'grpo'")
    assert_one_line_error(pipeline("pipeline.dri=x", "--dry-run"), "did you mean 'pipeline.dir'")
    for key in ("run.dir", "stages.grpo.run.dir"):  # the stages run in pipeline.dir/NAME: not silently ignored
        assert_one_line_error(pipeline(f"{key}=elsewhere", "--dry-run"), "not in run.dir", "pipeline.dir=elsewhere")
    assert_one_line_error(run_launch("pipeline", "--config", str(tmp_path / "none.yaml")), "not found")


# ---------------- the dev Slurm cluster ----------------
SLURM_PIPELINE = """\
pipeline: {{dir: {dir}}}
cluster: {{executor: slurm, nodes: 1, tasks_per_node: 1}}
logging: {{tensorboard: false, plot: false}}
stages:
  sft:
    config: sft_tiny
    data: {{task: first_digit}}
    run: {{steps: 3}}
  rm:
    config: rm_tiny
    model: {{init_from: "${{stages.sft.checkpoint}}"}}
    parallel: {{micro_batch_size: 8}}
    run: {{steps: 2}}
  eval_sft:
    config: grpo_tiny
    algorithm: {{name: eval}}
    model: {{init_from: "${{stages.sft.checkpoint}}"}}
    eval: {{stage: sft, samples: 1, max_prompts: 8}}
"""
SLURM_STAGES = ["sft", "rm", "eval_sft"]


def slurm_pipeline(cluster, folder: Path, *args: str) -> subprocess.CompletedProcess:
    path = folder.parent / f"{folder.name}.yaml"
    path.write_text(SLURM_PIPELINE.format(dir=json.dumps(str(folder))))
    return run_launch("pipeline", "--config", str(path), *args, env=cluster.env(), timeout=480)


def stage_job_ids(folder: Path) -> list[str]:
    status = json.loads(run_launch("status", str(folder), "--json").stdout)
    return [stage["jobs"][-1]["job_id"] for stage in status["stages"]]


@pytest.fixture(scope="module")
def slurm_chain(slurm_cluster, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("slurm-pipeline") / "chain"
    return folder, slurm_pipeline(slurm_cluster, folder, "--wait")


@pytest.mark.slurm
def test_slurm_pipeline_runs_its_chained_jobs_in_order(slurm_cluster, slurm_chain) -> None:
    folder, result = slurm_chain
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ids = [slurm_fixtures.JOB_ID.search(part).group(1) for part in result.stdout.split("pipeline: stage ")[1:]]
    assert len(ids) == 3 and f"after job(s) {ids[0]} (afterok)" in result.stdout
    times = {}
    for job_id in ids:
        fields = slurm_cluster.run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,Start,End").stdout
        state, start, end = fields.strip().splitlines()[-1].split("|")
        assert state == "COMPLETED", (job_id, fields)
        times[job_id] = (start, end)
    for earlier, later in zip(ids, ids[1:]):
        assert times[earlier][1] <= times[later][0], times  # ISO times: each starts after the previous ended
    status = json.loads(run_launch("status", str(folder), "--json", env=slurm_cluster.env()).stdout)
    assert [s["stage"] for s in status["stages"]] == SLURM_STAGES and status["state"] == "COMPLETED", status
    assert [s["jobs"][-1]["job_id"] for s in status["stages"]] == ids
    text = run_launch("status", str(folder), env=slurm_cluster.env()).stdout
    assert all(f"stage {name}: COMPLETED" in text for name in SLURM_STAGES), text
    assert "sft" in json.loads((folder / "eval.json").read_text())
    again = slurm_pipeline(slurm_cluster, folder)
    assert again.returncode == 0 and again.stdout.count(") skipped: ") == 3, again.stdout + again.stderr


@pytest.mark.slurm
def test_a_missed_eval_gate_on_slurm_ends_the_job_with_the_gate_code_and_is_not_requeued(slurm_cluster, slurm_chain,
                                                                                        tmp_path) -> None:
    """The gate's exit code (4) is not the requeue code (3) the job script requeues on: one job, FAILED, named."""
    from megatron_rl.spec.run_files import GATE_EXIT_CODE

    folder, _ = slurm_chain
    run_dir = tmp_path / "gated"
    result = run_launch("eval", "--ckpt", str(folder / "sft" / "checkpoints"), "--wait", "eval.stage=gated",
                        "eval.samples=1", "eval.max_prompts=8", "eval.min_pass_at_1=1.0", "cluster.executor=slurm",
                        "cluster.nodes=1", "cluster.tasks_per_node=1", "cluster.max_requeues=2",
                        f"run.dir={run_dir}", env=slurm_cluster.env(), timeout=300)
    assert result.returncode == GATE_EXIT_CODE, result.stdout[-3000:] + result.stderr[-3000:]
    job_id = slurm_fixtures.JOB_ID.search(result.stdout).group(1)
    assert f"slurm: job {job_id} ended with exit code 4: the evaluation missed eval.min_pass_at_1" in result.stderr
    assert json.loads((run_dir / "eval.json").read_text())["gated"]["kept"] is False
    records = slurm_cluster.run("sacct", "-n", "-X", "-D", "-P", "-j", job_id, "-o", "State").stdout.split()
    assert records == ["FAILED"], records  # -D lists every requeued run of the job: there is one


@pytest.mark.slurm
def test_a_failing_first_slurm_stage_cancels_the_rest(slurm_cluster, tmp_path_factory) -> None:
    folder = tmp_path_factory.mktemp("slurm-pipeline") / "failing"
    result = slurm_pipeline(slurm_cluster, folder, "stages.sft.model.init_from=/nonexistent/checkpoints")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]  # without --wait: submitted
    ids = [slurm_fixtures.JOB_ID.search(part).group(1) for part in result.stdout.split("pipeline: stage ")[1:]]
    assert len(ids) == 3
    assert slurm_cluster.wait_sacct_state(ids[0], timeout=180) == "FAILED"
    for job_id in ids[1:]:  # Slurm cancels them (--kill-on-invalid-dep=yes): they never start
        assert slurm_cluster.wait_sacct_state(job_id, timeout=60) == "CANCELLED"
        start = slurm_cluster.run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "Start").stdout.strip()
        assert start in ("None", "Unknown", ""), start
    status = json.loads(run_launch("status", str(folder), "--json", env=slurm_cluster.env()).stdout)
    assert [s["state"] for s in status["stages"]] == ["FAILED", "CANCELLED", "CANCELLED"], status
    assert status["state"] == "FAILED"


def test_a_second_pipeline_into_a_folder_in_use_is_refused(tmp_path: Path) -> None:
    """#35 defect 8: pipeline.dir is locked like a run folder; while a live process holds it, a second
    `launch.py pipeline` into it stops with one line and starts nothing."""
    from launcher.lock import acquire

    folder = tmp_path / "p"
    with acquire(folder, key="pipeline.dir"):  # this (live) process holds it
        result = pipeline(f"pipeline.dir={folder}")
        assert_one_line_error(result, f"pipeline.dir={folder} is in use by pid", "give another pipeline.dir")
    assert sorted(p.name for p in folder.iterdir()) == []  # no stage folder, no pipeline files; the lock released
