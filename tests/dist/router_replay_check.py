"""Router replay at the MoE training layouts; every rank writes ``OUT/rank{R}.json`` for
tests/test_router_replay.py.

Run: ``.venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/router_replay_check.py --layouts
tp2_ep2_sp,ep2_dp2,pp2,cp2 --out DIR`` (``ep2_dp2``: EP across two DP replicas; ``--layouts pp2_ep2_dp2`` on 4
ranks); ``OUT/rank{R}.json`` maps each layout to its results.

Forward hooks on every router see what the layers really did: the router's input (so its logits) and the
routing map it returned. Each local router row is mapped back to its sequence and position by the test's own
arithmetic: rows are sequence-major, a sequence-parallel rank holds the tp-th part of this CP rank's positions,
the model's position ids give the position, and the tokens at those positions name the sequence.

1. Recording: generation's recorded experts are those the training forward at the layout chooses (free routing),
   wherever the k-th and (k+1)-th router logits are more than 1e-5 apart. The generation is multi-turn (turns.py
   ``TurnEnded``): turns of 3 tokens, and on the first rollout worker every other row's first turn gets a 2-token
   reply, fed onto its blocks, and a second turn; so the replies' positions are recorded too, and where experts
   span the workers the other one runs out of rows first and steps on padding alone.
2. Replay: with the router weights perturbed, free routing disagrees with the recording; a forward of the
   collated rollout (``collate_rollout``, the GRPO trainer's path) routes every recorded position by the
   recording and every padding position freely.
3. Training: a GRPO step with replay, without and with full activation recompute (which re-runs the routers in
   the backward pass, with several micro-batches in flight under PP): the same loss and gradient norm, every
   forward routed by the recording, and the recompute calls routed as their forwards were.
"""

from __future__ import annotations

import argparse

import torch

PROMPT_LENGTHS = (5, 9, 3, 7, 6, 4, 11, 24, 2, 8, 5, 3, 10, 6, 4, 24)  # 8 per worker; the 24s outlive the rest
TURN_TOKENS = 3
REPLY = (7, 8)
NEW_TOKENS = 2 * TURN_TOKENS + len(REPLY)
TIE_GAP = 1e-5


class RouterProbe:
    """Hooks on each chunk (position ids and tokens of the forward) and on each of its routers (routing)."""

    def __init__(self, chunks, tp_rank: int, tp: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.tp_rank, self.tp = tp_rank, tp
        self.calls: list[dict] = []
        self.current = None
        self.handles = []
        for chunk in chunks:
            self.handles.append(chunk.register_forward_pre_hook(self._on_model, with_kwargs=True))
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    self.handles.append(module.register_forward_hook(self._on_router))

    def _on_model(self, module, args, kwargs):
        self.current = (args[0].detach().cpu(), args[1].detach().cpu())

    def _on_router(self, router, args, output):
        from megatron.core.tensor_parallel.random import is_checkpointing

        with torch.no_grad():
            logits = router.gating(args[0]).reshape(-1, router.config.num_moe_experts).float().cpu()
        sp = router.config.sequence_parallel
        self.calls.append({"slot": router.router_replay.slot, "map": output[1].detach().cpu().clone(),
                           "logits": logits, "topk": router.topk, "sp": sp,
                           "recompute": is_checkpointing() and torch.is_grad_enabled(),
                           "model_input": self.current})

    def local_positions(self, call) -> list[tuple[int, int]]:
        """(batch index, index into this CP rank's sequence) of each router row of ``call``."""
        tokens, _ = call["model_input"]
        batch, s_cp = tokens.shape
        rows = call["map"].size(0)
        s_local = rows // batch
        offset = self.tp_rank * s_local if call["sp"] and self.tp > 1 else 0
        return [(j % batch, offset + j // batch) for j in range(rows)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def row_of(full_tokens: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, recorded: list) -> int:
    """The sequence whose tokens at ``positions`` are ``tokens``. Several match only where these positions are
    padding for each of them (a context-parallel chunk past their ends): then they are all past their recordings
    there, and route freely whichever is named."""
    matches = [r for r in range(full_tokens.size(0))
               if torch.equal(full_tokens[r, positions], tokens) and full_tokens[r, positions].numel()]
    assert matches and all(bool((positions >= recorded[r].size(0)).all()) for r in matches[1:]), matches
    if len(matches) > 1:
        assert bool((positions >= recorded[matches[0]].size(0)).all()), matches
    return matches[0]


def compare(probe: RouterProbe, calls: list[dict], full_tokens: torch.Tensor, recorded: list[torch.Tensor]) -> dict:
    """Per router row of forward ``calls``: the experts it used against the recording (recorded positions) or
    against free top-k of its logits (the others)."""
    counts = {"compared": 0, "mismatch": 0, "near_ties": 0, "free_compared": 0, "free_mismatch": 0}
    for call in calls:
        tokens, positions = call["model_input"]
        rows = {b: row_of(full_tokens, tokens[b], positions[b], recorded) for b in range(tokens.size(0))}
        used = call["map"]
        logits = call["logits"]
        k = call["topk"]
        for j, (b, s) in enumerate(probe.local_positions(call)):
            r, pos = rows[b], int(positions[b, s])
            top = torch.topk(logits[j], k + 1).values
            near_tie = float(top[k - 1] - top[k]) <= TIE_GAP
            chosen = set(torch.nonzero(used[j]).flatten().tolist())
            if pos < recorded[r].size(0):
                if near_tie:
                    counts["near_ties"] += 1
                    continue
                counts["compared"] += 1
                counts["mismatch"] += chosen != set(recorded[r][pos, call["slot"]].tolist())
            elif not near_tie:
                counts["free_compared"] += 1
                counts["free_mismatch"] += chosen != set(torch.topk(logits[j], k).indices.tolist())
    return counts


LAYOUTS = {"tp2_ep2_sp": dict(tp=2, ep=2, sp=True), "ep2_dp2": dict(ep=2), "pp2": dict(pp=2), "cp2": dict(cp=2),
           "pp2_ep2_dp2": dict(pp=2, ep=2)}
"""The layouts checked, one after another in the same processes (Megatron's parallel state made again):
``pp2_ep2_dp2`` on 4 ranks (the pipelined decode's parts in lockstep over the two replicas that share
experts), the others on 2."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True, help="comma-separated names of LAYOUTS")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    from dist_common import write_rank_result

    write_rank_result(args.out, {name: check_layout(**LAYOUTS[name]) for name in args.layouts.split(",")})


def check_layout(*, tp: int = 1, ep: int = 1, pp: int = 1, cp: int = 1, sp: bool = False) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.algorithms.policy_loss import GRPOLossConfig
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.rl.loss import REPORTS, make_grpo_loss
    from megatron_rl.rollout.batch import RolloutRow, collate_rollout
    from megatron_rl.models import unwrap
    from megatron_rl.runtime.training import (data_parallel_share, data_parallel_slice, forward_logprobs, gather_data_parallel, logits_forward)
    from megatron_rl.trainers.common import job_engine
    from dist_common import progression_trainer, start_layout

    model = "tiny-cpu-moe"

    def config(recompute: str):
        return load_config(overrides=[
            f"model.name={model}", f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.pp={pp}",
            f"parallel.cp={cp}", f"parallel.sequence_parallel={str(sp).lower()}", f"parallel.recompute={recompute}",
            "algorithm.router_replay=true", "algorithm.kl_coef=0", "parallel.micro_batch_size=1",
            "algorithm.global_batch_size=4", "run.seed=7", "optimizer.lr=0.01"])

    cfg = config("none")
    start_layout(tp=tp, ep=ep, pp=pp, cp=cp, sp=sp, seed=cfg.run.seed)
    shape = load_model_shape(model)
    engine = job_engine(cfg, shape, total_steps=10)
    recomputing_engine = job_engine(config("full"), shape, total_steps=10)

    chunks = [unwrap(c) for c in engine.chunks]
    train_step = progression_trainer(engine, micro_batch_size=1)
    for step in (1, 2):
        train_step(step)
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    result: dict = {"tp_rank": tp_rank, "pp_rank": ps.get_pipeline_model_parallel_rank()}

    # 1. generation records, the training forward agrees
    gen = torch.Generator().manual_seed(2025)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    mine = data_parallel_share(prompts, with_context_parallel=True)
    replied = set()
    replying = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    result["replying"] = replying

    def turn_ended(index: int, turn: list, finish: str):
        if replying and index % 2 and index not in replied:
            replied.add(index)
            return list(REPLY)
        return None

    # the engine admits 2 rows at a time: later rows join as earlier ones finish
    rollout_config = EngineConfig(vocab_size=shape.vocab_size, max_new_tokens=NEW_TOKENS, temperature=1.0,
                                  record_routes=True, max_concurrent=2, max_turn_tokens=TURN_TOKENS)
    out = generate(engine.chunks, mine, rollout_config, seed=3 + ps.get_data_parallel_rank(with_context_parallel=True),
                   turn_ended=turn_ended)
    result["replies_fed"] = sum(mask == [1] * TURN_TOKENS + [0] * len(REPLY) + [1] * TURN_TOKENS
                                for mask in out.policy_mask)
    result["sampled_tokens"] = sum(map(sum, out.policy_mask))
    every = gather_data_parallel(list(zip(mine, out.tokens, out.logprobs, out.routes)), with_context_parallel=True)
    assert all(route.size(0) == len(p) + len(t) - 1 for p, t, _, route in every)
    rows = [RolloutRow(prompt_ids=p, response_ids=t, logprobs=lp, advantage=(-1.0) ** i, routes=route)
            for i, (p, t, lp, route) in enumerate(every)]
    recorded = [row.routes for row in rows]
    seq_length = -(-(max(len(p) + len(t) for p, t, _, _ in every) - 1) // engine.sequence_multiple) \
        * engine.sequence_multiple
    whole = collate_rollout(rows, seq_length=seq_length, pad_id=0)
    full_tokens = torch.cat([whole["tokens"], whole["labels"][:, -1:]], dim=1)
    free_batch = {key: whole[key] for key in ("tokens", "labels", "position_ids")}

    probe = RouterProbe(chunks, tp_rank, tp)
    forward_logprobs(engine.chunks, [free_batch], seq_length=seq_length)
    result["recording"] = compare(probe, probe.calls, full_tokens, recorded)
    result["recorded_slots"] = int(recorded[0].size(1))
    result["recorded_positions"] = sum(int(route.size(0)) for route in recorded)
    result["rows"], result["forward_passes"] = len(mine), out.forward_passes

    # 2. perturbed routers: free routing now differs, replay follows the recording
    from megatron.core.transformer.moe.router import TopKRouter

    noise = torch.Generator().manual_seed(99)
    for c in chunks:
        for module in c.modules():
            if isinstance(module, TopKRouter):
                module.weight.data += 0.5 * torch.randn(module.weight.shape, generator=noise)
    probe.calls.clear()
    forward_logprobs(engine.chunks, [free_batch], seq_length=seq_length)
    result["perturbed_free"] = compare(probe, probe.calls, full_tokens, recorded)
    probe.calls.clear()
    forward_logprobs(engine.chunks, [whole], seq_length=seq_length)
    result["replayed"] = compare(probe, probe.calls, full_tokens, recorded)
    probe.remove()

    # 3. a GRPO step with replay, without and with full recompute (same weights, same micro-batches)
    for copy, chunk in zip(recomputing_engine.chunks, engine.chunks):
        unwrap(copy).load_state_dict(unwrap(chunk).state_dict())
    loss_fn = make_grpo_loss(GRPOLossConfig.from_algorithm(cfg.algorithm, max_response_len=NEW_TOKENS))
    result["training"] = {}
    for name, eng in (("plain", engine), ("recompute", recomputing_engine)):
        micro = [collate_rollout(mb, seq_length=seq_length, pad_id=0)
                 for mb in data_parallel_slice(rows, micro_batch_size=1)]
        probe = RouterProbe([unwrap(c) for c in eng.chunks], tp_rank, tp)
        metrics = eng.train_step(micro, loss_fn, seq_length=seq_length, report_names=REPORTS,
                                 forward_fn=logits_forward)
        probe.remove()
        forwards = [c for c in probe.calls if not c["recompute"]]
        recomputes = [c for c in probe.calls if c["recompute"]]
        same_as_forward = all(
            torch.equal(f["map"], r["map"])
            for slot in {c["slot"] for c in probe.calls}
            for f, r in zip([c for c in forwards if c["slot"] == slot], [c for c in recomputes if c["slot"] == slot]))
        result["training"][name] = {
            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "microbatches": len(micro),
            "forward": compare(probe, forwards, full_tokens, recorded), "forward_calls": len(forwards),
            "recompute_calls": len(recomputes), "recompute_routed_as_forward": same_as_forward}
    result["replay_state_released"] = all(
        r.target_topk_idx is None and not r.replay_backward_list and r.router_replay_action is None
        for eng in (engine, recomputing_engine) for c in eng.chunks
        for r in __import__("megatron_rl.models.router_replay", fromlist=["routers"]).routers(c))
    return result


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
