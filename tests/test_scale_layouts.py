"""Scale layouts train exactly like the plain layout (real Megatron Core through launch.py, gloo, CPU).

Each run is its own launch.py subprocess (Megatron's parallel state is process-global). Same seed, same global
batch: the weights do not depend on the layout (``layout_invariant_init`` seeds every layer by its global number
and every routed expert by its global index), so per-step losses and grad norms must agree with one process.

Measured differences on CPU are ~3e-8 (loss) and ~1.3e-7 (grad norm). The tolerances below still catch what
they guard against: experts initialised per EP rank (step-1 loss off by 1e-2), or sequence-parallel norm
weights whose grads are not all-reduced over TP (grad norm off by ~1e-4 relative).
"""

from __future__ import annotations

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
    from megatron_rl.trainers.sft import sft_seq_length

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
