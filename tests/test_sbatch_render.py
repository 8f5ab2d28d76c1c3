"""The sbatch template and its rendering, without a cluster: golden files, quoting, the job script's shell logic.

    .venv/bin/python -m pytest tests/test_sbatch_render.py -q
    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch_render.py -q     # rewrite tests/golden/*.sbatch

The shell-logic tests run the rendered scripts with bash and stand-in `srun`/`scontrol` programs that record
their arguments, so the quoting, the preemption mark and the requeue rule are checked on the real script text.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.spec.config import load_config
from megatron_rl.spec.config.schema import ClusterConfig
from megatron_rl.spec.errors import ConfigError
from launcher.job import prepare
from launcher.resources import templates_dir
from megatron_rl.spec.run_files import GATE_EXIT_CODE, JOB_EXIT_CODES, REQUEUE_EXIT_CODE
from launcher.slurm import executor as slurm_executor
from launcher.slurm.prepare import allocation_overrides
from launcher.slurm.script import (
    SETTINGS_END, TEMPLATE, TrainScript, load_template, render_convert_script, render_train_script, sbatch_options,
    slurm_time_seconds,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
PYTHON = "/opt/venv/bin/python"
EVIL = "it's a \"job\" $(touch PWNED) `touch PWNED2` ;x"


def _golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{name} differs from the golden file; if intended, rerun with UPDATE_GOLDEN=1"


def _describe(monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> str:
    monkeypatch.setattr(sys, "executable", PYTHON)
    job = prepare(load_config(None, ["cluster.executor=slurm", *overrides]))
    return slurm_executor.describe(job)


def test_golden_pretrain_two_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    _golden("pretrain-2node.sbatch", _describe(monkeypatch, [
        "algorithm.name=pretrain", "cluster.nodes=2", "cluster.tasks_per_node=1", "parallel.tp=2",
        "run.dir=/scratch/runs/pretrain-2node"]))


def test_golden_rm(monkeypatch: pytest.MonkeyPatch) -> None:
    _golden("rm-1day.sbatch", _describe(monkeypatch, ["algorithm.name=rm", "run.dir=/scratch/runs/rm",
                                                 "cluster.partition=batch", "cluster.time=1-00:00:00"]))


def test_golden_grpo_every_cluster_key() -> None:
    cluster = ClusterConfig(
        executor="slurm", nodes=16, tasks_per_node=8, gpus_per_node=8, cpus_per_task=12, mem="0", time="2-00:00:00",
        partition="gpu", account="llm-rl", qos="high", reservation="rl-week", constraint="h100&ib",
        exclude="gpu-[013,077]", job_name="grpo 405b", sbatch_extra=["--exclusive", "--comment=grpo run 7"],
        setup=["module load cuda/12.4", "source /opt/venv/bin/activate"],
        container_image="nvcr.io#nvidia/pytorch:25.01-py3",
        container_mounts=["/lustre:/lustre", "/home/me/repo:/workspace"], signal_delay_s=300, max_requeues=5)
    spec = TrainScript(algorithm="grpo", run_dir=Path("/lustre/runs/grpo-405b"),
                       config_path=Path("/lustre/runs/grpo-405b/config.yaml"), python="python3",
                       task=slurm_executor.submitit_command("python3", Path("/lustre/runs/grpo-405b/slurm")),
                       exports=[("SUBMITIT_EXECUTOR", "slurm")])
    _golden("grpo-all-keys.sbatch", render_train_script(cluster, spec))


def test_golden_convert() -> None:
    # The cluster's training values (8 GPU tasks, a checkpoint signal, requeues) do not reach the one-task job.
    cluster = ClusterConfig(tasks_per_node=8, gpus_per_node=8, cpus_per_task=16, mem="200G", time="08:00:00",
                            job_name="convert", partition="cpu", max_requeues=5)
    text = render_convert_script(cluster, run_dir=Path("/scratch/runs/convert"), python=PYTHON, convert_args=[
        "hf-to-megatron", "--hf", f"/models/Llama 3 {EVIL}", "--out", "/ckpt/llama3", "--tp", "8"])
    _golden("convert.sbatch", text)


def test_golden_hostile_names(monkeypatch: pytest.MonkeyPatch) -> None:
    _golden("hostile-names.sbatch", _describe(monkeypatch, [
        "algorithm.name=pretrain", f"cluster.job_name={EVIL}", f"run.dir=/scratch/runs/{EVIL}", "cluster.nodes=2",
        "cluster.tasks_per_node=1"]))


def test_template_header_has_the_schema_defaults() -> None:
    defaults = ClusterConfig()
    header = dict(line.removeprefix("#SBATCH ").partition("=")[::2] for line in load_template(TEMPLATE).header)
    assert header["--job-name"] == defaults.job_name and header["--nodes"] == str(defaults.nodes)
    assert header["--ntasks-per-node"] == str(defaults.tasks_per_node) and header["--time"] == defaults.time
    assert header["--signal"] == f"USR1@{defaults.signal_delay_s}" and "--requeue" in header


def test_rendered_sbatch_lines_round_trip_hostile_values() -> None:
    # sbatch splits #SBATCH values like a POSIX shell (checked on the dev cluster in tests/slurm).
    cluster = ClusterConfig(job_name=EVIL, partition="a b", sbatch_extra=["--comment=it's $(x)"])
    options = sbatch_options(cluster, output="/runs/x y/%j_batch.log")
    parsed = dict(shlex.split(option)[0].partition("=")[::2] for option in options)
    assert parsed["--job-name"] == EVIL and parsed["--partition"] == "a b" and parsed["--comment"] == "it's $(x)"
    assert parsed["--output"] == "/runs/x y/%j_batch.log"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"job_name": "a\ntouch /tmp/x"}, "cluster.job_name='a\\ntouch /tmp/x' holds a line break"),
    ({"sbatch_extra": ["--comment=a\rb"]}, "holds a line break"),
    ({"sbatch_extra": ["--time=10"]}, "sets --time, which cluster.time already sets"),
    ({"sbatch_extra": ["--output=/tmp/o"]}, "sets --output, which the launcher"),
    ({"sbatch_extra": ["--Exclusive"]}, "is not a long sbatch option"),
    ({"time": "4 hours"}, "cluster.time='4 hours' is not a Slurm time"),
    ({"time": "00:01:00", "signal_delay_s": 60}, "cluster.signal_delay_s=60 is not below cluster.time=00:01:00"),
    ({"container_mounts": ["/a"]}, "must look like /src:/dst"),
    ({"run_dir": "/runs/100%j"}, "run.dir='/runs/100%j' holds '%'"),
])
def test_bad_cluster_values_are_one_line_config_errors(overrides: dict, message: str) -> None:
    run_dir = Path(overrides.pop("run_dir", "/r"))
    spec = TrainScript(algorithm="pretrain", run_dir=run_dir, config_path=run_dir / "config.yaml", python=PYTHON)
    with pytest.raises(ConfigError) as info:
        render_train_script(ClusterConfig(**overrides), spec)
    assert message in str(info.value) and "\n" not in str(info.value).replace("\\n", "")


def test_jobs_are_requeueable_unless_max_requeues_is_0_or_sbatch_extra_says_otherwise() -> None:
    assert "--requeue" in sbatch_options(ClusterConfig(), output="/r/%j.log")
    assert "--no-requeue" not in sbatch_options(ClusterConfig(), output="/r/%j.log")
    never = sbatch_options(ClusterConfig(max_requeues=0), output="/r/%j.log")
    assert "--no-requeue" in never and "--requeue" not in never
    chosen = sbatch_options(ClusterConfig(sbatch_extra=["--no-requeue"]), output="/r/%j.log")
    assert chosen.count("--no-requeue") == 1 and "--requeue" not in chosen


def test_a_conversion_job_is_never_requeued() -> None:
    script = render_convert_script(ClusterConfig(max_requeues=5), run_dir=Path("/r"), convert_args=["x"],
                                   python=PYTHON)
    assert "#SBATCH --no-requeue" in script.splitlines() and "#SBATCH --requeue" not in script.splitlines()


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("30:15", 1815), ("04:00:00", 14400), ("1-00", 86400), ("2-03:04", 183840), ("1-00:00:05", 86405)])
def test_slurm_time_formats(text: str, seconds: int) -> None:
    assert slurm_time_seconds(text) == seconds


def test_sbatch_error_names_the_partition_key() -> None:
    stderr = ("sbatch: error: invalid partition specified: nope\n"
              "sbatch: error: Batch job submission failed: Invalid partition name specified")
    message = str(slurm_executor.sbatch_error(stderr, ClusterConfig(partition="nope")))
    assert message == ("sbatch rejected the job: invalid partition specified: nope; Batch job submission failed: "
                       "Invalid partition name specified (check cluster.partition='nope'; list the partitions "
                       "with `sinfo -s`)")


def test_allocation_decides_nodes_and_tasks() -> None:
    assert allocation_overrides({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "8"}) == [
        "cluster.nodes=2", "cluster.tasks_per_node=4"]
    assert allocation_overrides({}) == []
    with pytest.raises(ConfigError, match="3 tasks on 2 nodes"):
        allocation_overrides({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "3"})


# ---------------- the job script's shell logic, with stand-in srun and scontrol ----------------
FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" >"$FAKE_LOG/srun.args"
if [[ "${FAKE_SRUN_EXEC:-1}" == 0 ]]; then exit 0; fi
while [[ "$1" == --* ]]; do shift; done
SLURM_PROCID=0 "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
printf '%s\\0' "$@" >>"$FAKE_LOG/scontrol.args"
printf '\\n\\0' >>"$FAKE_LOG/scontrol.args"
"""
FAKE_TRAINER = """#!/bin/bash
printf '%s\\0' "$@" >"$FAKE_LOG/trainer.args"
if [[ -n "${FAKE_TERM_BATCH:-}" ]]; then  # Slurm ending the run: SIGTERM to the batch script (trainer <- task <- srun)
    srun_pid="$(ps -o ppid= -p "$PPID")"
    kill -TERM "$(ps -o ppid= -p $srun_pid)"
    sleep 0.3
fi
exit "${FAKE_RC:-0}"
"""


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("trainer", FAKE_TRAINER)):
        tool = tmp_path / "bin" / name
        tool.parent.mkdir(exist_ok=True)
        tool.write_text(text)
        tool.chmod(0o755)
    return tmp_path


def _run_script(sandbox: Path, script: str, *, env: dict[str, str] | None = None,
                restarts: int = 0) -> subprocess.CompletedProcess[str]:
    path = sandbox / "job.sbatch"
    path.write_text(script)
    full_env = {"PATH": f"{sandbox / 'bin'}:{os.environ['PATH']}", "FAKE_LOG": str(sandbox), "SLURM_JOB_ID": "42",
                "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1",
                "SLURM_RESTART_COUNT": str(restarts), "HOME": str(sandbox), **(env or {})}
    return subprocess.run(["bash", str(path)], cwd=sandbox, env=full_env, capture_output=True, text=True, timeout=60)


def _args(sandbox: Path, name: str) -> list[str]:
    return (sandbox / f"{name}.args").read_text().split("\0")[:-1]


def _spec(run_dir: Path, sandbox: Path) -> TrainScript:
    return TrainScript(algorithm="pretrain", run_dir=run_dir, config_path=run_dir / "config.yaml", python=PYTHON,
                       task=[str(sandbox / "bin" / "trainer"), "--config", str(run_dir / "config.yaml")])


def test_rendered_script_passes_hostile_paths_unchanged_and_runs_nothing(sandbox: Path) -> None:
    run_dir = sandbox / EVIL
    cluster = ClusterConfig(job_name=EVIL, container_image="img $(touch PWNED3)", container_mounts=[f"{run_dir}:/r"])
    result = _run_script(sandbox, render_train_script(cluster, _spec(run_dir, sandbox)))
    assert result.returncode == 0, result.stderr
    assert _args(sandbox, "trainer") == ["--config", str(run_dir / "config.yaml")]
    srun = _args(sandbox, "srun")
    assert f"--output={run_dir}/slurm/%j_%t_log.out" in srun
    assert "--container-image=img $(touch PWNED3)" in srun and f"--container-mounts={run_dir}:/r" in srun
    assert not list(sandbox.rglob("PWNED*")), "a value in the script was executed"
    assert (run_dir / "slurm").is_dir()


def test_preemption_mark_requeues_within_the_limit(sandbox: Path) -> None:
    script = render_train_script(ClusterConfig(max_requeues=2), _spec(sandbox / "run", sandbox))
    result = _run_script(sandbox, script, env={"FAKE_RC": str(REQUEUE_EXIT_CODE)}, restarts=1)
    assert result.returncode == 0, result.stderr
    assert "requeueing (requeue 2 of at most 2)" in result.stdout
    calls = [call.strip("\0").split("\0") for call in (sandbox / "scontrol.args").read_text().split("\n\0") if call]
    assert calls == [["requeue", "42"]]


def test_a_checkpoint_on_sigterm_leaves_the_requeue_to_slurm(sandbox: Path) -> None:
    # scancel, scheduler preemption and `scontrol requeue` all SIGTERM the batch script: Slurm decides what follows
    script = render_train_script(ClusterConfig(max_requeues=2), _spec(sandbox / "run", sandbox))
    result = _run_script(sandbox, script, env={"FAKE_RC": str(REQUEUE_EXIT_CODE), "FAKE_TERM_BATCH": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "got SIGTERM; waiting for the tasks to stop" in result.stdout
    assert "checkpoint saved on SIGTERM; if Slurm requeues the job, the next start resumes from it" in result.stdout
    assert not (sandbox / "scontrol.args").exists()


def test_a_start_after_a_requeue_says_so(sandbox: Path) -> None:
    script = render_train_script(ClusterConfig(max_requeues=2), _spec(sandbox / "run", sandbox))
    result = _run_script(sandbox, script, restarts=1)
    assert result.returncode == 0, result.stderr
    assert "[job 42, start 2]: started again after a requeue" in result.stdout
    assert "started again" not in _run_script(sandbox, script, restarts=0).stdout


def test_a_start_past_the_requeue_limit_stops_with_exit_code_3(sandbox: Path) -> None:
    # NODE_FAIL and `scontrol requeue` restarts count against cluster.max_requeues as the trainer's own do
    script = render_train_script(ClusterConfig(max_requeues=2), _spec(sandbox / "run", sandbox))
    result = _run_script(sandbox, script, restarts=3)
    assert result.returncode == REQUEUE_EXIT_CODE
    assert "requeued 3 times, more than MAX_REQUEUES=2; stopping" in result.stdout
    assert not (sandbox / "srun.args").exists()


def test_preemption_past_the_limit_exits_3_without_requeue(sandbox: Path) -> None:
    script = render_train_script(ClusterConfig(max_requeues=2), _spec(sandbox / "run", sandbox))
    result = _run_script(sandbox, script, env={"FAKE_RC": str(REQUEUE_EXIT_CODE)}, restarts=2)
    assert result.returncode == REQUEUE_EXIT_CODE
    assert "already requeued 2 times (MAX_REQUEUES=2)" in result.stdout
    assert not (sandbox / "scontrol.args").exists()


def test_a_missed_eval_gate_ends_the_job_with_its_own_code_and_no_requeue(sandbox: Path) -> None:
    """The job's exit codes are distinct (run_files.JOB_EXIT_CODES); the script's literal 3 is the requeue code."""
    assert len(JOB_EXIT_CODES) == 5 and GATE_EXIT_CODE != REQUEUE_EXIT_CODE  # a reused code would merge two keys
    script = render_train_script(ClusterConfig(max_requeues=2), _spec(sandbox / "run", sandbox))
    assert f"rc == {REQUEUE_EXIT_CODE}" in script and f"exit {REQUEUE_EXIT_CODE}" in script
    result = _run_script(sandbox, script, env={"FAKE_RC": str(GATE_EXIT_CODE)})
    assert result.returncode == GATE_EXIT_CODE
    assert not (sandbox / "scontrol.args").exists() and "requeue" not in result.stdout


@pytest.mark.parametrize("code, says", [(GATE_EXIT_CODE, "missed eval.min_pass_at_1"),
                                         (REQUEUE_EXIT_CODE, "requeued (preemption")])
def test_the_launcher_reads_the_gate_and_the_requeue_codes_apart(tmp_path: Path, code: int, says: str) -> None:
    import io

    from launcher.slurm.query import JobState
    from launcher.slurm.watch import Watch, explain

    err = io.StringIO()
    watch = Watch(job_id="42", log_dir=tmp_path, num_tasks=1, cluster=ClusterConfig(), out=io.StringIO(), err=err)
    assert explain(watch, JobState(state="FAILED", exit_code=f"{code}:0")) == code
    assert says in err.getvalue()


def test_failing_task_exit_code_is_the_jobs(sandbox: Path) -> None:
    result = _run_script(sandbox, render_train_script(ClusterConfig(), _spec(sandbox / "run", sandbox)),
                         env={"FAKE_RC": "7"})
    assert result.returncode == 7
    assert "tasks failed (srun exit code 7)" in result.stdout
    assert not (sandbox / "scontrol.args").exists()


def test_rendered_script_without_a_task_runs_the_trainer_on_its_config(sandbox: Path) -> None:
    spec = TrainScript(algorithm="rm", run_dir=sandbox / "run", config_path=sandbox / "run" / "config.yaml",
                       python=PYTHON)
    result = _run_script(sandbox, render_train_script(ClusterConfig(), spec), env={"FAKE_SRUN_EXEC": "0"})
    assert result.returncode == 0, result.stderr
    srun = _args(sandbox, "srun")
    assert srun[srun.index("task") + 1:] == [PYTHON, "-u", "-m", "megatron_rl.main", str(spec.config_path)]


def test_rendered_convert_script_runs_launch_py_convert_with_the_arguments_unchanged(sandbox: Path) -> None:
    convert_args = ["megatron-to-hf", "--ckpt", str(sandbox / EVIL), "--out", "hf $(touch PWNED)", "--verify"]
    script = render_convert_script(ClusterConfig(), run_dir=sandbox / "run", convert_args=convert_args,
                                   python=PYTHON)
    result = _run_script(sandbox, script, env={"FAKE_SRUN_EXEC": "0"})
    assert result.returncode == 0, result.stderr
    srun = _args(sandbox, "srun")
    assert srun[srun.index("task") + 1:] == [PYTHON, "-u", "-m", "launcher.cli", "convert", *convert_args]
    assert not list(sandbox.rglob("PWNED*"))


@pytest.mark.parametrize("bad", ["/models/a\n#!/bin/sh touch PWNED", "x\ry"])
def test_convert_argument_with_a_line_break_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="holds a line break"):
        render_convert_script(ClusterConfig(), run_dir=Path("/r"), convert_args=["hf-to-megatron", "--hf", bad],
                              python=PYTHON)


def _plain_env(**env: str) -> dict[str, str]:
    return {"PYTHON": sys.executable, "PYTHONPATH": str(REPO_ROOT), **env}


def test_plain_template_resolves_the_config_from_env(sandbox: Path) -> None:
    run_dir = sandbox / f"plain {EVIL}"
    script = (templates_dir() / TEMPLATE).read_text()
    result = _run_script(sandbox, script, env=_plain_env(
        ALGORITHM="pretrain", RUN_DIR=str(run_dir), OVERRIDES="run.steps=7 parallel.tp=2",
        SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="2", FAKE_SRUN_EXEC="0"))
    assert result.returncode == 0, result.stderr
    srun = _args(sandbox, "srun")
    task = [sys.executable, "-u", "-m", "megatron_rl.main", str(run_dir / "config.yaml")]
    assert srun[srun.index("task") + 1:] == task
    cfg = load_config(run_dir / "config.yaml")
    assert (cfg.run.steps, cfg.parallel.tp, cfg.cluster.nodes, cfg.cluster.tasks_per_node) == (7, 2, 2, 1)
    assert (cfg.run.dir, cfg.algorithm.name, cfg.cluster.executor) == (str(run_dir), "pretrain", "slurm")
    assert not list(sandbox.rglob("PWNED*"))


def test_plain_template_trains_grpo_in_runs_grpo_by_default(sandbox: Path) -> None:
    result = _run_script(sandbox, (templates_dir() / TEMPLATE).read_text(), env=_plain_env(
        OVERRIDES="run.steps=1", FAKE_SRUN_EXEC="0"))
    assert result.returncode == 0, result.stderr
    cfg = load_config(sandbox / "runs" / "grpo" / "config.yaml")
    assert (cfg.algorithm.name, cfg.run.dir) == ("grpo", str(sandbox / "runs" / "grpo"))


def test_plain_template_reports_a_bad_override(sandbox: Path) -> None:
    result = _run_script(sandbox, (templates_dir() / TEMPLATE).read_text(), env=_plain_env(
        RUN_DIR=str(sandbox / "run"), OVERRIDES="cluster.partitoin=gpu"))
    assert result.returncode == 2
    assert "unknown config key 'cluster.partitoin'" in result.stderr
    assert "could not resolve the job's config" in result.stdout
    assert not (sandbox / "srun.args").exists()


def test_plain_convert_template_hands_over_to_the_shared_body(sandbox: Path) -> None:
    script = (templates_dir() / "convert.sbatch").read_text()
    result = _run_script(sandbox, script, env=_plain_env(
        CONVERT_ARGS="megatron-to-hf --ckpt runs/a --out 'b' $(touch PWNED)", FAKE_SRUN_EXEC="0"))
    assert result.returncode == 0, result.stderr
    srun = _args(sandbox, "srun")
    assert srun[srun.index("task") + 1:] == [sys.executable, "-u", "-m", "launcher.cli", "convert", "megatron-to-hf",
                                             "--ckpt", "runs/a", "--out", "'b'", "$(touch", "PWNED)"]
    assert "--output=runs/convert/slurm/%j_%t_log.out" in srun and (sandbox / "runs" / "convert" / "slurm").is_dir()
    assert not list(sandbox.rglob("PWNED*"))
    missing = _run_script(sandbox, script, env=_plain_env())
    assert missing.returncode == 2 and "set CONVERT_ARGS" in missing.stderr


@pytest.mark.parametrize("name", [TEMPLATE, "convert.sbatch"])
def test_templates_pass_bash_and_shellcheck(name: str) -> None:
    path = templates_dir() / name
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    if name == TEMPLATE:
        assert load_template(name).body.startswith(SETTINGS_END)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_slurm_modules_and_submitit_import_no_torch() -> None:
    code = ("import sys, submitit, launcher.slurm.executor, launcher.slurm.task, launcher.slurm.watch, "
            "launcher.slurm.prepare, launcher.cli.convert; "
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
