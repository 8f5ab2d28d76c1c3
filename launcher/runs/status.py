"""A run's (or a pipeline's) state, progress, last metrics, ETA, log paths and audit record (manifest.json),
as text or one JSON object.

    python launch.py status RUN_DIR [--json]

Slurm runs: each job that wrote into the folder, with its state from ``sacct`` (``squeue`` when accounting does not
know it yet), its exit code and how often it started (a requeued job starts again under the same id); the run's
state is its latest job's. Local runs have no scheduler, so the state is read from the folder: RUNNING while the
launcher named in ``.lock`` lives on this host, else COMPLETED when metrics.jsonl reached run.steps, FAILED when
it stopped short (an error, or Ctrl-C: the rank logs say which), CANCELLED when ``launch.py cancel`` stopped it, and
NOT_STARTED when no step was logged.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from launcher.runs.folder import MAIN_PHASES, RunFolder, open_folder
from launcher.slurm.query import JobState, live_state, sacct_states
from megatron_rl.spec.run_files import MANIFEST_FILE

KEY_METRICS = ("reward_mean", "loss", "accuracy", "pass@1", "kl", "response_length", "reward_margin")
"""The metrics status shows, those the trainer logs (GRPO: reward, KL; RM/DPO: loss, accuracy; pretrain: loss)."""
ETA_WINDOW = 10
"""Steps whose mean step_time_s gives the ETA."""


@dataclass(kw_only=True)
class JobStatus:
    """One Slurm job of the run."""

    job_id: str
    """Slurm job id."""
    state: str
    """sacct's state of its latest start (UNKNOWN when neither sacct nor squeue knows the job)."""
    exit_code: str = ""
    """sacct's ExitCode `code:signal`."""
    elapsed: str = ""
    """Run time of its latest start."""
    nodes: str = ""
    """Nodes of its latest start."""
    reason: str = ""
    """squeue's pending reason (only while sacct does not know the job)."""
    starts: int = 0
    """How many times it started (more than 1: requeued)."""


@dataclass(kw_only=True)
class RunStatus:
    """Everything ``status`` shows for one run folder."""

    run_dir: str
    """The run folder."""
    name: str
    """run.name."""
    algorithm: str
    """algorithm.name."""
    executor: str
    """local or slurm (the latest launch into the folder)."""
    state: str
    """RUNNING, COMPLETED, FAILED, CANCELLED, PENDING, ... (Slurm's words; see the module docstring)."""
    state_from: str
    """How the state was determined."""
    step: Optional[int]
    """Last logged step of ``phase``."""
    steps: Optional[int]
    """Steps of that phase (run.steps, or algorithm.sft_warmup_steps during the warm-up)."""
    phase: str
    """"train", or "sft" while the GRPO warm-up runs."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Key metrics of the last step."""
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """Key metrics of the last held-out evaluation (phase eval), with its step."""
    eta_s: Optional[float] = None
    """Seconds left at the mean step time of the last ETA_WINDOW steps (running runs only)."""
    jobs: list[JobStatus] = field(default_factory=list)
    """Slurm jobs, oldest first (empty for local runs)."""
    logs: dict[str, str] = field(default_factory=dict)
    """Log name (rank0, rank1, batch, rank0.err, ...) -> path, of the latest job."""
    manifest: Optional[str] = None
    """The run's audit record (megatron_rl/runtime/manifest.py), once the job has written it."""
    manifest_summary: dict[str, int] = field(default_factory=dict)
    """Its attempts, requeues, checkpoints and exports, counted."""


def key_metrics(row: dict[str, Any]) -> dict[str, float]:
    return {key: row[key] for key in KEY_METRICS if isinstance(row.get(key), (int, float))}


def progress(run: RunFolder, rows: list[dict[str, Any]]) -> tuple[Optional[int], Optional[int], str]:
    """(step, steps, phase) from the last main-phase line, or the warm-up's while only warm-up lines exist."""
    main = [row for row in rows if row.get("phase") in MAIN_PHASES]
    if main or not rows:
        return (main[-1].get("step") if main else None), run.steps, "train"
    warmup = [row for row in rows if row.get("phase") == "sft"]
    total = run.section("algorithm").get("sft_warmup_steps")
    return (warmup[-1].get("step") if warmup else None), (total if isinstance(total, int) else None), "sft"


def eta_seconds(rows: list[dict[str, Any]], step: Optional[int], steps: Optional[int]) -> Optional[float]:
    times = [row["step_time_s"] for row in rows if row.get("phase") in MAIN_PHASES
             and isinstance(row.get("step_time_s"), (int, float))][-ETA_WINDOW:]
    if not times or step is None or steps is None:
        return None
    return max(0, steps - step) * sum(times) / len(times)


def slurm_jobs(run: RunFolder) -> list[JobStatus]:
    """Each job id of the folder with sacct's record (one query), squeue's for jobs sacct does not know yet."""
    ids = run.job_ids()
    recorded = sacct_states(ids)
    jobs = []
    for job_id in ids:
        seen: Optional[JobState] = recorded.get(job_id) or live_state(job_id)
        if seen is None:
            jobs.append(JobStatus(job_id=job_id, state="UNKNOWN"))
            continue
        jobs.append(JobStatus(job_id=job_id, state=seen.state, exit_code=seen.exit_code, elapsed=seen.elapsed,
                              nodes=seen.nodes, reason=seen.reason, starts=seen.starts))
    return jobs


def local_state(run: RunFolder, step: Optional[int], phase: str) -> tuple[str, str]:
    holder = run.lock_holder()
    pid = run.local_launcher()
    if pid is not None:
        return "RUNNING", f"the launcher (pid {pid}) named in .lock is alive"
    if holder and not holder.get("slurm_job_id") and holder.get("host") != socket.gethostname():
        return "UNKNOWN", f".lock names pid {holder.get('pid')} on {holder.get('host')}: run status there"
    if run.section("algorithm").get("name") == "eval":
        return eval_state(run)
    if step is None:
        return "NOT_STARTED", "no launcher alive and no step in metrics.jsonl"
    if phase == "train" and run.steps is not None and step >= run.steps:
        return "COMPLETED", f"no launcher alive; metrics.jsonl reached step {step} of run.steps={run.steps}"
    if cancelled := run.cancelled():
        return "CANCELLED", (f"`launch.py cancel` stopped it at {phase} step {step} (at {cancelled.get('since', '?')}); "
                             "launch it again with the same run.dir to resume")
    return "FAILED", f"no launcher alive; metrics.jsonl stopped at {phase} step {step} (the rank logs say why)"


def eval_state(run: RunFolder) -> tuple[str, str]:
    """An eval run's end state, from its entry in <run>/eval.json (its eval.stage, or run.name)."""
    stage = run.section("eval").get("stage") or run.section("run").get("name")
    path = run.path / "eval.json"
    try:
        entry = json.loads(path.read_text()).get(stage) if path.is_file() else None
    except (OSError, ValueError):
        entry = None
    if entry is None:
        return "FAILED", f"no launcher alive and no {stage!r} entry in {path}"
    if not entry.get("kept", True):
        return "FAILED", f"eval.json's {stage!r} entry missed the eval.min_pass_at_1 gate (kept: false)"
    return "COMPLETED", f"no launcher alive; eval.json holds the {stage!r} entry"


def log_paths(run: RunFolder) -> dict[str, str]:
    paths = {}
    for rank in run.ranks_with_logs():
        for kind, path in run.rank_logs(rank):
            name = {"rank": f"rank{rank}", "stdout": f"rank{rank}", "stderr": f"rank{rank}.err"}.get(kind, kind)
            paths[name] = str(path)
    return dict(sorted(paths.items(), key=lambda item: (item[0] != "batch", len(item[0]), item[0])))


def manifest_summary(run: RunFolder) -> tuple[Optional[str], dict[str, int]]:
    """(the manifest's path or None, the number of its attempts, requeues, checkpoints and exports)."""
    path = run.path / MANIFEST_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return (str(path) if path.is_file() else None), {}
    counts = {key: len(data.get(key) or []) for key in ("attempts", "checkpoints", "exports")}
    return str(path), {**counts, "requeues": int(data.get("requeues") or 0)}


def run_status(run: RunFolder) -> RunStatus:
    rows = run.recent_metrics()
    step, steps, phase = progress(run, rows)
    jobs: list[JobStatus] = []
    if run.executor == "slurm":
        jobs = slurm_jobs(run)
        state = jobs[-1].state if jobs else "NOT_SUBMITTED"
        state_from = f"sacct of job {jobs[-1].job_id}" if jobs else "no Slurm job id in the folder"
    else:
        state, state_from = local_state(run, step, phase)
    main = [row for row in rows if row.get("phase") in MAIN_PHASES]
    evals = [row for row in rows if row.get("phase") == "eval"]
    eval_metrics = {**key_metrics(evals[-1]), "step": evals[-1].get("step")} if evals else {}
    eta = eta_seconds(rows, step, steps) if state == "RUNNING" and phase == "train" else None
    manifest, summary = manifest_summary(run)
    return RunStatus(run_dir=str(run.path), name=str(run.section("run").get("name", "")),
                     algorithm=str(run.section("algorithm").get("name", "")), executor=run.executor, state=state,
                     state_from=state_from, step=step, steps=steps, phase=phase,
                     metrics=key_metrics(main[-1] if main else (rows[-1] if rows else {})),
                     eval_metrics=eval_metrics, eta_s=eta, jobs=jobs, logs=log_paths(run),
                     manifest=manifest, manifest_summary=summary)


def overall_state(states: list[str]) -> str:
    """A pipeline's state: the first stage that did not complete decides (FAILED, RUNNING, PENDING, ...)."""
    return next((state for state in states if state != "COMPLETED"), "COMPLETED")


def folder_status(path: str) -> dict[str, Any]:
    """The status of a run folder or a pipeline folder, as the JSON object ``status --json`` prints."""
    runs = open_folder(path, command="status")
    if runs[0][0] is None:
        return {"kind": "run", **asdict(run_status(runs[0][1]))}
    stages = [{"stage": name, **asdict(run_status(run))} for name, run in runs]
    return {"kind": "pipeline", "pipeline_dir": str(runs[0][1].path.parent),
            "state": overall_state([stage["state"] for stage in stages]), "stages": stages}


# ---------------- text ----------------
def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def format_run(status: dict[str, Any], indent: str = "") -> str:
    step = "?" if status["step"] is None else status["step"]
    steps = "?" if status["steps"] is None else status["steps"]
    phase = "warm-up (sft) " if status["phase"] == "sft" else ""
    lines = [f"run {status['run_dir']}  ({status['algorithm'] or '?'}, {status['executor']})",
             f"  state    {status['state']}  ({status['state_from']})",
             f"  step     {phase}{step}/{steps}"
             + (f"  ETA {_duration(status['eta_s'])}" if status["eta_s"] is not None else "")]
    for job in status["jobs"]:
        extra = [f"exit {job['exit_code']}" if job["exit_code"] else "", f"elapsed {job['elapsed']}" if
                 job["elapsed"] else "", f"on {job['nodes']}" if job["nodes"] else "", job["reason"],
                 f"started {job['starts']}x (requeued)" if job["starts"] > 1 else ""]
        lines.append(f"  job      {job['job_id']} {job['state']}  " + "  ".join(e for e in extra if e))
    if status["metrics"]:
        lines.append("  metrics  " + "  ".join(f"{k} {_fmt(v)}" for k, v in status["metrics"].items()))
    if status["eval_metrics"]:
        lines.append("  eval     " + "  ".join(f"{k} {_fmt(v)}" for k, v in status["eval_metrics"].items()))
    for name, path in status["logs"].items():
        lines.append(f"  log      {name:<9} {path}")
    if not status["logs"]:
        lines.append("  log      none yet")
    if status.get("manifest"):
        counts = ", ".join(f"{key} {n}" for key, n in status["manifest_summary"].items())
        lines.append(f"  manifest {status['manifest']}" + (f"  ({counts})" if counts else ""))
    return "\n".join(indent + line for line in lines)


def format_status(status: dict[str, Any]) -> str:
    if status["kind"] == "run":
        return format_run(status)
    lines = [f"pipeline {status['pipeline_dir']}: {len(status['stages'])} stage(s), {status['state']}"]
    for stage in status["stages"]:
        lines.append(f"stage {stage['stage']}: {stage['state']}")
        lines.append(format_run(stage, indent="  "))
    return "\n".join(lines)


def status_json(status: dict[str, Any]) -> str:
    return json.dumps(status, sort_keys=False)
