"""Pipeline layouts in Megatron's syntax (``TransformerConfig.pipeline_model_parallel_layout``), pure Python.

A layout lists the layers of every virtual pipeline stage, in stage order (stage i runs on pipeline rank i mod pp
as its virtual chunk i // pp), stages separated by ``|``: ``E`` the embedding, ``t`` a decoder layer, ``m`` a
multi-token-prediction layer, ``L`` the output layer and loss; ``x*n`` repeats one character, ``(...)*n`` a group,
commas are cosmetic. NVIDIA's DeepSeek-V3 layout at PP8 x VPP4 (32 stages, 61 decoder layers):

    Et*3|(tt|)*29,m|L   ->  Ettt | tt x 29 | m | L

Megatron's rules (``PipelineParallelLayerLayout.validate_layer_layout``): the stages are a multiple of pp (vpp =
stages / pp); ``E`` opens the first stage and ``L`` closes the last, once each; the decoder layers number the model's;
MTP layers come after every decoder layer. This project builds no MTP layers (conversion drops them), so ``m`` is
accepted where a published layout has it and left out of what the model builder passes to Megatron.

Check it: ``.venv/bin/python -m pytest tests/test_pipeline_layout.py -q``
"""

from __future__ import annotations

import re
from functools import lru_cache

LAYER_CHARS = "ELtm"
"""What a stage may hold: embedding, loss (with the output layer), decoder layer, MTP layer."""


class LayoutSyntaxError(ValueError):
    """A layout string Megatron's parser would not read; the message says what is wrong."""


@lru_cache(maxsize=256)
def expand_layout(text: str) -> tuple[str, ...]:
    """The stages of a layout string, each a string of LAYER_CHARS ('Et*3|(tt|)*2,L' -> ('Ettt', 'tt', 'tt', 'L')),
    read as Megatron reads it (groups ``(...)*n`` unrolled first, then ``x*n``); whitespace and commas are ignored."""
    flat = re.sub(r"[\s,]", "", str(text))
    if not flat:
        raise LayoutSyntaxError("it is empty")
    flat = re.sub(r"\(([^()]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
    flat = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
    bad = sorted(set(flat) - set(LAYER_CHARS) - {"|"})
    if bad:
        raise LayoutSyntaxError(f"'{''.join(bad)}' is not a layer (use E, t, m, L, '|' between stages, x*n and "
                                "(...)*n to repeat)")
    return tuple(flat.split("|"))


def format_layout(stages: tuple[str, ...]) -> str:
    """The short form of ``stages`` (runs of a character as x*n, runs of equal stages as (..|)*n), which
    ``expand_layout`` reads back to the same stages."""
    def short(stage: str) -> str:
        return "".join(c if len(run) == 1 else f"{c}*{len(run)}" if len(run) > 2 else run
                       for run, c in ((m.group(0), m.group(1)) for m in re.finditer(r"(.)\1*", stage)))

    groups: list[tuple[str, int]] = []
    for stage in stages:
        if groups and groups[-1][0] == stage:
            groups[-1] = (stage, groups[-1][1] + 1)
        else:
            groups.append((stage, 1))
    parts = []
    for i, (stage, count) in enumerate(groups):
        last = i == len(groups) - 1
        repeat = count - 1 if last else count  # a group's trailing '|' needs a stage after it
        plain = "|".join([short(stage)] * count) + ("" if last else "|")
        grouped = f"({short(stage)}|)*{repeat}," + (short(stage) if last else "")
        parts.append(grouped if repeat >= 2 and stage and len(grouped) < len(plain) else plain)
    return "".join(parts)


def layout_from_counts(counts: tuple[int, ...]) -> tuple[str, ...]:
    """The stages of a split given as decoder layers per virtual stage (``ParallelDims.stage_layers``): the
    embedding opens the first, the loss closes the last."""
    stages = ["t" * n for n in counts]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return tuple(stages)


def layout_error(stages: tuple[str, ...], *, num_layers: int, pp: int, vpp: int | None,
                 mtp_layers: int | None = None) -> str | None:
    """Why Megatron refuses ``stages`` for a model of ``num_layers`` decoder layers at ``pp`` (x ``vpp``, None: any),
    or None when it is legal; ``mtp_layers`` (None: not checked) is the model's MTP layer count."""
    if len(stages) % pp:
        return f"its {len(stages)} stages are not a multiple of pp={pp} (a stage per pipeline rank and virtual chunk)"
    if vpp is not None and len(stages) != pp * vpp:
        return (f"its {len(stages)} stages are not pp*vpp = {pp}*{vpp}; give {pp * vpp} stages, or leave vpp "
                f"null (it is stages / pp)")
    flat = "".join(stages)
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        return "the embedding E must open the first stage, once"
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        return "the loss L must close the last stage, once"
    if flat.count("t") != num_layers:
        return f"it has {flat.count('t')} decoder layers (t), the model {num_layers}"
    mtp = flat.count("m")
    if mtp and mtp_layers is not None and mtp != mtp_layers:
        return f"it has {mtp} MTP layers (m), the model {mtp_layers}; drop them or give {mtp_layers}"
    if mtp and "t" in flat[flat.index("m"):]:
        return "MTP layers (m) must come after every decoder layer"
    return None


def stage_decoder_counts(stages: tuple[str, ...]) -> tuple[int, ...]:
    """Decoder layers of each virtual stage, in stage order."""
    return tuple(stage.count("t") for stage in stages)


def megatron_layout(stages: tuple[str, ...]) -> str:
    """``stages`` as the string ``TransformerConfig.pipeline_model_parallel_layout`` takes, without the MTP layers
    (not built here)."""
    return "|".join(stage.replace("m", "") for stage in stages)
