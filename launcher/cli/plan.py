"""``python launch.py plan [--config FILE] [key=value ...] [flags] [--json]``: plan the job that ``python launch.py
[--config FILE] [key=value ...]`` would launch (same loader, overrides and defaults) and print it.

The flags are shorthands for config keys: ``--model`` model.name, ``--gpus N`` N GPUs in all (cluster.nodes x
cluster.tasks_per_node, one task per GPU, in nodes of the config file's cluster.gpus_per_node or else of the GPU
type's node size), ``--gpu-type`` cluster.gpu_type, ``--seq-len`` model.seq_length, ``--global-batch-size``
algorithm.global_batch_size, ``--mode`` algorithm.name, ``--layout tp=8,pp=16,mbs=1,sp=true,...`` the parallel.*
keys of the same names, ``--attention`` runtime.attention, ``--grad-dtype`` runtime.grad_dtype, ``--tp-comm-overlap``
runtime.tp_comm_overlap=true. ``--mean-response-len N`` (GRPO/PPO) is the rollout's mean response length, which step
time depends on (default half of generation.max_new_tokens). With --config the file's values are the defaults and
flags override them; a key given by a flag and by key=value is an error. Without --config, ``--model`` sizes a
pretraining job unless --mode or algorithm.name says otherwise (the built-in default job is GRPO on a tiny CPU model),
and what the flags and keys leave out is set by a stated rule, not the tiny job's values (``stated_defaults``: the batch, and for
GRPO/PPO the rollout's size and longest response); the plan prints each such value with its rule ("Assumed", and
``assumed`` in --json), to pass to launch.py as key=value.

With ``cluster.rollout_tasks`` = R (split placement) the layout is planned over the world less R, with rollout
replicas of its tp x pp on the R rollout GPUs; the plan shows both sides' times and memory and suggests an R that
balances generation and training (the config keeps its own).

The search keeps every parallel.* key that is given (file, key=value or --layout; any subset: the rest is searched)
and holds the trainer limits (``megatron_rl/spec/limits.py``); the plan lists both. It prints the chosen layout's memory and
step time by part, the runner-up and the part of the step time it lost on (or, when the kept keys excluded a
faster layout, that one), and the alternatives: the fastest of each other tp/pp/cp/ep first. Example:
``python launch.py plan --model llama-3.1-405b --gpus 16384 --gpu-type h100-80gb --global-batch-size 2048``.
``python launch.py plan --calibrate RUN_DIR [--json]`` prints a run's prediction (written at launch) beside what it
measured, with the error of each (``megatron_rl/spec/calibrate.py``).
Exit codes: 0 plan printed; 2 bad input; 3 nothing fits: one line on stderr with the memory the leanest layout needs,
the nearest layout that fits when keys were kept (as a --layout value, which plans with exit 0), and the smallest GPU
count that would fit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from launcher.cli import CliParser
from megatron_rl.spec.config.schema import ALGORITHMS, JobConfig
from megatron_rl.spec.errors import ConfigError

EXIT_NO_FIT = 3
SHORTHANDS = {"model": "model.name", "gpu_type": "cluster.gpu_type", "seq_len": "model.seq_length",
              "global_batch_size": "algorithm.global_batch_size", "mode": "algorithm.name",
              "attention": "runtime.attention", "grad_dtype": "runtime.grad_dtype",
              "tp_comm_overlap": "runtime.tp_comm_overlap"}
"""plan's flags (argparse names) -> the config key each one sets."""
GPUS_KEYS = ("cluster.nodes", "cluster.tasks_per_node", "cluster.gpus_per_node")
"""What --gpus sets (it reads cluster.gpus_per_node, the node size, from the config file when that gives it)."""


TOKENS_PER_STEP = 1 << 22
"""A pretraining step of about 4M tokens without a config: Llama 2's batch at every size (4M tokens), GPT-3 175B's
3.2M, Megatron-LM's 530B and 1T runs' 3.9M and 6.3M."""
SEQUENCES_PER_GPU = 1 / 8
"""And at least one sequence per 8 GPUs: Llama 3.1 405B's 2,048 sequences on 16,384 GPUs, so a data-parallel replica
of a large cluster still gets enough micro-batches to fill its pipeline."""
RL_ROLLOUT = {"algorithm.prompts_per_step": 128, "algorithm.group_size": 16, "algorithm.global_batch_size": 512}
"""GRPO/PPO without a config: NeMo RL's published Llama-3.1-8B GRPO step (128 prompts x 16 completions, 2,048 per
step, in optimizer steps of 512)."""


MAX_GPUS = 1 << 20
"""--gpus above this (1,048,576) is refused: no cluster is that big, and the search would run for hours."""
MAX_TOKENS = 1 << 24
"""--seq-len and --global-batch-size above this (16,777,216) are refused."""


def bounded_int(flag: str, high: int, low: int = 1):
    """An argparse type: an int in [low, high], else a one-line error naming ``flag`` and the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"plan: {flag} {text!r} is not a whole number; give e.g. {flag} 8") from None
        if not low <= value <= high:
            raise ConfigError(f"plan: {flag} {text} is out of range; give a number from {low} to {high:,}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the plan subcommand."""
    p = CliParser(prog="launch.py plan", description="Plan the parallel layout of the job that launch.py with the "
                  "same --config and key=value overrides would launch.")
    p.add_argument("--config", metavar="FILE", help="YAML config file or shipped config name (as for launch.py)")
    p.add_argument("--model", help="model.name: preset, HF config.json (or folder), or Megatron-style YAML")
    p.add_argument("--gpus", type=bounded_int("--gpus", MAX_GPUS),
                   help="GPUs in all: sets cluster.nodes, tasks_per_node and gpus_per_node")
    p.add_argument("--gpu-type", help="cluster.gpu_type: a100-80gb | h100-80gb | h200-141gb | ...")
    p.add_argument("--seq-len", type=bounded_int("--seq-len", MAX_TOKENS),
                   help="model.seq_length (default: the model's)")
    p.add_argument("--global-batch-size", type=bounded_int("--global-batch-size", MAX_TOKENS),
                   help="algorithm.global_batch_size: sequences per optimizer step")
    p.add_argument("--mode", choices=ALGORITHMS, help="algorithm.name, the trainer")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp8"], help="planning precision")
    p.add_argument("--attention", choices=["flash", "unfused"],
                   help="runtime.attention: the core attention kernel (default: the config's; auto is flash)")
    p.add_argument("--grad-dtype", choices=["fp32", "bf16"], help="runtime.grad_dtype: main gradients and their "
                   "data-parallel reduction")
    p.add_argument("--tp-comm-overlap", action="store_const", const="true", default=None,
                   help="runtime.tp_comm_overlap=true: overlap TP collectives with GEMMs (needs TE on GPUs)")
    p.add_argument("--mean-response-len", type=bounded_int("--mean-response-len", MAX_TOKENS), metavar="N",
                   help="GRPO/PPO: mean response tokens of the rollout, at most generation.max_new_tokens "
                        "(default: half of it)")
    p.add_argument("--layout", help="parallel.* keys to keep, e.g. tp=8,pp=16,vpp=4,cp=1,ep=1,mbs=1,"
                   "recompute=selective,sp=true")
    p.add_argument("--top-k", type=bounded_int("--top-k", 100), default=5, help="alternatives to show")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--calibrate", metavar="RUN_DIR",
                   help="compare a run's measured step time and peak memory with the prediction written at launch")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for launch.py")
    return p


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides that plan's flags (but --gpus) and key=value arguments stand for."""
    from launcher.planner import parse_layout
    from megatron_rl.spec.errors import as_yaml

    flags = [f"{key}={getattr(args, name)}" for name, key in SHORTHANDS.items() if getattr(args, name) is not None]
    flags += [f"parallel.{key}={as_yaml(value)}" for key, value in parse_layout(args.layout or "").items()]
    _refuse_twice(flags, args.overrides)
    if args.gpus is not None:
        _refuse_twice([f"{key}=" for key in GPUS_KEYS], args.overrides, flag="--gpus")
    default_mode = ([] if args.model is None or args.config is not None or args.mode is not None
                    else ["algorithm.name=pretrain"])
    return [*default_mode, *flags, *args.overrides]


def stated_defaults(cfg: JobConfig, shape, *, given: frozenset[str],
                    mean_response_len: int | None) -> list[tuple[str, object, str]]:
    """(key, value, rule) for what a plan without --config leaves out and the tiny default job would otherwise fill
    in: pretraining/SFT's global batch (TOKENS_PER_STEP and SEQUENCES_PER_GPU, rounded up to a power of two);
    GRPO/PPO's rollout (RL_ROLLOUT) and longest response (3/4 of model.seq_length, the planner's prompts taking the
    first quarter; with --mean-response-len N at least 2N, the sequence length raised to fit). Keys the user gave
    are kept."""
    mode = cfg.algorithm.name
    seq = cfg.model.seq_length or shape.seq_length
    out: list[tuple[str, object, str]] = []
    if mode in ("pretrain", "sft") and "algorithm.global_batch_size" not in given:
        tokens, per_gpu = TOKENS_PER_STEP // seq, math.ceil(cfg.cluster.world_size * SEQUENCES_PER_GPU)
        batch = 1 << (max(tokens, per_gpu, 1) - 1).bit_length()
        out.append(("algorithm.global_batch_size", batch,
                    f"the larger of 4M tokens per step ({tokens:,} x {seq:,}) and one sequence per 8 GPUs "
                    f"({per_gpu:,}), up to a power of two"))
    if mode in ("grpo", "ppo"):
        if not given & set(RL_ROLLOUT):
            out += [(key, value, "NeMo RL's Llama-3.1-8B GRPO step: 128 prompts x 16 completions, optimizer steps "
                     "of 512") for key, value in RL_ROLLOUT.items()]
        if "generation.max_new_tokens" not in given:
            response = seq - seq // 4
            if mean_response_len is not None and 2 * mean_response_len > response:
                if "model.seq_length" not in given:
                    seq = -(-(2 * mean_response_len * 4 // 3 + 1) // 1024) * 1024
                    out.append(("model.seq_length", seq, f"raised to hold prompts of a quarter of it and "
                                f"responses of twice --mean-response-len {mean_response_len}"))
                response = max(seq - seq // 4, 2 * mean_response_len)
            out.append(("generation.max_new_tokens", response,
                        f"twice --mean-response-len {mean_response_len}" if response > seq - seq // 4
                        else "3/4 of model.seq_length (prompts take the first quarter)"))
    return out


def assumed_lines(assumed: list[tuple[str, object, str]]) -> list[str]:
    """The plan's "Assumed" lines: the keys one rule set share a line."""
    rules: dict[str, list[str]] = {}
    for key, value, rule in assumed:
        rules.setdefault(rule, []).append(f"{key}={value}")
    return [f"{'Assumed' if i == 0 else '':12}{', '.join(keys)}: {rule}" for i, (rule, keys) in enumerate(rules.items())]


def gpus_overrides(gpus: int, cfg: JobConfig, given: frozenset[str]) -> list[str]:
    """cluster.nodes / tasks_per_node / gpus_per_node for ``gpus`` GPUs in all, one task per GPU: whole nodes of
    cfg.cluster.gpus_per_node GPUs (or the GPU type's node size), or one node when ``gpus`` is below that. A job
    over several nodes also gets cluster.executor=auto unless the config gives an executor (local is one node)."""
    from launcher.planner.gpus import get_gpu

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: give a positive GPU count")
    size, source = cfg.cluster.gpus_per_node, "cluster.gpus_per_node of the config"
    if not size:
        size, source = get_gpu(cfg.cluster.gpu_type).gpus_per_node, f"the node size of {cfg.cluster.gpu_type}"
    if gpus >= size and gpus % size:
        raise ConfigError(f"--gpus {gpus} does not split into whole nodes of {size} GPUs ({source}); give a "
                          f"multiple of {size}, or fewer than {size}")
    nodes, per_node = (gpus // size, size) if gpus >= size else (1, gpus)
    executor = ["cluster.executor=auto"] if nodes > 1 and "cluster.executor" not in given else []
    return [f"cluster.nodes={nodes}", f"cluster.tasks_per_node={per_node}", f"cluster.gpus_per_node={per_node}",
            *executor]


def _refuse_twice(flags: list[str], overrides: list[str], flag: str = "") -> None:
    """ConfigError when a flag and a key=value override set the same key."""
    given = {item.partition("=")[0]: item for item in overrides}
    for item in flags:
        key = item.partition("=")[0]
        if key in given:
            name = flag or _flag_of(key)
            raise ConfigError(f"{key} is given twice, by {name} and by {given[key]}; give it once")


def _flag_of(key: str) -> str:
    names = {value: "--" + name.replace("_", "-") for name, value in SHORTHANDS.items()}
    return names.get(key, "--layout")


def calibrate(args: argparse.Namespace) -> int:
    """``plan --calibrate RUN_DIR``: the prediction beside the measurement, one line (or --json)."""
    from megatron_rl.spec.calibrate import calibration_report, one_line

    if args.overrides or args.config or args.model or args.layout:
        raise ConfigError("--calibrate RUN_DIR reads that run's own prediction and metrics; give no config, model, "
                          "layout or key=value with it")
    report = calibration_report(args.calibrate)
    print(json.dumps(report) if args.json else one_line(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the plan subcommand; returns the exit code."""
    from launcher.job import load_shape, plan_job
    from launcher.planner import NoFeasibleLayout, layout_arg
    from megatron_rl.spec.config.loader import given_keys, load_config
    from megatron_rl.spec.config.validate import check_lengths

    as_json = "--json" in (sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_intermixed_args(argv)
        if args.calibrate is not None:
            return calibrate(args)
        overrides = job_overrides(args)
        # with --gpus, the first load only reads the node size: runtime keys are checked once the GPUs are set
        first = [o for o in overrides if not o.startswith("runtime.")] if args.gpus is not None else overrides
        cfg = load_config(args.config, first, allow_missing=True)
        if args.gpus is not None:
            overrides += gpus_overrides(args.gpus, cfg, given_keys(args.config, overrides))
            cfg = load_config(args.config, overrides, allow_missing=True)
        shape = load_shape(cfg.model.name)
        given = given_keys(args.config, overrides)
        assumed = [] if args.config is not None or "model.name" not in given else stated_defaults(
            cfg, shape, given=given, mean_response_len=args.mean_response_len)
        if assumed:
            overrides += [f"{key}={value}" for key, value, _ in assumed]
            cfg = load_config(args.config, overrides, allow_missing=True)
        check_lengths(cfg, shape)
        result = plan_job(cfg, shape, given=given,  # the assumed keys are searched around, not kept
                          precision=args.precision, top_k=args.top_k, mean_response_length=args.mean_response_len)
    except NoFeasibleLayout as exc:
        print(f"error: {exc}", file=sys.stderr)
        if as_json:
            leanest = exc.leanest.memory_gib() if exc.leanest is not None else None
            nearest = exc.nearest
            print(json.dumps({"fits": False, "error": str(exc), "smallest_gpus": exc.smallest_gpus,
                              "leanest_memory_gib": leanest,
                              "nearest_layout": layout_arg(nearest.layout) if nearest is not None else None,
                              "nearest_memory_gib": nearest.memory_gib() if nearest is not None else None}))
        return EXIT_NO_FIT
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.json:
        print(json.dumps({**result.to_dict(), "assumed": {key: {"value": value, "rule": rule}
                                                          for key, value, rule in assumed}}))
    else:
        head, _, rest = result.explain().partition("\n")
        print("\n".join([head, *assumed_lines(assumed), rest]))
    if not cfg.parallel.auto and not args.json:
        print("\nNote        parallel.auto is false: launch.py runs the config's parallel: keys as they are; set "
              "parallel.auto=true to launch this plan")
    return 0
