"""Scale layouts train exactly like the plain layout (real Megatron Core through launch.py, gloo, CPU).

Each run is its own launch.py subprocess (Megatron's parallel state is process-global). Same seed, same global
batch: the weights do not depend on the layout (``layout_invariant_init`` seeds every layer by its global number
and every routed expert by its global index), so per-step losses and grad norms must agree with one process.

The weights do not depend on the device either: the builder draws them on the CPU everywhere (builder.CPU_INIT),
checked in a plain process.

Measured differences on CPU are ~3e-8 (loss) and ~1.3e-7 (grad norm). The tolerances below still catch what
they guard against: experts initialised per EP rank (step-1 loss off by 1e-2), or sequence-parallel norm
weights whose grads are not all-reduced over TP (grad norm off by ~1e-4 relative).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import read_metrics

STEPS = 3
SHORT = ["--config", "configs/pretrain_tiny.yaml", "cluster.executor=local", "logging.console=quiet",
         "logging.tensorboard=false", f"run.steps={STEPS}", "algorithm.global_batch_size=4",
         "parallel.micro_batch_size=1", "model.seq_length=32"]
MOE = "model.name=tiny-cpu-moe"
SP = "parallel.sequence_parallel=true"


def _run(launch, run_dir, *extra):
    result = launch(*SHORT, f"run.dir={run_dir}", *extra, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = [m for m in read_metrics(run_dir) if m.get("phase") is None and "loss" in m]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    return metrics


def _assert_same_training(plain, other):
    assert other[0]["loss"] == pytest.approx(plain[0]["loss"], abs=1e-5)  # before any update
    for a, b in zip(plain, other, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]


@pytest.fixture(scope="module")
def plain_moe(tmp_path_factory):
    from helpers import run_launch

    return _run(run_launch, tmp_path_factory.mktemp("plain_moe"), MOE, "cluster.tasks_per_node=1")


@pytest.fixture(scope="module")
def plain_dense(tmp_path_factory):
    from helpers import run_launch

    return _run(run_launch, tmp_path_factory.mktemp("plain_dense"), "cluster.tasks_per_node=1")


def test_moe_ep2_at_dp2_matches_plain(launch, tmp_path, plain_moe):
    """EP2 on 2 processes (tp=1: dense dp=2, expert dp=1): each rank holds half of the experts."""
    _assert_same_training(plain_moe, _run(launch, tmp_path / "run", MOE, "parallel.ep=2"))


def test_moe_ep2_at_dp4_matches_plain(launch, tmp_path, plain_moe):
    """EP2 on 4 processes (tp=1: dense dp=4, expert dp=2): world = pp*tp*cp*dp = pp*etp*ep*edp."""
    _assert_same_training(plain_moe, _run(launch, tmp_path / "run", MOE, "parallel.ep=2",
                                          "cluster.tasks_per_node=4"))


@pytest.mark.parametrize("layout", [["parallel.etp=2"], ["parallel.etp=2", "parallel.ep=2", "cluster.tasks_per_node=4"]],
                         ids=["ep1", "ep2-dp2"])
def test_moe_tp2_sp_with_experts_split_over_tp_matches_plain(launch, tmp_path, plain_moe, layout):
    """MoE at TP2 with SP and the experts themselves split over the TP ranks (etp = tp = 2), with and without EP;
    etp=1 (experts whole on each rank) at TP2·EP2 is test_moe_tp2_ep2_sp_with_the_load_balancing_loss_matches_plain."""
    _assert_same_training(plain_moe, _run(launch, tmp_path / "run", MOE, "parallel.tp=2", SP, *layout))


def test_dense_tp2_sp_matches_plain(launch, tmp_path, plain_dense):
    """Dense TP2 with sequence parallelism (2 processes, dp=1)."""
    _assert_same_training(plain_dense, _run(launch, tmp_path / "run", "parallel.tp=2", SP))


def test_sequence_parallel_lengths():
    """Under SP the sequence splits over TP ranks: SFT pads to a multiple of tp, pretrain refuses a length that
    does not divide (Megatron would assert inside scatter_to_sequence_parallel_region)."""
    from megatron_rl.spec.config import load_config
    from megatron_rl.spec.config.validate import check_layout
    from megatron_rl.spec.errors import ConfigError
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.data.sft import sft_seq_length

    examples = [([1] * 15, [1] * 15), ([1] * 4, [1] * 4)]
    assert sft_seq_length(examples) == 15 and sft_seq_length(examples, multiple=2) == 16
    cfg = load_config("pretrain_tiny", ["parallel.tp=2", SP, "model.seq_length=63"])
    with pytest.raises(ConfigError, match="model.seq_length=63 is not a multiple of 2"):
        check_layout(cfg, load_model_shape(cfg.model.name))
    cfg = load_config("pretrain_tiny", ["parallel.cp=2", "model.seq_length=34"])
    with pytest.raises(ConfigError, match="model.seq_length=34 is not a multiple of 4"):
        check_layout(cfg, load_model_shape(cfg.model.name))
    moe = load_config("pretrain_tiny", [MOE, "parallel.tp=2", "parallel.ep=2", SP])
    assert check_layout(moe, load_model_shape(moe.model.name)) == 1  # MoE at tp > 1 is no longer refused


def test_dense_cp2_matches_plain(launch, tmp_path, plain_dense):
    """Context parallelism on 2 processes (dp=1): each rank holds 2 of the 4 sequence chunks in Megatron's
    load-balanced order; the local-spec CP attention all-gathers K/V (megatron_rl/models/cp_attention.py)."""
    _assert_same_training(plain_dense, _run(launch, tmp_path / "run", "parallel.cp=2"))


def test_moe_tp2_ep2_sp_with_the_load_balancing_loss_matches_plain(launch, tmp_path, plain_moe):
    """TP2 x EP2 with sequence parallelism on 2 processes (dp = edp = 1) trains as one process: SP norms (input,
    pre-MLP, QK, final) and the router see sequence shards, experts live on two EP ranks; and the router's aux
    loss with them: each rank routes 1/(tp*cp) of the sequence under SP, which Megatron's per-token scaling of the
    aux loss accounts for (from 0.19; the builder made up for 0.16.1, see builder.aux_loss_coeff). The layout
    without the aux loss is tests/test_grpo_layouts.py's moe_tp2_ep2_sp run and tests/test_deepseek_v3.py's."""
    aux = [MOE, "model.moe_load_balancing=aux_loss", "model.moe_aux_loss_coeff=0.1"]
    plain = _run(launch, tmp_path / "plain", *aux, "cluster.tasks_per_node=1")
    _assert_same_training(plain, _run(launch, tmp_path / "sharded", *aux, "parallel.tp=2", "parallel.ep=2", SP))
    assert plain[0]["loss"] == pytest.approx(plain_moe[0]["loss"], abs=1e-6)  # it adds no LM loss...
    assert plain[0]["grad_norm"] != pytest.approx(plain_moe[0]["grad_norm"], rel=1e-4)  # ...but a gradient


SAME_SEED_ON_EACH_DEVICE = """
import datetime, json, sys
from unittest import mock
import torch
from megatron_rl.runtime import cpu_compat
cpu_compat.apply()
from megatron.core import parallel_state, tensor_parallel
from megatron_rl.models import builder
from megatron_rl.spec.model_shape import load_model_shape
from megatron_rl.spec.ports import free_port

torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                     timeout=datetime.timedelta(seconds=60))
parallel_state.initialize_model_parallel()
cpu_config = builder.transformer_config

def gpu_config(*args, **kwargs):  # the config a process with a GPU makes
    with mock.patch("torch.cuda.is_available", return_value=True):
        return cpu_config(*args, **kwargs)

def build(preset, config):
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # Megatron's RNG trackers, as initialize() seeds them
    with mock.patch.object(builder, "transformer_config", config):
        model = builder.build_gpt_model(load_model_shape(preset), builder.ModelOptions(init_seed=5))
    dispatchers = {type(m.token_dispatcher).__name__ for m in model.modules() if hasattr(m, "token_dispatcher")}
    return model.state_dict(), sorted(dispatchers)

result = {}
for preset in sys.argv[1:]:
    (on_cpu, cpu_dispatchers), (on_gpu, gpu_dispatchers) = build(preset, cpu_config), build(preset, gpu_config)
    result[preset] = {"weights_differ": [name for name, value in on_cpu.items()
                                         if isinstance(value, torch.Tensor) and not torch.equal(value, on_gpu[name])],
                      "dispatchers": {"cpu": cpu_dispatchers, "gpu": gpu_dispatchers}}
print(json.dumps(result))
"""


def test_a_process_with_a_gpu_builds_the_model_a_cpu_process_builds():
    """The model a process with a GPU configures (``torch.cuda.is_available`` patched True while the builder makes
    the TransformerConfig) has the weights of the one a CPU process builds from the same ``init_seed``, dense and
    MoE (router and experts too), and the same MoE token dispatcher, the all-to-all one (which the EP tests here
    run over gloo): one process, the CPU redirections standing in for CUDA. Megatron's GPU init would draw every
    TP slice from its CUDA RNG tracker instead."""
    presets = ["tiny-cpu", "tiny-cpu-moe"]
    result = subprocess.run([sys.executable, "-c", SAME_SEED_ON_EACH_DEVICE, *presets], capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    built = json.loads(result.stdout.splitlines()[-1])
    assert built["tiny-cpu"] == {"weights_differ": [], "dispatchers": {"cpu": [], "gpu": []}}
    moe_dispatcher = ["MoEAlltoAllTokenDispatcher"]
    assert built["tiny-cpu-moe"] == {"weights_differ": [],
                                     "dispatchers": {"cpu": moe_dispatcher, "gpu": moe_dispatcher}}
