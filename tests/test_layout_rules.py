"""One rule set: the planner's verdict on a layout, the launch check's and Megatron's own agree.

A sweep of layouts (tp, pp, vpp, cp, ep, etp, sequence parallelism) of a dense model, an MoE model and an MLA model under
every algorithm. For each:
- the launch check: the config loads and ``check_layout`` passes (what ``launch.py`` runs before anything queues);
- the planner: ``plan_job`` with every layout key held (what ``launch.py plan`` and ``parallel.auto`` run) finds it
  legal (a layout that is legal but does not fit in memory counts as legal);
- Megatron: ``TransformerConfig`` accepts the sizes, and the world splits into whole ``RankGenerator`` groups.
The planner and the launch check must give the same verdict (their reasons come from the same rule functions).
Everything Megatron refuses, they refuse; what they refuse beyond Megatron must be one of this project's own rules
(``OWN_RULES``).

Run: .venv/bin/python -m pytest tests/test_layout_rules.py -q
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest

from launcher.job import plan_job
from launcher.planner import PLANNED_KEYS, NoFeasibleLayout
from megatron_rl.spec.config import load_config
from megatron_rl.spec.config.loader import given_keys
from megatron_rl.spec.config.validate import check_layout, with_pipeline_split
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import load_model_shape

torch = pytest.importorskip("torch")
transformer_config = pytest.importorskip("megatron.core.transformer.transformer_config")
parallel_state = pytest.importorskip("megatron.core.parallel_state")

MODELS = ("llama-3.3-70b", "qwen3-235b-a22b", "deepseek-v3")
"""Dense (GQA), MoE and MLA (with shared experts)."""
ALGORITHMS = ("grpo", "ppo", "rm", "dpo", "sft", "pretrain")
WORLD = 16
SEQ_LENGTHS = (4096, 4098)
"""model.seq_length: 4098 is no multiple of 2*cp at cp=2 (only pretrain, whose trainer does not pad, is refused)."""
GLOBAL_BATCHES = (512, 8)
"""algorithm.global_batch_size: 8 leaves some dp x micro-batch splits whole and some not, and some micro-batch
counts a multiple of pp and some not."""
OWN_RULES = ("does not divide the MLP size", "does not divide the expert MLP size", "shared expert size",
             "interleaving needs the micro-batches", "is not divisible by parallel.micro_batch_size*dp",
             "does not support context parallelism", "reads its reward at each sequence's last token",
             "multi-latent attention with context parallelism needs Transformer Engine",
             "without Transformer Engine needs parallel.sequence_parallel", "is not a multiple of",
             "does not train like one process", "is not divisible by the data-parallel size",
             "does not divide the world size", "does not divide the 16 training",
             "MoE models with parallel.tp > 1 need parallel.sequence_parallel=true", "not divisible by pp=",
             "query groups (KV heads)")
"""Reasons this project refuses a layout that Megatron's config classes accept: the trainers' limits; rules Megatron
checks only when it builds or runs the layers (the MLP splits, sequence parallelism in an MoE layer's forward) or
the schedule (micro-batches under interleaving); the even pipeline split (megatron/training's check, not in core);
the world's divisibility (initialize_model_parallel, which needs a process group); and tp a multiple of the query
groups, which Megatron accepts by replicating KV heads but this project's checkpoints and converter (QKV split per
query group) do not run."""


def _layouts():
    for tp, pp, vpp, cp, ep, sp in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2), (1, 2), (1, 2, 8),
                                                     (False, True)):
        if not (vpp > 1 and pp == 1) and not (sp and tp == 1):  # the schema refuses these as it loads
            # experts split by ep alone (etp 1, the default under EP) or also by tp (etp = tp) on half of them
            etp = tp if ep > 1 and tp > 1 and (pp + cp + sp) % 2 else None
            yield dict(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, sequence_parallel=sp,
                       micro_batch_size=1 + (tp + pp) % 2)


def _cases():
    cases = []
    for model, algorithm in itertools.product(MODELS, ALGORITHMS):
        for index, layout in enumerate(_layouts()):
            if index % 3 == ALGORITHMS.index(algorithm) % 3:  # a third of the grid per algorithm, all of it per model
                cases.append((model, algorithm, layout, GLOBAL_BATCHES[index % 2], SEQ_LENGTHS[index // 2 % 2]))
    return cases


def _base_config(model: str, algorithm: str):
    overrides = [f"model.name={model}", f"algorithm.name={algorithm}", "cluster.nodes=2", "parallel.auto=false",
                 "model.init_from=/ckpt", "model.tokenizer=/tok", "data.train_path=/data.jsonl"]
    return load_config("grpo_llama70b", overrides), given_keys("grpo_llama70b", overrides)


def _with_layout(base, layout: dict, global_batch: int, seq_length: int):
    """The base config with this layout, batch and length (the schema's checks run as they do when a file sets
    them)."""
    return dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **layout),
                               algorithm=dataclasses.replace(base.algorithm, global_batch_size=global_batch),
                               model=dataclasses.replace(base.model, seq_length=seq_length))


def _verdict(fn) -> str | None:
    try:
        fn()
    except NoFeasibleLayout:
        return None  # legal, too big for the GPUs
    except ConfigError as exc:
        return str(exc)
    return None


def _megatron_refuses(shape, layout: dict) -> str | None:
    tp, pp, vpp, cp, ep, sp = (layout[k] for k in ("tp", "pp", "vpp", "cp", "ep", "sequence_parallel"))
    etp = layout["etp"] or (1 if ep > 1 else tp)
    moe = dict(num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
               moe_router_topk=shape.moe_router_topk) if shape.is_moe else {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformer_config.TransformerConfig(
                num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
                num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
                add_bias_linear=shape.add_bias_linear, add_qkv_bias=shape.add_qkv_bias,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp, sequence_parallel=sp,
                pipeline_dtype=torch.bfloat16, **moe)
        if WORLD % (tp * pp * cp) == 0:
            generator = parallel_state.RankGenerator(tp=tp, ep=1, dp=WORLD // (tp * pp * cp), pp=pp, cp=cp,
                                                     order="tp-cp-ep-dp-pp")
            ranks = sorted(r for group in generator.get_ranks("dp") for r in group)
            assert ranks == list(range(WORLD)), "the dp groups do not cover the world once"
        if WORLD % (etp * ep * pp) == 0:
            experts = parallel_state.RankGenerator(tp=etp, ep=ep, dp=WORLD // (etp * ep * pp), pp=pp, cp=1,
                                                   order="tp-ep-dp-pp")
            ranks = sorted(r for group in experts.get_ranks("dp") for r in group)
            assert ranks == list(range(WORLD)), "the expert dp groups do not cover the world once"
    except (ValueError, AssertionError, RuntimeError) as exc:
        return str(exc) or type(exc).__name__
    return None


@pytest.fixture(scope="module")
def verdicts():
    """(model, algorithm, layout, launch check's reason, planner's reason, Megatron's reason); None: legal."""
    shapes = {model: load_model_shape(model) for model in MODELS}
    bases = {(m, a): _base_config(m, a) for m, a in itertools.product(MODELS, ALGORITHMS)}
    held = {f"parallel.{key}" for key in PLANNED_KEYS}  # what launcher.job.evaluate_layout holds
    out = []
    for model, algorithm, layout, global_batch, seq_length in _cases():
        shape, (base, given) = shapes[model], bases[model, algorithm]
        megatron = _megatron_refuses(shape, layout)
        try:
            cfg = with_pipeline_split(_with_layout(base, layout, global_batch, seq_length), shape)  # as launcher.job.prepare does
        except ConfigError as exc:  # the schema: refused before either check, the same for both
            out.append((model, algorithm, layout, str(exc), str(exc), megatron))
            continue
        launch = _verdict(lambda: check_layout(cfg, shape))
        planner = _verdict(lambda: plan_job(cfg, shape, given=given | held, top_k=0))
        out.append((model, algorithm, layout, launch, planner, megatron))
    return out


def test_the_planner_and_the_launch_check_agree(verdicts):
    disagree = [(m, a, lay, launch, planner) for m, a, lay, launch, planner, _ in verdicts
                if (launch is None) != (planner is None)]
    assert not disagree, f"{len(disagree)} disagreements, e.g. {disagree[:3]}"
    assert sum(launch is None for *_, launch, _, _ in verdicts) > 50, "the sweep holds legal layouts"
    assert sum(launch is not None for *_, launch, _, _ in verdicts) > 50, "and illegal ones"
    assert sum(lay["etp"] is not None and launch is None for _, _, lay, launch, _, _ in verdicts) > 10, \
        "and legal ones with etp = tp under ep > 1"


def test_what_megatron_refuses_is_refused(verdicts):
    accepted = [(m, a, lay, megatron) for m, a, lay, launch, _, megatron in verdicts
                if megatron is not None and launch is None]
    assert not accepted, f"{len(accepted)} layouts Megatron refuses were accepted, e.g. {accepted[:3]}"
    assert sum(megatron is not None for *_, megatron in verdicts) > 50


def test_what_only_this_project_refuses_is_one_of_its_own_rules(verdicts):
    unexplained = sorted({launch for *_, launch, _, megatron in verdicts
                          if launch is not None and megatron is None
                          and not any(rule in launch for rule in OWN_RULES)})
    assert not unexplained, "\n".join(unexplained[:5])


@pytest.mark.parametrize("config, overrides, message", [
    ("ppo_tiny", ["parallel.cp=2"], "parallel.cp=2: PPO's critic (a value head at every position) does not support "
                                    "context parallelism yet; set parallel.cp=1"),
    ("grpo_tiny", ["model.name=tiny-cpu-deepseek-v3", "parallel.auto=false", "parallel.cp=2"],
     "parallel.cp=2: tiny-cpu-deepseek-v3's multi-latent attention with context parallelism needs Transformer "
     "Engine"),
    ("grpo_tiny", ["model.name=tiny-cpu-moe", "generation.cuda_graphs=true"],
     "generation.cuda_graphs=true: an MoE model's token dispatch sizes its exchanges on the host"),
    ("grpo_tiny", ["parallel.auto=false", "parallel.pp=2", "generation.cuda_graphs=true"],
     "generation.cuda_graphs=true with a 2-stage rollout: decode graphs are captured for one stage only"),
])
def test_layouts_the_job_cannot_run_are_refused_at_launch_in_one_line(launch, tmp_path, config, overrides, message):
    result = launch("--config", config, *overrides, f"run.dir={tmp_path / 'run'}", "--dry-run", timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "run").exists()
