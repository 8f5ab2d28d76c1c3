"""Turn a loaded config into a job that is safe to start: model shape, executor, layout (planned or checked).

Everything here runs on the login node before anything queues, and never imports torch or megatron.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Mapping, Optional

from megatron_rl.spec.config import JobConfig, to_yaml
from megatron_rl.spec.config.validate import check_layout, with_pipeline_split
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.limits import check_limits, trainer_limits
from megatron_rl.spec.model_shape import ModelShape, load_model_shape
from megatron_rl.spec.parallel import PACKING_CP_REASON, layout_vpp, pads_sequences
from megatron_rl.spec.private import check_run_dir, make_private_dir, write_private_text
from megatron_rl.spec.run_files import CONFIG_FILE

PLANNER_MODES = {"grpo": "grpo", "rm": "rm", "sft": "pretrain", "pretrain": "pretrain", "dpo": "dpo", "ppo": "ppo",
                 "eval": "eval"}


@dataclass(frozen=True, kw_only=True)
class PreparedJob:
    """A checked job: what every executor needs to start it."""

    cfg: JobConfig
    """The resolved config (layout filled in when the planner chose it)."""
    shape: ModelShape
    """The model's shape."""
    executor: str
    """local or slurm (auto resolved)."""
    run_dir: Path
    """Absolute run folder."""
    data_parallel_size: int
    """World size / (tp * pp * cp)."""
    plan: Optional[Any] = None
    """The planner's PlanResult when parallel.auto chose the layout."""
    prediction: Optional[Any] = None
    """The PlanResult of the job's own layout (the chosen one with parallel.auto), written as prediction.json;
    None when the planner cannot evaluate the layout."""
    unresolved: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Keys written with their ``${oc.env:...}`` text (``megatron_rl.spec.config.loader.env_references``)."""

    @property
    def config_path(self) -> Path:
        return self.run_dir / CONFIG_FILE

    def write_config(self) -> Path:
        """Write config.yaml (0600) into the run folder (created 0700), and the planner's prediction for the
        job's layout (prediction.json, see ``megatron_rl.spec.calibrate``) when it has one."""
        from megatron_rl.spec.calibrate import prediction_record
        from megatron_rl.spec.run_files import PREDICTION_FILE

        make_private_dir(self.run_dir)
        if self.prediction is not None:
            record = prediction_record(self.prediction, gpu_type=self.cfg.cluster.gpu_type)
            write_private_text(self.run_dir / PREDICTION_FILE, json.dumps(record, indent=1) + "\n")
        return write_private_text(self.config_path, self.config_text())

    def config_text(self) -> str:
        """config.yaml as written: resolved, but ``oc.env`` interpolations kept (no secret on disk)."""
        return to_yaml(self.cfg, dict(self.unresolved))


def load_shape(name: str) -> ModelShape:
    """``load_model_shape(name)``, with a file that is not UTF-8 text refused as one line naming it."""
    from megatron_rl.spec.config.loader import read_text

    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        read_text(path, "model file (model.name)")
    return load_model_shape(name)


STEP_DIR = re.compile(r"^step_\d{8}$")
"""A checkpoint step folder (megatron_rl/runtime/checkpoint.py's layout: step_N folders and a ``latest`` file)."""


def check_fresh_start(cfg: JobConfig) -> None:
    """With checkpoint.resume=false, refuse a checkpoint folder that already holds checkpoints: the new run would
    save low steps next to the old run's high ones. The message spells out both ways forward."""
    if cfg.checkpoint.resume:
        return
    root = Path(cfg.checkpoint_dir).expanduser().absolute()
    if not root.is_dir():
        return
    found = sorted(p.name for p in root.iterdir() if STEP_DIR.match(p.name))
    if not found and not (root / "latest").exists():
        return
    newest = f" (up to {found[-1]})" if found else ""
    key = "checkpoint.dir" if cfg.checkpoint.dir else "run.dir"
    raise ConfigError(f"checkpoint.resume=false, but {root} already holds checkpoints{newest}; to start over give "
                      f"a new {key}, or to continue from them set checkpoint.resume=true")


def check_env(cfg: JobConfig) -> None:
    """Every variable named in cluster.env is set in this shell (the job takes it from here)."""
    unset = [name for name in cfg.cluster.env if name not in os.environ]
    if unset:
        raise ConfigError(f"cluster.env names {', '.join(unset)}, which this shell does not set; export "
                          f"{unset[0]}=... before launching, or drop it from cluster.env")


INPUT_PATHS = ("model.init_from", "algorithm.reward_model", "algorithm.critic_init_from", "algorithm.teacher.checkpoint",
               "data.train_path", "data.eval_path")
"""Config keys naming files or folders a job reads at its start: a local launch checks them first."""


def check_input_paths(cfg: JobConfig, config: Optional[str] = None) -> None:
    """Each INPUT_PATHS key that is set names something that exists (on this machine: call it for local runs; a
    Slurm job may read paths that only its nodes see). The error names the key, and when the config file's header
    has the ``python launch.py`` command whose run.dir holds the path (a shipped config's recipe), that command."""
    for dotted in INPUT_PATHS:
        value = cfg
        for key in dotted.split("."):
            value = getattr(value, key) if value is not None else None
        if value is None or Path(value).expanduser().exists():
            continue
        builder = _building_command(config, value) if config else None
        fix = f"build it first: {builder}" if builder else f"give {dotted} an existing path"
        raise ConfigError(f"{dotted}={value} does not exist; {fix}")
    if cfg.algorithm.teacher is not None:
        check_teacher_tokenizer(cfg)


def check_teacher_tokenizer(cfg: JobConfig) -> None:
    """The teacher's tokenizer, as its run's config.yaml beside the checkpoint names it, against model.tokenizer:
    two different built-in ones are refused here; folders (and checkpoints without their run's config) are
    compared by the job, which loads both (``megatron_rl.runtime.teacher``)."""
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.run_files import builtin_tokenizer, run_config_of_checkpoint

    key = "algorithm.teacher.checkpoint"
    found = run_config_of_checkpoint(cfg.algorithm.teacher.checkpoint)
    if found is None:
        return
    try:
        teacher = load_config(str(found), [])
    except ConfigError:
        return  # the job reads what the checkpoint itself records
    theirs, ours = builtin_tokenizer(teacher.model.tokenizer), builtin_tokenizer(cfg.model.tokenizer)
    if theirs and ours and theirs != ours:
        raise ConfigError(f"{key}: the teacher was trained with tokenizer {theirs}, the student's model.tokenizer is "
                          f"{ours}; distillation compares log-probs of the same tokens, so give a teacher trained "
                          "with the student's tokenizer")


def _building_command(config: str, missing: str) -> Optional[str]:
    """The ``python launch.py ...`` command in the config file's comments whose run.dir holds ``missing``."""
    from megatron_rl.spec.config.loader import find_config

    try:
        text = find_config(config).read_text(encoding="utf-8")
    except (ConfigError, OSError, UnicodeDecodeError):
        return None
    lines = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    commands, current = [], ""
    for line in lines:
        current = f"{current} {line}".strip() if current else line
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        if current.startswith("python launch.py"):
            commands.append(" ".join(current.split()))
        current = ""
    target = Path(missing)
    for command in commands:
        for word in command.split():
            if word.startswith("run.dir=") and Path(word.removeprefix("run.dir=")) in (target, *target.parents):
                return command
    return None


def resolve_executor(name: str) -> str:
    """auto means slurm when `sbatch` is on PATH, else local."""
    if name == "auto":
        return "slurm" if shutil.which("sbatch") else "local"
    return name


def plan_job(cfg: JobConfig, shape: ModelShape, *, given: Collection[str] = frozenset(), precision: str = "bf16",
             top_k: int = 5, mean_response_length: int | None = None):
    """The one sizing call for a job, made by ``prepare`` (parallel.auto=true) and by ``launch.py plan``: the
    planner's search for cfg's training processes (the world size less cluster.rollout_tasks, which generate on
    their own GPUs: ``inputs.split_placement``), GPU type, sequence length, global batch and trainer, with the job's
    runtime (``runtime:`` section: TE, attention kernel, TP/DP overlap, gradient dtype;
    ``launcher.planner.inputs.runtime_of``), and for GRPO/PPO its rollout (``inputs.rollout_sizing``: size, group,
    response length and ``mean_response_length`` (None: half the max), reference model, old log-prob recompute,
    epochs, reward model, KV cache release and optimizer offload). It keeps the ``parallel.*`` keys named in
    ``given`` (``megatron_rl.spec.config.loader.given_keys``) and the trainer limits (``megatron_rl.spec.limits``).
    Returns the PlanResult; NoFeasibleLayout when nothing fits, ConfigError when a given key cannot be kept."""
    from launcher.planner import PLANNED_KEYS, NoFeasibleLayout, plan
    from launcher.planner.inputs import RL_ALGORITHMS, rollout_sizing, runtime_of, split_placement

    shape = shape.as_built()  # what the trainers run: the planner counts no MTP layer they do not build
    algo, par = cfg.algorithm, cfg.parallel
    limits = trainer_limits(shape, algo.name)
    if par.micro_batch_tokens is not None:
        limits = {**limits, "cp": (1, PACKING_CP_REASON)}
    given_parallel = {key.removeprefix("parallel.") for key in given if key.startswith("parallel.")}
    check_limits({key: getattr(par, key) for key in given_parallel}, limits)
    fixed = {key: getattr(par, key) for key in PLANNED_KEYS if key in given_parallel}
    if "vpp" in fixed:
        fixed["vpp"] = fixed["vpp"] or layout_vpp(par.pipeline_layout, par.pp)  # null: plain 1F1B, or the layout's
    for key in ("etp", "recompute_num_layers", "pipeline_layout"):
        if key in fixed and fixed[key] is None:
            del fixed[key]  # null: the default (etp 1 under EP, else tp; every layer recomputed; the other keys' split)
    runtime = runtime_of(cfg, shape)
    if mean_response_length is not None and algo.name not in RL_ALGORITHMS:
        raise ConfigError(f"--mean-response-len sizes a rollout; algorithm.name={algo.name} generates none")
    grpo = (rollout_sizing(cfg, shape, runtime, mean_response_length=mean_response_length)
            if algo.name in RL_ALGORITHMS else None)
    try:
        return plan(shape, num_gpus=cfg.cluster.training_tasks, gpu_type=cfg.cluster.gpu_type,
                    seq_length=cfg.model.seq_length, global_batch_size=algo.global_batch_size,
                    mode=PLANNER_MODES[algo.name], precision=precision, grpo=grpo, top_k=top_k,
                    runtime=runtime, fixed=fixed, limits=limits, split=split_placement(cfg),
                    pads_sequences=pads_sequences(algo.name))
    except NoFeasibleLayout:
        raise
    except ConfigError as exc:  # the search names held keys as --layout ones; here they are parallel.* keys
        raise ConfigError(str(exc).replace("--layout ", "parallel.", 1)) from None


def evaluate_layout(cfg: JobConfig, shape: ModelShape):
    """``plan_job`` of cfg's own layout (every planned key held): the prediction a run is checked against
    (``megatron_rl.spec.calibrate``); None when the planner cannot evaluate it (a layout it does not model)."""
    from launcher.planner import PLANNED_KEYS, NoFeasibleLayout

    try:
        held = {f"parallel.{key}" for key in PLANNED_KEYS}
        return plan_job(cfg, shape, given=held, top_k=0)
    except (ConfigError, NoFeasibleLayout):
        return None


def apply_plan(cfg: JobConfig, shape: ModelShape, *, given: Collection[str] = frozenset()):
    """``plan_job`` and its layout written into cfg.parallel; returns (cfg, PlanResult). Nothing fitting is a
    ConfigError naming the node count that would fit."""
    from launcher.planner import NoFeasibleLayout

    try:
        result = plan_job(cfg, shape, given=given)
    except NoFeasibleLayout as exc:
        processes = exc.smallest_gpus + cfg.cluster.rollout_tasks if exc.smallest_gpus else None  # training + rollout
        nodes = -(-processes // cfg.cluster.tasks_per_node) if processes else None
        raise ConfigError(f"parallel.auto: {exc}" + (f"; set cluster.nodes={nodes}" if nodes else "")) from None
    keys = {key: value for key, value in result.layout.to_dict().items() if key != "dp"}
    parallel = dataclasses.replace(cfg.parallel, **{**keys, "vpp": keys["vpp"] if keys["vpp"] > 1 else None})
    return dataclasses.replace(cfg, parallel=parallel), result


def prepare(cfg: JobConfig, *, given: Collection[str] = frozenset(),
            unresolved: Mapping[str, Any] | None = None, first_start: bool = True) -> PreparedJob:
    """Load the shape, pick the executor and the layout, and check that the job can run. ``given``: the keys the
    user set (``given_keys`` of the same file and overrides); with parallel.auto the planner keeps those.
    ``unresolved``: ``env_references`` of the same, written unresolved into config.yaml. ``first_start``: false
    in a requeued Slurm job, whose own checkpoints are not an old run's."""
    shape = load_shape(cfg.model.name)
    executor = resolve_executor(cfg.cluster.executor)
    if executor == "local" and cfg.cluster.nodes != 1:
        raise ConfigError(f"cluster.nodes={cfg.cluster.nodes} needs Slurm, but `sbatch` is not on PATH; "
                          "set cluster.nodes=1 for a local run or run from a Slurm login node")
    result = None
    if cfg.parallel.auto:
        cfg, result = apply_plan(cfg, shape, given=given)
    cfg = with_pipeline_split(cfg, shape)
    dp = check_layout(cfg, shape)
    named = Path(cfg.run.dir).expanduser().absolute()
    check_run_dir(named)  # a symlink is refused before resolve() follows it
    run_dir = named.resolve()
    check_run_dir(run_dir)
    if first_start:
        check_fresh_start(cfg)
    prediction = result or evaluate_layout(cfg, shape)
    return PreparedJob(cfg=with_planned_kv_memory(cfg, prediction), shape=shape, executor=executor, run_dir=run_dir,
                       data_parallel_size=dp, plan=result, prediction=prediction, unresolved=dict(unresolved or {}))


def with_planned_kv_memory(cfg: JobConfig, prediction) -> JobConfig:
    """cfg with the KV memory the planner chose for its layout (``PlanResult.kv_pool``) written into
    generation.kv_memory_gib where the config leaves it null on a GPU job. Unchanged when the user gave it, on CPU
    jobs and outside the RL trainers."""
    pool = prediction.kv_pool if prediction is not None else None
    if pool is None or pool.source != "chosen":
        return cfg
    return dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, kv_memory_gib=pool.gib))
