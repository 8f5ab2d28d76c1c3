"""ParallelDims without a process group: Megatron's sizing rules, the pipeline split, the checks per model.

Run: ``.venv/bin/python -m pytest tests/test_parallel_dims.py -q``
The pipeline-split rules are compared with Megatron-Core's TransformerConfig in test_planner_megatron_rules.py;
here the world-size rules are compared with Megatron's own rank-group arithmetic (``RankGenerator``, which
``initialize_model_parallel`` builds for the dense and the expert layers).
"""

from __future__ import annotations

import itertools

import pytest

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import load_model_shape
from megatron_rl.spec.parallel import ParallelDims

parallel_state = pytest.importorskip("megatron.core.parallel_state")


def _megatron_groups(world, tp, pp, cp, ep, etp):
    """Megatron's rank groups for this layout, or None where its divisibility checks refuse it."""
    if world % (tp * pp * cp) or world % (etp * ep * pp):
        return None  # initialize_model_parallel raises "world_size (...) is not divisible by ..."
    dense = parallel_state.RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = parallel_state.RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1,
                                          order="tp-ep-dp-pp")
    return dense, expert


@pytest.mark.parametrize("world, tp, pp, cp, ep, etp", [
    c for c in itertools.product((8, 12, 16, 64), (1, 2, 4, 8), (1, 2, 4), (1, 2), (1, 2, 4, 8), (1, 2))])
def test_world_size_rules_match_megatron_rank_groups(world, tp, pp, cp, ep, etp):
    groups = _megatron_groups(world, tp, pp, cp, ep, etp)
    if groups is None:
        with pytest.raises(ConfigError, match=r"parallel\.(tp\*pp\*cp|pp\*etp\*ep) = .* does not divide the world size"):
            ParallelDims(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        return
    dims = ParallelDims(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    dense, expert = groups
    assert len(dense.get_ranks("dp")) * dims.dp == world and len(dense.get_ranks("dp")[0]) == dims.dp
    assert len(expert.get_ranks("dp")[0]) == dims.edp
    assert dims.pp * dims.tp * dims.cp * dims.dp == world == dims.pp * dims.etp * dims.ep * dims.edp


def test_expert_tensor_parallel_defaults_follow_ep():
    assert ParallelDims(world_size=8, tp=2, ep=1).etp == 2
    assert ParallelDims(world_size=8, tp=2, ep=4).etp == 1
    assert ParallelDims(world_size=8, tp=2, ep=2, etp=2).edp == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=0), "parallel.tp=0 must be a positive integer"),
    (dict(sp=True), "sequence_parallel=true needs parallel.tp > 1"),
    (dict(vpp=2), "parallel.vpp=2 needs parallel.pp > 1"),
    (dict(tp=3), r"parallel.tp\*pp\*cp = 3\*1\*1 = 3 does not divide the world size 8"),
    (dict(ep=16), r"parallel.pp\*etp\*ep = 1\*1\*16 = 16 does not divide the world size 8"),
])
def test_bad_sizes_name_the_key(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelDims(world_size=8, **kwargs)


@pytest.mark.parametrize("layers, pp, vpp, first, last, stages", [
    (5, 2, 1, 3, 2, (3, 2)),
    (126, 16, 1, 7, 7, (7,) + (8,) * 14 + (7,)),
    (94, 16, 1, 4, 0, None),  # 94 = 14x6 + 10: first/last 5 each
    (61, 8, 1, None, None, None),
    (8, 2, 2, None, None, (2, 2, 2, 2)),  # even: no split chosen
])
def test_uneven_split_is_chosen_when_layers_do_not_divide(layers, pp, vpp, first, last, stages):
    dims = ParallelDims(world_size=pp, pp=pp, vpp=vpp).with_split(layers)
    counts = dims.stage_layers(layers)
    assert sum(counts) == layers
    if stages is not None:
        assert (dims.first_stage_layers, dims.last_stage_layers) == ((first, last) if first else (None, None))
        assert counts == stages
    per_rank = [sum(counts[r::pp]) for r in range(pp)]
    assert max(per_rank) - min(per_rank) <= 2  # close to balanced
    dims.check_model(_shape_with_layers(layers))


def test_a_given_split_is_kept_and_checked():
    dims = ParallelDims(world_size=2, pp=2, first_stage_layers=1).with_split(5)
    assert dims.stage_layers(5) == (1, 4)
    with pytest.raises(ConfigError, match=r"pipeline split .* 5 layers over parallel.pp=2 is not legal"):
        ParallelDims(world_size=2, pp=2, first_stage_layers=5).check_model(_shape_with_layers(5))
    with pytest.raises(ConfigError, match="not divisible by pp=2"):
        ParallelDims(world_size=2, pp=2).check_model(_shape_with_layers(5))


def test_model_checks_name_the_key():
    dense, moe = load_model_shape("tiny-cpu"), load_model_shape("tiny-cpu-moe")
    with pytest.raises(ConfigError, match="parallel.tp=8 does not divide the .* attention heads"):
        ParallelDims(world_size=8, tp=8).check_model(dense)
    with pytest.raises(ConfigError, match="has no experts"):
        ParallelDims(world_size=2, ep=2).check_model(dense)
    with pytest.raises(ConfigError, match="need parallel.sequence_parallel=true"):
        ParallelDims(world_size=2, tp=2).check_model(moe)
    with pytest.raises(ConfigError, match=r"parallel.ep=8 does not divide the \d+ experts"):
        ParallelDims(world_size=8, ep=8).check_model(moe)
    with pytest.raises(ConfigError, match="parallel.etp=1 with parallel.ep=1 at tp=2"):
        ParallelDims(world_size=2, tp=2, etp=1, sp=True).check_model(moe)
    ParallelDims(world_size=4, tp=2, ep=2, sp=True).check_model(moe)
    ParallelDims(world_size=2, tp=2, sp=True).check_model(moe)  # etp defaults to tp without EP


def _shape_with_layers(num_layers):
    import dataclasses

    return dataclasses.replace(load_model_shape("tiny-cpu"), num_layers=num_layers)


@pytest.mark.parametrize("sizes, multiple", [
    (dict(), 1), (dict(tp=2, sp=True), 2), (dict(cp=2), 4), (dict(tp=2, cp=2, sp=True), 4),
    (dict(tp=4, cp=2, sp=True), 8), (dict(tp=2, cp=2), 4),
])
def test_sequence_multiple(sizes, multiple):
    """Megatron splits sequences into 2*cp chunks, and under SP each CP rank's part over the tp ranks."""
    assert ParallelDims(world_size=8, **sizes).sequence_multiple == multiple
