"""Colocated generation at the training layouts that split sequences or experts (SP, CP, EP); every rank writes
``OUT/rank{R}.json`` for tests/test_grpo_layouts.py.

Run: ``.venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/gen_layouts.py --out DIR``
(``--layouts cp2,moe_ep2_dp2``: some of LAYOUTS; in ``moe_ep2_dp2`` the experts span two data-parallel replicas,
which must decode in lockstep). ``OUT/rank{R}.json`` maps each layout to its results.

At each layout in turn, the engine is ``build_engine`` at the layout, trained for two steps. Each rollout worker (DP x CP rank) then
generates for its own prompts, of lengths chosen so that the workers' prefill lengths and step counts differ.
Every worker's sequences are gathered, and the training forward at the same layout (SP and CP on,
``sequence_logprobs``) scores all of them on every rank: its log-probs must equal generation's. Then the
switched flags must be back and a training step must run.
"""

from __future__ import annotations

import argparse
import math

import torch

PROMPT_LENGTHS = (5, 9, 3, 7, 6, 4, 11, 2)  # worker 0 of 2: prefill 3, longest 9; worker 1: prefill 2, longest 11
NEW_TOKENS = 6


def prompts_of_all_workers() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2025)
    return [torch.randint(3, 100, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def flags(chunks) -> dict:
    """What generation switches, as the training layout has it."""
    from megatron_rl.generation.layout import _configs

    configs = _configs(chunks)
    linear = [m.sequence_parallel for c in chunks for m in c.modules()
              if isinstance(m.__dict__.get("sequence_parallel"), bool)]
    return {"config_sp": sorted({c.sequence_parallel for c in configs}),
            "config_cp": sorted({c.context_parallel_size for c in configs}),
            "linear_sp": sorted(set(linear)),
            "cp_attention": sorted({m.cp_size for c in chunks for m in c.modules() if hasattr(m, "cp_size")})}


LAYOUTS = {"cp2": dict(cp=2), "tp2_sp": dict(tp=2, sp=True),
           "moe_tp2_ep2_sp": dict(model="tiny-cpu-moe", tp=2, ep=2, sp=True),
           "moe_tp2_etp2_sp": dict(model="tiny-cpu-moe", tp=2, sp=True),  # experts split by TP
           "moe_ep2_dp2": dict(model="tiny-cpu-moe", ep=2)}
"""The layouts checked, one after another in the same two processes (Megatron's parallel state made again)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    from dist_common import write_rank_result

    write_rank_result(args.out, {name: check_layout(**LAYOUTS[name]) for name in args.layouts.split(",")})


def check_layout(*, model: str = "tiny-cpu", tp: int = 1, ep: int = 1, cp: int = 1, sp: bool = False) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.models import unwrap
    from megatron_rl.runtime.training import data_parallel_share, gather_data_parallel, sequence_logprobs
    from megatron_rl.trainers.common import job_engine
    from dist_common import progression_trainer, start_layout

    cfg = load_config(overrides=[f"model.name={model}", f"parallel.tp={tp}", f"parallel.ep={ep}",
                                 f"parallel.cp={cp}", f"parallel.sequence_parallel={str(sp).lower()}",
                                 "algorithm.name=pretrain", "parallel.micro_batch_size=1",
                                 "algorithm.global_batch_size=4", "run.seed=7", "optimizer.lr=0.01"])
    start_layout(tp=tp, ep=ep, cp=cp, sp=sp, seed=cfg.run.seed)
    shape = load_model_shape(model)
    engine = job_engine(cfg, shape, total_steps=10)
    chunks = [unwrap(c) for c in engine.chunks]
    vocab = shape.vocab_size

    train_step = progression_trainer(engine, micro_batch_size=cfg.parallel.micro_batch_size)
    for step in (1, 2):
        train_step(step)
    before = flags(chunks)

    mine = data_parallel_share(prompts_of_all_workers(), with_context_parallel=True)
    result: dict = {"workers": ps.get_data_parallel_world_size(with_context_parallel=True),
                    "worker": ps.get_data_parallel_rank(with_context_parallel=True), "prompts": mine,
                    "flags_before": before}
    runs = {"greedy": (dict(temperature=0.0), None),  # name: (EngineConfig settings, seed)
            "sampled": (dict(temperature=1.0), 11 + result["worker"]),
            "eos": (dict(temperature=1.0, eos_id=mine[0][-1]), 5 + result["worker"])}
    multiple = engine.sequence_multiple
    # GRPO-style groups: worker 0 has 2 distinct prompts, worker 1 has 4 (8 rows each); an EP lockstep makes both
    # prefill 4 rows, otherwise each prefills its own distinct ones
    distinct = prompts_of_all_workers()[:2] if result["worker"] == 0 else prompts_of_all_workers()[2:6]
    grouped = [p for p in distinct for _ in range(8 // len(distinct))]
    inputs = {name: mine for name in runs}
    runs["grouped"], inputs["grouped"] = (dict(temperature=0.0), None), grouped
    for name, (settings, seed) in runs.items():
        config = EngineConfig(vocab_size=vocab, max_new_tokens=NEW_TOKENS, **settings)
        out = generate(engine.chunks, inputs[name], config, seed=seed)
        mine_now = inputs[name]
        every = gather_data_parallel([(p, t, lp) for p, t, lp in zip(mine_now, out.tokens, out.logprobs)],
                                     with_context_parallel=True)
        width = max(len(p) + len(t) for p, t, _ in every)
        width = 1 + -(-(width - 1) // multiple) * multiple  # the training forward's length: a multiple again
        tokens = torch.tensor([p + t + [0] * (width - len(p) - len(t)) for p, t, _ in every])
        full = sequence_logprobs(engine.chunks, tokens)
        diff = max((abs(full[b, len(p) - 1 + i].item() - x) for b, (p, t, lp) in enumerate(every)
                    for i, x in enumerate(lp)), default=0.0)
        result[name] = {"tokens": out.tokens, "lengths": out.lengths, "finish_reasons": out.finish_reasons,
                        "forward_passes": out.forward_passes,
                        "decode_attention": out.decode_attention, "max_logprob_diff": diff,
                        "prefill_rows": out.prefill_rows,
                        "rows_checked": len(every)}
    result["flags_after"] = flags(chunks)
    after = train_step(3)
    result["train_after_generation"] = {"loss": after["loss"], "finite": math.isfinite(after["loss"])}
    return result


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
