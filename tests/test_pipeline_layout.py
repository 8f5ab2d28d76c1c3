"""Pipeline layouts in Megatron's syntax (megatron_rl/spec/pipeline_layout.py) against Megatron Core's own parser and
validator, and the keys that carry them (parallel.pipeline_layout, ParallelDims, the planner's search).

Run: ``.venv/bin/python -m pytest tests/test_pipeline_layout.py -q``
"""

from __future__ import annotations

import itertools
import random

import pytest

from launcher.planner.search import balanced_layout, pipeline_splits
from megatron_rl.spec.config import load_config
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import load_model_shape
from megatron_rl.spec.parallel import ParallelDims, split_error
from megatron_rl.spec.pipeline_layout import (
    LayoutSyntaxError,
    expand_layout,
    format_layout,
    layout_error,
    layout_from_counts,
    megatron_layout,
    stage_decoder_counts,
)

PUBLISHED = {  # layout: (pp, decoder layers, MTP layers)
    "Et*3|(tt|)*29,m|L": (8, 61, 1),     # Megatron's docs: DeepSeek-V3 at PP16 x VPP2 (32 stages; PP8 x VPP4 alike)
    "Et|(tt|)*30mL": (8, 61, 1),         # Megatron-Bridge's DeepSeek-V3 H100 pretraining recipe, PP8 x VPP4
    "Et*4|(t*4|)*14,tmL": (16, 61, 1),   # Megatron-Bridge's DeepSeek-V3 map at PP16 (vpp 1)
    "Et*8|(t*8|)*6,t*5mL": (8, 61, 1),   # ... at PP8 (vpp 1)
    "E|(t|)*126,L": (16, 126, 0),        # Llama-3.1-405B at PP16 x VPP8, embedding and loss as stages
}


def _megatron():
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    return LayerType, PipelineParallelLayerLayout


def _as_chars(stages) -> tuple[str, ...]:
    LayerType, _ = _megatron()
    char = {LayerType.embedding: "E", LayerType.decoder: "t", LayerType.mtp: "m", LayerType.loss: "L"}
    return tuple("".join(char[layer] for layer in stage) for stage in stages)


@pytest.mark.parametrize("text", [*PUBLISHED, "E|ttt|t|tL", "Et, t|(t|)*2,tL", "(Et|)*1,tL"])
def test_our_reading_of_a_layout_is_megatrons(text):
    _, Layout = _megatron()
    assert expand_layout(text) == _as_chars(Layout.parse_str_to_list(text.replace(" ", "")))


@pytest.mark.parametrize("text", list(PUBLISHED))
def test_published_layouts_pass_our_check_and_megatrons(text):
    pp, layers, mtp = PUBLISHED[text]
    stages = expand_layout(text)
    assert layout_error(stages, num_layers=layers, pp=pp, vpp=None, mtp_layers=mtp) is None
    _, Layout = _megatron()
    Layout(text, pp).validate_layer_layout(num_layers=layers, mtp_num_layers=mtp or None)
    # what the builder passes (MTP not built) is legal for Megatron without MTP layers, with the same decoder layers
    built = Layout(megatron_layout(stages), pp)
    built.validate_layer_layout(num_layers=layers, mtp_num_layers=None)
    for rank, chunk in itertools.product(range(pp), range(len(stages) // pp)):
        LayerType, _ = _megatron()
        assert built.layout[rank][chunk].count(LayerType.decoder) == stage_decoder_counts(stages)[chunk * pp + rank]


@pytest.mark.parametrize("text, pp, layers, why", [
    ("tE|tL", 2, 2, "embedding E must open the first stage"),
    ("Et|Lt", 2, 2, "loss L must close the last stage"),
    ("Et|tt|L", 2, 3, "not a multiple of pp=2"),
    ("Et|tL", 2, 3, "it has 2 decoder layers"),
    ("EtL|tL", 2, 2, "loss L must close the last stage, once"),
    ("Em|tL", 2, 1, "MTP layers (m) must come after every decoder layer"),
])
def test_bad_layouts_are_refused_by_us_and_by_megatron(text, pp, layers, why):
    stages = expand_layout(text)
    assert why in layout_error(stages, num_layers=layers, pp=pp, vpp=None, mtp_layers=text.count("m"))
    _, Layout = _megatron()
    with pytest.raises(AssertionError):
        Layout(text, pp).validate_layer_layout(num_layers=layers, mtp_num_layers=text.count("m") or None)


def test_unreadable_text_is_named():
    with pytest.raises(LayoutSyntaxError, match="'x' is not a layer"):
        expand_layout("Etx|L")
    with pytest.raises(LayoutSyntaxError, match="empty"):
        expand_layout(" , ")


def test_the_short_form_reads_back_to_the_same_stages():
    rng = random.Random(0)
    for _ in range(300):
        counts = tuple(rng.choice((0, 1, 2, 2, 3, 8)) for _ in range(rng.randint(1, 40)))
        stages = layout_from_counts(counts)
        short = format_layout(stages)
        assert expand_layout(short) == stages, (counts, short)
        assert len(short) <= len("|".join(stages))
    assert format_layout(expand_layout("Ettt|tt|tt|tt|L")) == "Et*3|(tt|)*3,L"


def test_the_split_keys_and_a_layout_give_the_same_counts():
    """A first/last or embedding/loss split, written as a layout, is the same split."""
    for layers, pp, vpp, split in [(126, 16, 1, (None, None, True, True)), (126, 16, 8, (None, None, True, True)),
                                   (61, 8, 1, (8, 5, False, False)), (5, 2, 1, (3, 2, False, False))]:
        dims = ParallelDims(world_size=pp, pp=pp, vpp=vpp, first_stage_layers=split[0], last_stage_layers=split[1],
                            account_for_embedding=split[2], account_for_loss=split[3])
        text = format_layout(layout_from_counts(dims.stage_layers(layers)))
        as_layout = ParallelDims(world_size=pp, pp=pp, vpp=vpp, pipeline_layout=text)
        assert as_layout.stage_layers(layers) == dims.stage_layers(layers)
        assert split_error(layers, pp, vpp, *as_layout.split()) is None


def test_the_config_key_takes_vpp_from_the_layout_and_refuses_what_megatron_would():
    cfg = load_config(None, ["parallel.pp=2", "parallel.pipeline_layout=E|ttt|t|tL", "cluster.tasks_per_node=2"])
    dims = ParallelDims.from_config(cfg.parallel, world_size=2)
    assert dims.vpp == 2 and dims.stage_layers(5) == (0, 3, 1, 1)
    for overrides, why in [
        (["parallel.pipeline_layout=Etx|L"], r"parallel.pipeline_layout=Etx\|L: 'x' is not a layer"),
        (["parallel.pp=2", "parallel.pipeline_layout=Et|tL", "parallel.first_stage_layers=1"],
         "cannot be combined with parallel.first_stage_layers"),
        (["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layout=Et|tL"],
         r"has 2 stages, not pp\*vpp = 2\*2"),
        (["parallel.pp=4", "parallel.pipeline_layout=Et|tL"], r"has 2 stages, not pp\*vpp = 4\*1"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config(None, overrides)
    shape = load_model_shape("tiny-cpu")  # 2 layers
    with pytest.raises(ConfigError, match=r"does not fit tiny-cpu \(2 layers\) at pp=2: it has 3 decoder layers"):
        ParallelDims(world_size=2, pp=2, pipeline_layout="Et|ttL").check_model(shape)


def test_the_search_offers_layouts_where_no_other_split_reaches():
    """61 layers: no first/last split interleaves (61 is odd), so at pp 8 every vpp above 1 comes from layouts,
    balanced over the ranks with the embedding and loss weighed as layers."""
    cands = pipeline_splits(61, 8, None, {})
    classic = {c[4] for c in cands if c[5] is None and split_error(61, 8, c[4], *c[:4]) is None}
    layouts = [c for c in cands if c[5] is not None]
    assert classic == {1} and {c[4] for c in layouts} == {2, 4}  # 8 x 8 = 64 stages exceed 61 layers + 2
    for *_, vpp, text in layouts:
        stages = expand_layout(text)
        assert split_error(61, 8, vpp, None, None, False, False, text) is None
        per_rank = [sum(stage.count("t") for stage in stages[r::8]) for r in range(8)]
        assert max(per_rank[1:-1]) - min(per_rank[1:-1]) <= 1 and max(per_rank) - min(per_rank) <= 3, (text, per_rank)
    assert balanced_layout(126, 16, 8, 1, 1) == "E|(t|)*126,L"  # NVIDIA's 405B PP16 x VPP8 split
    # a given layout is the only candidate; a given first/last split adds none
    assert pipeline_splits(61, 8, None, {"pipeline_layout": "Et|(tt|)*30mL"}) == [
        (None, None, False, False, 4, "Et|(tt|)*30mL")]
    assert all(c[5] is None for c in pipeline_splits(61, 8, None, {"first_stage_layers": 8}))
