"""Post-training pipelines: the stages of one YAML (SFT -> RM -> GRPO -> eval ...), chained locally or on Slurm.

    python launch.py pipeline --config configs/pipeline_tiny.yaml [key=value ...] [--dry-run] [--wait]

The pipeline file::

    pipeline:
      dir: runs/pipeline_tiny         # the pipeline's folder (default runs/<file name>); stage NAME runs in <dir>/NAME
    cluster: {executor: local}        # a job section at the top level applies to every stage
    stages:                           # the stages, in the order they run
      sft:                            # its name (letters, digits, _ and -): its folder, and how later stages name it
        config: sft_tiny              # its job config: a YAML file (relative to this file's folder or the working
                                      # folder) or a shipped config's name; none: the built-in default job
        data: {task: first_digit}     # the overlay: job sections, as `--config sft_tiny data.task=first_digit`
      grpo:
        config: grpo_tiny
        model: {init_from: "${stages.sft.checkpoint}"}

A stage's job config is, in this order: its ``config`` file, the file's top-level sections, the stage's own
sections, the command line's job keys, the command line's ``stages.NAME.*`` keys, and last what the pipeline
sets: ``run.dir=<dir>/NAME`` and ``checkpoint.resume=true`` (``run.name`` defaults to NAME). Each section of a
layer is applied as ``section.key=value`` overrides are, so a mapping value (``algorithm.rewards``) merges into
the config's as on the command line.

References, in any string value of the file or the command line: ``${stages.NAME.checkpoint}`` is the checkpoint
folder of the earlier stage NAME (its checkpoint.dir, by default ``<dir>/NAME/checkpoints``) and
``${stages.NAME.dir}`` its run folder. They are folder paths, known before anything starts, so they are resolved
then and written resolved into the stage's config.yaml; ``${oc.env:VAR}`` stays unresolved on disk (the job
reads its own environment), and any other ``${section.key}`` resolves within the stage's job config.

Command line: ``pipeline.dir=DIR``; ``stages.NAME.section.key=value`` (one stage, e.g.
``stages.grpo.run.steps=50``); any other ``section.key=value`` is a job key for every stage (e.g.
``cluster.executor=slurm``), winning over what the stages set themselves.

Running: locally the stages run one after another and the first that fails stops the pipeline (one line naming
it and its log, its exit code). On Slurm every stage is submitted at once through submitit, each held by
``--dependency=afterok:<the previous stage's job>``; with ``--kill-on-invalid-dep=yes`` Slurm cancels the
stages after one that fails (CANCELLED in ``launch.py status``), and a stage that cannot be submitted
scancels the ones already submitted. ``--wait`` follows them in order.

Re-running: a stage is complete when its run finished: for a training stage, metrics.jsonl reached run.steps and
(checkpoint.save_at_end) the ``latest`` checkpoint is step run.steps or later; for an eval stage, its eval.json
holds a kept entry for the checkpoint it evaluates. Complete stages are skipped ("skipped"); an interrupted one
starts again in its folder and resumes from its newest checkpoint (checkpoint.resume=true). Completion is read
from the folders, not the configs: give a new pipeline.dir to start over.

The pipeline folder holds ``stages.txt`` (the stage order ``launch.py status`` shows), ``pipeline.yaml`` (the
file with the command line's keys, unresolved) and ``eval.json``: the entries of every completed eval stage,
keyed by eval.stage.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from omegaconf import OmegaConf

from launcher.job import PreparedJob, prepare
from launcher.lock import acquire
from launcher.runs.completion import completion, eval_key, read_eval
from launcher.runs.folder import STAGE_ORDER_FILE
from megatron_rl.spec.config import JobConfig
from megatron_rl.spec.config.loader import env_references, find_config, given_keys, load_config, read_text
from megatron_rl.spec.errors import ConfigError, did_you_mean
from megatron_rl.spec.private import check_run_dir, make_private_dir, write_private_text
from megatron_rl.spec.run_files import CONFIG_FILE, EVAL_FILE

STAGE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
REFERENCE = re.compile(r"\$\{stages\.([^.}]*)\.([^}]*)\}")
REFERENCE_START = "${stages."
REFERENCE_KINDS = ("checkpoint", "dir")
STAGE_KEYS = ("config",)
PIPELINE_KEYS = ("dir",)
PIPELINE_FILE = "pipeline.yaml"
SECTIONS = tuple(JobConfig.__dataclass_fields__)


@dataclass(kw_only=True)
class StageSpec:
    """One stage as the pipeline file (and the command line) give it."""

    name: str
    """The stage's name: its folder under the pipeline's, and how later stages refer to it."""
    config: Optional[Path]
    """Its job config file (None: the built-in default job)."""
    sections: dict[str, Any] = field(default_factory=dict)
    """Its overlay: job sections, unresolved."""
    cli: list[str] = field(default_factory=list)
    """The command line's ``stages.NAME.*`` keys, as ``section.key=value``."""


@dataclass(kw_only=True)
class PipelineSpec:
    """A pipeline file with the command line's keys applied, before any reference is resolved."""

    file: Path
    """The pipeline file."""
    dir: Path
    """The pipeline's folder (absolute)."""
    shared: dict[str, Any]
    """The file's top-level job sections (every stage)."""
    cli_shared: list[str]
    """The command line's job keys (every stage)."""
    stages: list[StageSpec]
    """The stages, in order."""
    raw: dict[str, Any]
    """The file's contents with the command line applied (written as pipeline.yaml)."""


@dataclass(kw_only=True)
class Stage:
    """A stage ready to start: its checked job, what it waits for, and whether it already finished."""

    name: str
    """The stage's name."""
    job: PreparedJob
    """Its prepared job (run.dir = <pipeline dir>/NAME)."""
    config_name: str
    """Its job config, as shown (a shipped name or a path; "default" for the built-in job)."""
    after: Optional[str]
    """The stage it runs after (the previous one), None for the first."""
    done: Optional[str]
    """Why it is complete (it is skipped), or None when it must run."""

    @property
    def log(self) -> Path:
        """Rank 0's log of its latest run."""
        if self.job.executor == "local":
            return self.job.run_dir / "logs" / "rank0.log"
        return self.job.run_dir / "slurm"


# ---------------- reading the pipeline file ----------------
class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (a stage name used twice, say)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: {key!r} is given twice (a stage name, like "
                              "every key, may appear once in its mapping); rename or remove one")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_pipeline_file(path: Path) -> dict[str, Any]:
    """The pipeline file's mapping; one-line ConfigErrors for YAML errors and repeated keys."""
    text = read_text(path, "pipeline file")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except ConfigError as exc:
        raise ConfigError(f"pipeline file {path} {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"pipeline file {path}{where} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("stages"), dict) or not data["stages"]:
        raise ConfigError(f"pipeline file {path} must hold a `stages:` mapping of stage name -> {{config: FILE, "
                          "section: {key: value}}} (see launcher/pipeline.py)")
    return data


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """The command line's keys: (``pipeline.*`` ones, {stage: its ``section.key=value`` keys}, job keys)."""
    pipeline, stages, shared = [], {}, []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or key.strip() != key:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. stages.grpo.run.steps=50")
        head, _, rest = key.partition(".")
        if key == "run.dir" or (head == "stages" and rest.partition(".")[2] == "run.dir"):
            raise ConfigError(f"{item}: a pipeline's stages run in pipeline.dir/NAME, not in run.dir; give "
                              f"pipeline.dir={value} instead")
        if head == "pipeline":
            pipeline.append(item)
        elif head == "stages":
            name, _, stage_key = rest.partition(".")
            if "." not in stage_key:
                raise ConfigError(f"override {item!r}: a stage key is stages.NAME.section.key=value, e.g. "
                                  "stages.grpo.run.steps=50")
            stages.setdefault(name, []).append(f"{stage_key}={value}")
        else:
            shared.append(item)
    return pipeline, stages, shared


def load_pipeline(path: str | Path, overrides: Sequence[str] = ()) -> PipelineSpec:
    """Read the pipeline file, apply the command line, and check its shape (not yet the stages' configs)."""
    file = find_config(path)
    data = read_pipeline_file(file)
    pipeline_keys, stage_keys, shared_keys = split_overrides(overrides)
    for section in data:
        if section not in ("pipeline", "stages", *SECTIONS):
            raise ConfigError(f"pipeline file {file}: unknown top-level key {section!r}"
                              f"{did_you_mean(str(section), ('pipeline', 'stages', *SECTIONS))}; it holds "
                              f"pipeline:, stages: and job sections ({', '.join(SECTIONS)}) for every stage")
    settings = _pipeline_section(data.get("pipeline"), pipeline_keys, file)
    stages = [_stage_spec(name, body, file) for name, body in data["stages"].items()]
    names = [stage.name for stage in stages]
    for name, keys in stage_keys.items():
        if name not in names:
            raise ConfigError(f"override stages.{name}.{keys[0]}: no stage {name!r} in {file}"
                              f"{did_you_mean(name, names)}; its stages: {', '.join(names)}")
        next(stage for stage in stages if stage.name == name).cli.extend(keys)
    shared = {key: value for key, value in data.items() if key in SECTIONS}
    folder = Path(str(settings.get("dir") or f"runs/{file.stem}")).expanduser().absolute()
    raw = {**data, "pipeline": settings}
    return PipelineSpec(file=file, dir=folder, shared=shared, cli_shared=shared_keys, stages=stages,
                        raw=_with_cli(raw, stage_keys, shared_keys))


def _pipeline_section(body: Any, overrides: list[str], file: Path) -> dict[str, Any]:
    settings = dict(body) if isinstance(body, dict) else {}
    if body is not None and not isinstance(body, dict):
        raise ConfigError(f"pipeline file {file}: `pipeline:` must be a mapping, e.g. pipeline: {{dir: runs/p}}")
    for item in overrides:
        key, _, value = item.partition("=")
        settings[key.removeprefix("pipeline.")] = yaml.safe_load(value) if value else None
    for key in settings:
        if key not in PIPELINE_KEYS:
            raise ConfigError(f"pipeline.{key}: unknown key{did_you_mean(str(key), PIPELINE_KEYS, prefix='pipeline.')}"
                              f"; the pipeline section holds {', '.join(PIPELINE_KEYS)}")
    return settings


def _stage_spec(name: Any, body: Any, file: Path) -> StageSpec:
    if not isinstance(name, str) or not STAGE_NAME.match(name):
        raise ConfigError(f"pipeline file {file}: stage name {name!r}: use letters, digits, '_' and '-' only")
    body = {} if body is None else body
    if not isinstance(body, dict):
        raise ConfigError(f"stages.{name} in {file} must be a mapping: {{config: FILE, section: {{key: value}}}}")
    for key, value in body.items():
        if key not in (*STAGE_KEYS, *SECTIONS):
            raise ConfigError(f"stages.{name}.{key} in {file}: unknown key"
                              f"{did_you_mean(str(key), (*STAGE_KEYS, *SECTIONS), prefix=f'stages.{name}.')}; a "
                              f"stage holds config: and job sections ({', '.join(SECTIONS)})")
        if key in SECTIONS and not isinstance(value, dict):
            raise ConfigError(f"stages.{name}.{key} in {file} must be a mapping of keys, e.g. {key}: {{key: value}}")
    spec = body.get("config")
    return StageSpec(name=name, config=_stage_config(spec, name, file) if spec is not None else None,
                     sections={key: value for key, value in body.items() if key in SECTIONS})


def _stage_config(spec: Any, name: str, file: Path) -> Path:
    beside = file.parent / str(spec)
    if beside.is_file():
        return beside
    try:
        return find_config(str(spec))
    except ConfigError as exc:
        raise ConfigError(f"stages.{name}.config: {exc}") from None


def _with_cli(raw: dict[str, Any], stage_keys: dict[str, list[str]], shared_keys: list[str]) -> dict[str, Any]:
    conf = OmegaConf.create(raw)
    for name, keys in stage_keys.items():
        for item in keys:
            key, _, value = item.partition("=")
            OmegaConf.update(conf, f"stages.{name}.{key}", yaml.safe_load(value), merge=True)
    for item in shared_keys:
        key, _, value = item.partition("=")
        OmegaConf.update(conf, key, yaml.safe_load(value), merge=True)
    return OmegaConf.to_container(conf, resolve=False)


# ---------------- resolving the stages ----------------
def resolve_references(value: Any, known: dict[str, dict[str, str]], *, where: str) -> Any:
    """``value`` with every ``${stages.NAME.KIND}`` replaced by that earlier stage's folder (``known``)."""
    if isinstance(value, dict):
        return {key: resolve_references(item, known, where=where) for key, item in value.items()}
    if isinstance(value, list):
        return [resolve_references(item, known, where=where) for item in value]
    if not isinstance(value, str) or REFERENCE_START not in value:
        return value
    for start in _all(value, REFERENCE_START):
        if not REFERENCE.match(value, start):
            raise ConfigError(f"{where}: {value!r}: write ${{stages.NAME.checkpoint}} or ${{stages.NAME.dir}}")
    return REFERENCE.sub(lambda match: _reference(match, known, where), value)


def _all(text: str, part: str) -> list[int]:
    return [match.start() for match in re.finditer(re.escape(part), text)]


def _reference(match: re.Match, known: dict[str, dict[str, str]], where: str) -> str:
    name, kind = match.group(1), match.group(2)
    if kind not in REFERENCE_KINDS:
        raise ConfigError(f"{where}: {match.group(0)}: a stage offers {', '.join(REFERENCE_KINDS)}"
                          f"{did_you_mean(kind, REFERENCE_KINDS)}")
    if name not in known:
        earlier = ", ".join(known) or "none: it is the first stage"
        raise ConfigError(f"{where}: {match.group(0)} names no earlier stage{did_you_mean(name, known)}; "
                          f"the stages before it: {earlier}")
    return known[name][kind]


def sections_to_overrides(sections: dict[str, Any]) -> list[str]:
    """``{section: {key: value}}`` as ``section.key=<value as JSON>`` overrides (JSON is YAML, so each value loads
    back as it was; interpolations stay text)."""
    return [f"{section}.{key}={json.dumps(value)}" for section, body in sections.items() for key, value in body.items()]


def stage_overrides(pipeline: PipelineSpec, stage: StageSpec, known: dict[str, dict[str, str]]) -> list[str]:
    """The overrides that make ``stage``'s job config from its config file (see the module docstring)."""
    where = f"stage {stage.name}"
    shared = resolve_references(pipeline.shared, known, where=where)
    own = resolve_references(stage.sections, known, where=where)
    cli = [resolve_references(item, known, where=where) for item in (*pipeline.cli_shared, *stage.cli)]
    return [f"run.name={stage.name}", *sections_to_overrides(shared), *sections_to_overrides(own), *cli,
            f"run.dir={pipeline.dir / stage.name}", "checkpoint.resume=true"]


def prepare_stages(pipeline: PipelineSpec) -> list[Stage]:
    """Every stage's checked job, in order; a ConfigError names the stage whose config is wrong."""
    known: dict[str, dict[str, str]] = {}
    stages: list[Stage] = []
    for spec in pipeline.stages:
        overrides = stage_overrides(pipeline, spec, known)
        try:
            unresolved = env_references(spec.config, overrides)
            job = prepare(load_config(spec.config, overrides), given=given_keys(spec.config, overrides),
                          unresolved=unresolved)
        except ConfigError as exc:
            raise ConfigError(f"stage {spec.name}: {exc}") from None
        known[spec.name] = {"dir": str(job.run_dir),
                            "checkpoint": str(Path(job.cfg.checkpoint_dir).expanduser().absolute())}
        stages.append(Stage(name=spec.name, job=job, config_name=_shown(spec.config),
                            after=stages[-1].name if stages else None, done=completion(job.cfg, job.run_dir)))
    _check_stages(pipeline, stages)
    return stages


def _shown(config: Optional[Path]) -> str:
    if config is None:
        return "default"
    from megatron_rl.spec.resources import configs_dir

    return config.stem if config.parent.resolve() == configs_dir() else str(config)


def _check_stages(pipeline: PipelineSpec, stages: list[Stage]) -> None:
    executors = {stage.job.executor for stage in stages}
    if len(executors) > 1:
        which = ", ".join(f"{stage.name}: {stage.job.executor}" for stage in stages)
        raise ConfigError(f"the stages run on different executors ({which}); a pipeline runs on one: set "
                          "cluster.executor=local or cluster.executor=slurm on the command line")
    keys: dict[str, str] = {}
    for stage in stages:
        if stage.job.cfg.algorithm.name == "eval":
            key = eval_key(stage.job.cfg)
            if key in keys:
                raise ConfigError(f"stages {keys[key]} and {stage.name} both write eval.json entry {key!r}; give "
                                  f"each eval stage its own eval.stage")
            keys[key] = stage.name
    check_run_dir(pipeline.dir, key="pipeline.dir")
    if (pipeline.dir / CONFIG_FILE).is_file():
        raise ConfigError(f"pipeline.dir={pipeline.dir} is a run folder (it holds {CONFIG_FILE}); give a new "
                          "folder for the pipeline")


# ---------------- the pipeline folder ----------------
def write_pipeline_folder(pipeline: PipelineSpec, stages: list[Stage]) -> None:
    """stages.txt (the order status shows) and pipeline.yaml (the file with the command line, unresolved)."""
    make_private_dir(pipeline.dir)
    write_private_text(pipeline.dir / STAGE_ORDER_FILE, "".join(f"{stage.name}\n" for stage in stages))
    write_private_text(pipeline.dir / PIPELINE_FILE, OmegaConf.to_yaml(OmegaConf.create(pipeline.raw)))


def collect_eval(pipeline: PipelineSpec, stages: list[Stage]) -> Optional[Path]:
    """Merge the entries of every completed eval stage into <pipeline dir>/eval.json; its path, None when none."""
    path = pipeline.dir / EVAL_FILE
    entries = read_eval(path)
    found = False
    for stage in stages:
        if stage.job.cfg.algorithm.name == "eval" and completion(stage.job.cfg, stage.job.run_dir) is not None:
            key = eval_key(stage.job.cfg)
            entries[key] = {**read_eval(stage.job.run_dir / EVAL_FILE)[key], "pipeline_stage": stage.name}
            found = True
    if not found:
        return None
    return write_private_text(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")


# ---------------- what it shows ----------------
def chain_line(stages: list[Stage]) -> str:
    executor = stages[0].job.executor
    how = ("each stage's Slurm job waits on the previous one's: sbatch --dependency=afterok:<job> "
           "--kill-on-invalid-dep=yes" if executor == "slurm" else "local: one after another, stopping at the "
           "first that fails")
    names = " -> ".join(f"{stage.name}{' (complete: skipped)' if stage.done else ''}" for stage in stages)
    return f"# dependency chain ({how}):\n{names}"


def describe(pipeline: PipelineSpec, stages: list[Stage]) -> str:
    """--dry-run: each stage's resolved config, its plan (parallel.auto), and the chain."""
    parts = [f"# pipeline {pipeline.file} in {pipeline.dir}: {len(stages)} stage(s), {stages[0].job.executor}"]
    for number, stage in enumerate(stages, 1):
        after = f"after {stage.after} (afterok)" if stage.after else "first"
        state = f"complete, would be skipped: {stage.done}" if stage.done else "would run"
        parts.append(f"\n# ---- stage {number}/{len(stages)}: {stage.name} ({stage.config_name}, "
                     f"{stage.job.cfg.algorithm.name}; {after}; {state}) in {stage.job.run_dir}")
        parts.append(stage.job.config_text().rstrip())
        if stage.job.plan is not None:
            parts.append(f"# layout chosen by the planner for {stage.name}")
            parts.append(stage.job.plan.explain().rstrip())
    parts.append("\n" + chain_line(stages))
    return "\n".join(parts)


def say(message: str) -> None:
    print(f"pipeline: {message}", flush=True)


def stopped(stage: Stage, code: int, tail: str = "") -> str:
    return (f"pipeline stopped: stage {stage.name} failed (exit code {code}{tail}); log: {stage.log}; the stages "
            "after it did not run. Re-run the same command to resume it (complete stages are skipped)")


# ---------------- running ----------------
def run_local(pipeline: PipelineSpec, stages: list[Stage]) -> int:
    """Run the stages in order on this machine; the first failure stops the pipeline with its exit code."""
    from launcher.executors import local

    for number, stage in enumerate(stages, 1):
        if stage.done:
            say(f"stage {stage.name} ({number}/{len(stages)}) skipped: {stage.done}")
            continue
        say(f"stage {stage.name} ({number}/{len(stages)}): {stage.config_name}, {stage.job.cfg.algorithm.name}, "
            f"in {stage.job.run_dir}")
        started = time.monotonic()
        code = local.run(stage.job)
        if code != 0:
            collect_eval(pipeline, stages)
            print(f"error: {stopped(stage, code)}", file=sys.stderr, flush=True)
            return code
        say(f"stage {stage.name} done in {time.monotonic() - started:.0f} s")
    return 0


def submit_slurm(pipeline: PipelineSpec, stages: list[Stage], *, wait: bool) -> tuple[int, Optional[str]]:
    """Submit every stage that is not complete at once, each held by afterok on the previous one; with ``wait``
    follow them in order. Returns (exit code, the last job submitted or None)."""
    from launcher.slurm import executor as slurm
    from launcher.slurm.query import scancel

    slurm.require_tools(slurm.SUBMIT_TOOLS + (slurm.WAIT_TOOLS if wait else ()))
    submitted: list[tuple[Stage, str]] = []
    for number, stage in enumerate(stages, 1):
        if stage.done:
            say(f"stage {stage.name} ({number}/{len(stages)}) skipped: {stage.done}")
            continue
        after = [submitted[-1][1]] if submitted else []
        say(f"stage {stage.name} ({number}/{len(stages)}): {stage.config_name}, {stage.job.cfg.algorithm.name}")
        try:
            submitted.append((stage, slurm.submit_run(stage.job, after=after)))
        except BaseException:
            if submitted:  # no half chain left queued
                scancel([job_id for _, job_id in submitted])
            raise
    if submitted:
        say("submitted " + " -> ".join(f"{stage.name} (job {job_id})" for stage, job_id in submitted)
            + f"; follow with: python launch.py status {pipeline.dir}")
    last = submitted[-1][1] if submitted else None
    if not wait:
        return 0, last
    for index, (stage, job_id) in enumerate(submitted):
        code = slurm.follow_run(stage.job, job_id)
        if code != 0:
            rest = [later for _, later in submitted[index + 1:]]
            if rest:
                scancel(rest)  # Slurm cancels them itself (kill-on-invalid-dep); this makes it immediate
            collect_eval(pipeline, stages)
            print(f"error: {stopped(stage, code, f', Slurm job {job_id}')}", file=sys.stderr, flush=True)
            return code, last
    return 0, last


def run_pipeline(path: str | Path, overrides: Sequence[str] = (), *, dry_run: bool = False,
                 wait: bool = False) -> int:
    """``launch.py pipeline``: load, check every stage, then show (dry run), run (local) or submit (Slurm) them."""
    pipeline = load_pipeline(path, overrides)
    stages = prepare_stages(pipeline)
    if dry_run:
        print(describe(pipeline, stages))
        return 0
    lock = acquire(pipeline.dir, key="pipeline.dir")  # one pipeline per folder: a second launch into it stops here
    try:
        write_pipeline_folder(pipeline, stages)
        started = time.monotonic()
        if stages[0].job.executor == "slurm":
            code, last_job = submit_slurm(pipeline, stages, wait=wait)
            if last_job is not None and not wait:
                lock.hand_to_job(last_job)  # the folder is the chain's while squeue lists its last job
        else:
            code = run_local(pipeline, stages)
    finally:
        lock.release()  # nothing after hand_to_job
    if code != 0:
        return code
    evals = collect_eval(pipeline, stages)
    finished = stages[0].job.executor == "local" or wait
    if finished:
        say(f"complete in {time.monotonic() - started:.0f} s: {len(stages)} stage(s) in {pipeline.dir}"
            + (f"; eval: {evals}" if evals else ""))
        if evals:
            print(eval_table(read_eval(evals)))
    return 0


def eval_table(entries: dict[str, Any]) -> str:
    lines = [f"{'stage':<12} {'pass@1':>7} {'pass@k':>7} {'k':>3} {'reward':>7} {'prompts':>7}"]
    for key, entry in entries.items():
        lines.append(f"{key:<12} {entry.get('pass@1', 0):>7.3f} {entry.get('pass@k', 0):>7.3f} "
                     f"{entry.get('k', 0):>3} {entry.get('mean_reward', 0):>7.3f} {entry.get('n_prompts', 0):>7}")
    return "\n".join(lines)
