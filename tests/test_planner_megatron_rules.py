"""The planner's pipeline-split legality agrees with Megatron-Core's own TransformerConfig checks.

Run: .venv/bin/python -m pytest tests/test_planner_megatron_rules.py -q   (imports megatron-core: ~6 s)
Megatron-Core validates uneven (first/last stage) and embedding/loss-accounted splits in TransformerConfig;
the even-split rule (num_layers % pp) lives in megatron/training, which is not installed, so it is not compared.
"""

import itertools
import warnings

import pytest

from megatron_rl.spec.parallel import split_error, virtual_stage_layers

torch = pytest.importorskip("torch")
tc = pytest.importorskip("megatron.core.transformer.transformer_config")


def _megatron_accepts(num_layers, pp, vpp, first, last, emb, loss) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tc.TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                 pipeline_model_parallel_size=pp, pipeline_dtype=torch.bfloat16,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                 num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                 account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
        except (ValueError, AssertionError):
            return False
    return True


CASES = []
for layers, pp, vpp in itertools.product((61, 94, 96, 126, 128), (2, 3, 4, 8, 12, 16), (1, 2, 3, 4, 8)):
    CASES += [(layers, pp, vpp, None, None, emb, loss) for emb, loss in ((True, True), (False, True), (True, False))]
    k = -(-layers // pp)
    for first, last in ((k - 1, k - 2), (4, 1), (3, 2), (k, None), (None, k - 2), (8, 8)):
        CASES.append((layers, pp, vpp, first, last, False, False))


def test_split_legality_matches_megatron_core():
    mismatches = []
    for case in CASES:
        layers, pp, vpp, first, last, emb, loss = case
        ours = split_error(layers, pp, vpp, first, last, emb, loss) is None
        if ours != _megatron_accepts(*case):
            mismatches.append((case, split_error(*case[:3], *case[3:])))
    assert not mismatches, mismatches[:5]
    assert sum(split_error(*c) is None for c in CASES) > 30  # the grid has legal cases too


def test_layer_counts_match_megatron_core():
    """Our per-virtual-stage layer counts equal Megatron-Core's get_num_layers_to_build for legal splits."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        pytest.skip("parallel_state not importable")
    checked = 0
    for layers, pp, vpp, first, last, emb, loss in CASES[::7]:
        if split_error(layers, pp, vpp, first, last, emb, loss) is not None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = tc.TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                                       pipeline_model_parallel_size=pp, pipeline_dtype=torch.bfloat16,
                                       virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                       num_layers_in_first_pipeline_stage=first,
                                       num_layers_in_last_pipeline_stage=last,
                                       account_for_embedding_in_pipeline_split=emb,
                                       account_for_loss_in_pipeline_split=loss)
        ours = virtual_stage_layers(layers, pp, vpp, first, last, emb, loss)
        for rank in (0, pp // 2, pp - 1):
            for chunk in range(vpp):
                try:
                    theirs = get_num_layers_to_build(cfg, vp_stage=chunk, pp_rank=rank)
                except TypeError:
                    pytest.skip("get_num_layers_to_build signature differs in this megatron-core")
                assert ours[chunk * pp + rank] == theirs, (layers, pp, vpp, first, last, emb, loss, rank, chunk)
                checked += 1
    assert checked > 20
    assert ps is not None
