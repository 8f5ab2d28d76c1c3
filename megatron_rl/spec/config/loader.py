"""Load a job config: ``OmegaConf.structured(JobConfig)`` <- YAML file <- ``key=value`` overrides -> ``JobConfig``.

The YAML file is a path or the name of a shipped config (``grpo_tiny``, see ``configs/``); a real path wins.

Every OmegaConf or YAML failure is turned into a one-line ``ConfigError`` that names the key or file and the fix.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    GrammarParseError,
    InterpolationResolutionError,
    OmegaConfBaseException,
    ValidationError,
)

from megatron_rl.spec.config.schema import JobConfig
from megatron_rl.spec.errors import ConfigError, did_you_mean
from megatron_rl.spec.resources import configs_dir


def load_config(path: Optional[str | Path] = None, overrides: Sequence[str] = (), *,
                allow_missing: bool = False) -> JobConfig:
    """Merge the schema defaults, the YAML at ``path`` (if any) and ``overrides``; return a checked JobConfig.
    ``allow_missing``: keys the file leaves as '???' keep their schema defaults instead of failing (``launch.py
    plan`` sizes a job without its data and checkpoint paths)."""
    path, file_config, override_config = _sources(path, overrides)
    merged: DictConfig = OmegaConf.structured(JobConfig)
    required: set[str] = set()
    if file_config is not None:
        required = set(OmegaConf.missing_keys(file_config))
        merged = _merge(merged, file_config, source=str(path))
    if override_config is not None:
        required -= {key for key in required if OmegaConf.select(override_config, key) is not None}
        merged = _merge(merged, override_config, source="the command line")
    try:
        missing = sorted(required | set(OmegaConf.missing_keys(merged)))
        if missing and not allow_missing:
            raise ConfigError(f"{', '.join(missing)} must be set ('???' in {path}); add e.g. {missing[0]}=VALUE "
                              "to the command line")
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        raise _translate(exc, "the merged config") from None


def given_keys(path: Optional[str | Path] = None, overrides: Sequence[str] = ()) -> frozenset[str]:
    """The ``section.key`` names that the YAML at ``path`` or ``overrides`` set to a value: what the user chose,
    as opposed to the schema defaults ('???' placeholders do not count). With ``parallel.auto=true`` the planner
    keeps the given ``parallel.*`` keys. Call it with the arguments given to ``load_config``."""
    keys: set[str] = set()
    for source in _sources(path, overrides)[1:]:
        for section, body in (source or {}).items():
            if OmegaConf.is_dict(body):
                keys.update(f"{section}.{key}" for key in body if not OmegaConf.is_missing(body, key))
    return frozenset(keys)


def _sources(path: Optional[str | Path],
             overrides: Sequence[str]) -> tuple[Optional[Path], Optional[DictConfig], Optional[DictConfig]]:
    """(the config file, its contents, the overrides as a config); None for what is not given."""
    file = find_config(path) if path is not None else None
    return file, _read_yaml(file) if file is not None else None, _parse_overrides(overrides) if overrides else None


ENV_RESOLVER = "${oc.env:"
RESOLVED_AT_LAUNCH = ("parallel.", "run.dir")
"""Keys the launcher decides (the planner's layout, the run folder): written resolved even when they read oc.env."""


def env_references(path: Optional[str | Path] = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """``section.key`` -> its unresolved value, for the keys that the YAML at ``path`` or ``overrides`` set with an
    ``${oc.env:NAME}`` interpolation (a secret, say). ``to_yaml`` writes these unresolved, so no value of the
    environment reaches config.yaml or ``--dry-run``; the job resolves them from its own environment when it loads
    config.yaml. Call it with the arguments given to ``load_config``."""
    found: dict[str, Any] = {}
    for source in _sources(path, overrides)[1:]:
        for section, body in (source or {}).items():
            if not OmegaConf.is_dict(body):
                continue
            for key in body:
                name = f"{section}.{key}"
                raw = OmegaConf.to_container(body, resolve=False)[key]
                if ENV_RESOLVER in str(raw) and name == "cluster.setup":
                    raise ConfigError("cluster.setup reads ${oc.env:...}, but setup lines are written into the job "
                                      "script; name the variable in cluster.env and write $NAME in the line")
                if ENV_RESOLVER in str(raw) and not name.startswith(RESOLVED_AT_LAUNCH):
                    found[name] = raw
                else:
                    found.pop(name, None)  # a later source set it plainly
    return found


def to_yaml(config: JobConfig, unresolved: Optional[dict[str, Any]] = None) -> str:
    """The config as YAML, resolved but for the ``unresolved`` keys (``env_references``), which keep their
    ``${oc.env:...}`` text; loading it back with ``load_config`` gives an equal JobConfig."""
    conf = OmegaConf.structured(config)
    for key, raw in (unresolved or {}).items():
        for leaf, value in _leaves(key, raw):  # a nested section (logging.wandb) takes its keys one by one
            if ENV_RESOLVER in str(value):
                OmegaConf.update(conf, leaf, value, merge=False)
    return OmegaConf.to_yaml(conf)


def _leaves(key: str, raw: Any):
    """(dotted key, value) of every non-mapping value under ``raw``, ``raw`` itself when it is no mapping."""
    if isinstance(raw, dict):
        for name, value in raw.items():
            yield from _leaves(f"{key}.{name}", value)
    else:
        yield key, raw


def shipped_configs() -> list[str]:
    """Names of the configs that ship with the launcher (``configs/*.yaml``), usable as ``--config NAME``."""
    return sorted(p.stem for p in configs_dir().glob("*.yaml"))


def find_config(spec: str | Path) -> Path:
    """The config file ``spec`` names: that file if it exists, else the shipped config ``spec`` (``.yaml`` optional)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ConfigError(f"config file {path} not found (it is a folder; give the YAML file inside it)")
    shipped, name, bare = shipped_configs(), path.name.removesuffix(".yaml"), path.parent == Path(".")
    if bare and name in shipped:
        return configs_dir() / f"{name}.yaml"
    where = "no such file and no shipped config of that name" if bare else "check the path"
    raise ConfigError(f"config file {spec} not found: {where}{did_you_mean(name, shipped)}; "
                      f"shipped configs: {', '.join(shipped)}")


def read_text(path: Path, what: str = "config file") -> str:
    """The UTF-8 text of ``path``; a ConfigError naming the file when it is not UTF-8 or cannot be read."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                          f"{exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc.strerror}); check the path and its permissions") \
            from None


def _read_yaml(path: Path) -> DictConfig:
    text = read_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model:, parallel:, ...)")
    if isinstance(data.get("stages"), dict):
        raise ConfigError(f"config file {path} is a pipeline (it has stages:); run it with `python launch.py "
                          f"pipeline --config {shlex.quote(str(path))}` (--dry-run shows each stage's plan)")
    return OmegaConf.create(data)


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key or key.strip() != key:
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. run.steps=10")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError(f"could not parse the overrides {list(overrides)}: {_first_line(exc)}; quote values "
                          "with spaces, braces or colons, e.g. 'cluster.setup=[\"module load cuda\"]'") from None


def _merge(base: DictConfig, extra: DictConfig, *, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, extra)
    except OmegaConfBaseException as exc:
        raise _translate(exc, source) from None


def _translate(exc: OmegaConfBaseException, source: str) -> ConfigError:
    full_key = getattr(exc, "full_key", None) or "?"
    if isinstance(exc, ConfigKeyError):
        key = getattr(exc, "key", None) or full_key.rsplit(".", 1)[-1]
        valid = _valid_keys(getattr(exc, "object_type", None))
        hint = did_you_mean(str(key), valid, prefix=_parent(full_key))
        return ConfigError(f"unknown config key {full_key!r} in {source}{hint}; valid keys here: {', '.join(valid)}")
    if isinstance(exc, (InterpolationResolutionError, GrammarParseError)):
        return ConfigError(f"config key {full_key!r} in {source}: {_first_line(exc)}; fix the ${{...}} reference "
                           "(${section.key} for another key, ${oc.env:NAME} for an environment variable)")
    if isinstance(exc, ValidationError):
        return ConfigError(f"config key {full_key!r} in {source}: {_first_line(exc)}; fix its value or type")
    return ConfigError(f"config error at {full_key!r} in {source}: {_first_line(exc)}")


def _valid_keys(object_type: Any) -> list[str]:
    if object_type is not None and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    return [f.name for f in dataclasses.fields(JobConfig)]


def _parent(full_key: str) -> str:
    return full_key.rsplit(".", 1)[0] + "." if "." in full_key else ""


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
