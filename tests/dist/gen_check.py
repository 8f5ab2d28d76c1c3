"""Colocated generation checks on a real Megatron engine; every rank writes ``OUT/rank{R}.json`` for the test.

Run: ``.venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/gen_check.py --layouts tp1_dp2,tp2
--out DIR`` (LAYOUTS: ``tp1_dp2`` is data parallel, each DP rank taking every other prompt; ``pp2_vpp2`` a
pipeline; ``mla_moe_tp1`` on one process); ``OUT/rank{R}.json`` maps each layout to its results.

The engine is ``build_engine`` (DDP chunks + optimizer) trained for two steps on the pretrain task; then
greedy and sampled generation, the independent references (recomputation without a cache, the training
forward's log-probs through ``sequence_logprobs`` and through the model's own loss), stop tokens, and the
optimizer/grad offload round trip. The test (tests/test_generation.py) compares the numbers.
"""

from __future__ import annotations

import argparse
import time

import torch

VOCAB_LOW, VOCAB_HIGH = 3, 100
PROMPT_LENGTHS = (5, 9, 3, 7, 9, 4)
NEW_TOKENS = 8


def fixed_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2024)
    return [torch.randint(VOCAB_LOW, VOCAB_HIGH, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def recompute_greedy(model, prompt: list[int], steps: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by a full forward of the whole sequence at every step (no KV cache)."""
    seq, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.tensor([seq])
            logits = model(ids, torch.arange(len(seq)).unsqueeze(0), None, runtime_gather_output=True)[0, -1].float()
            token = int(logits[:vocab_size].argmax())
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            seq.append(token)
    return seq[len(prompt):], logprobs


def full_forward_reference(chunks, prompts: list[list[int]], responses: list[list[int]], vocab_size: int):
    """One training-style forward (Megatron's forward-only schedule, any TP/PP/VPP, no cache) of the final
    sequences. A causal model's logits at position j depend only on tokens <= j, so this recomputes every
    decoding step at once: per response token, the greedy choice and the log-prob of the token generated."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = padded(prompts, responses)
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    # the interleaved (virtual pipeline) schedule wants at least pp micro-batches
    micro = ps.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1
    mbs = batch // micro

    def stash(logits):
        return logits.sum() * 0.0, {"logits": logits.float()}

    def step(data, model):
        i = next(data)
        rows = slice(i * mbs, (i + 1) * mbs)
        return model(tokens[rows], positions[rows], None, runtime_gather_output=True), stash

    with torch.no_grad():
        for chunk in chunks:
            chunk.eval()
        data = [iter(range(micro)) for _ in chunks] if len(chunks) > 1 else iter(range(micro))
        reports = get_forward_backward_func()(
            forward_step_func=step, data_iterator=data, model=chunks, num_microbatches=micro, seq_length=seq,
            micro_batch_size=mbs, forward_only=True)
        for chunk in chunks:
            chunk.train()
    packed = torch.zeros((2, batch, seq - 1), dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        logits = torch.cat([r["logits"] for r in reports])[:, :-1]
        packed[0] = logits[..., :vocab_size].argmax(-1).double()
        packed[1] = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1).double()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(packed, src=ps.get_pipeline_model_parallel_last_rank(),
                                    group=ps.get_pipeline_model_parallel_group())
    lengths = [len(r) for r in responses]
    return ([[int(x) for x in row] for row in response_slice(packed[0], prompts, lengths)],
            response_slice(packed[1].float(), prompts, lengths))


def _with_sequence_parallel(chunks, call):
    from megatron_rl.models import unwrap

    config = unwrap(chunks[0]).config
    config.sequence_parallel = True
    try:
        return call()
    finally:
        config.sequence_parallel = False


def padded(prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0) -> torch.Tensor:
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])


def response_slice(full: torch.Tensor, prompts: list[list[int]], lengths: list[int]) -> list[list[float]]:
    """Log-probs of the response tokens out of ``[B, S-1]`` next-token log-probs."""
    return [full[b, len(p) - 1:len(p) - 1 + n].tolist() for b, (p, n) in enumerate(zip(prompts, lengths))]


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)), default=0.0)


class LazyBuffer:
    """A buffer a module makes at its first forward and updates in place at every training forward, as Transformer
    Engine keeps some: hooked on just before a generation, it is made there, and the next training step updates
    it. Made under ``torch.inference_mode`` it would be an inference tensor, which that update refuses."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.buffer, self.updates, self.error = None, 0, None
        module.register_forward_hook(self._forward)

    def _forward(self, module, args, output) -> None:
        if self.buffer is None:
            self.buffer = torch.zeros(1)
        elif module.training:
            try:
                self.buffer.add_(1)
                self.updates += 1
            except RuntimeError as exc:
                self.error = str(exc)

    def result(self) -> dict:
        made = self.buffer is not None
        return {"made": made, "inference_tensor": made and self.buffer.is_inference(),
                "training_updates": self.updates, "error": self.error}


class WaveFeed:
    """A session's feed (megatron_rl.generation.feed.Feed) of ``prompts``, grouped as runs of equal prompts: two
    groups at the first question, then one per question (asked every STOP_POLL_STEPS steps while rows decode), as
    the async rollout worker's orders come in while earlier rows still decode; it ends the session once every
    group was handed out and nothing decodes. ``done``: request -> (tokens, log-probs, finish reason)."""

    def __init__(self, prompts: list[list[int]], seed: int) -> None:
        from megatron_rl.generation.feed import FedPrompt

        self.pending, start = [], 0
        while start < len(prompts):
            end = start
            while end < len(prompts) and prompts[end] == prompts[start]:
                end += 1
            self.pending.append(FedPrompt(tokens=tuple(prompts[start]), completions=end - start, seed=seed,
                                          first_request=start))
            start = end
        self.done: dict[int, tuple] = {}
        self.questions = self.graph_steps = 0

    def more(self, generating: bool, counters: dict) -> list:
        from megatron_rl.generation import GenerationStopped

        self.questions += 1
        self.graph_steps = counters["graph_steps"]
        if not self.pending and not generating:
            raise GenerationStopped("every fed prompt has ended")
        take = 2 if self.questions == 1 else 1
        handed, self.pending = self.pending[:take], self.pending[take:]
        return handed

    def finished(self, done) -> None:
        for j, row in enumerate(zip(done.responses, done.logprobs, done.finish_reasons)):
            self.done[done.prompt.first_request + j] = row


def fed_session(chunks, prompts: list[list[int]], config, *, seed: int) -> WaveFeed:
    """``prompts`` decoded under ``config`` by a session fed by a WaveFeed (what generate's caller gets is in
    ``feed.done``)."""
    from megatron_rl.generation import GenerationStopped, generate

    feed = WaveFeed(prompts, seed)
    try:
        generate(chunks, [], config, seed=seed, feed=feed)
    except GenerationStopped:
        pass
    assert len(feed.done) == len(prompts), (len(feed.done), len(prompts))
    return feed


def multi_turn_check(chunks, prompts: list[list[int]], vocab: int) -> dict:
    """Two sampled turns of 4 tokens with a scripted 3-token reply between them (turns.py ``TurnEnded``), in
    groups of 2 and 4-token blocks: the policy mask; the policy tokens' log-probs against the training forward of the
    whole conversation; each turn against a single-turn ``generate`` of the conversation so far (same seed: a
    row's draws depend on its place and position only), which the reply fed onto the row's own blocks must
    equal; and the tokens the engine fed (each once: no prefill of the conversation again)."""
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.runtime.training import sequence_logprobs

    reply, turn_tokens, seed = [7, 8, 9], 4, 23
    rows = [p for p in prompts for _ in range(2)]
    calls = []

    def turn_ended(index, turn, finish):
        calls.append((index, list(turn), finish))
        return list(reply) if sum(1 for i, *_ in calls if i == index) == 1 else None

    config = EngineConfig(vocab_size=vocab, max_new_tokens=20, temperature=0.9, kv_block_tokens=4,
                          max_turn_tokens=turn_tokens)
    out = generate(chunks, rows, config, seed=seed, turn_ended=turn_ended)
    result = _overlapped(chunks, rows, out, config, seed=seed, reply=reply)
    one_turn = EngineConfig(vocab_size=vocab, max_new_tokens=turn_tokens, temperature=0.9, kv_block_tokens=4)
    first = generate(chunks, rows, one_turn, seed=seed)
    second = generate(chunks, [r + t[:turn_tokens] + reply for r, t in zip(rows, out.tokens)], one_turn, seed=seed)
    full = sequence_logprobs(chunks, padded(rows, out.tokens))
    whole = response_slice(full, rows, out.lengths)
    policy = lambda values: [[v for v, m in zip(row, mask) if m] for row, mask in zip(values, out.policy_mask)]  # noqa: E731
    return {"policy_mask": out.policy_mask, "calls": calls, "finish_reasons": out.finish_reasons,
            "first_turn_equal": [t[:turn_tokens] for t in out.tokens] == first.tokens,
            "second_turn_equal": [t[turn_tokens + len(reply):] for t in out.tokens] == second.tokens,
            "reply_in_place": all(t[turn_tokens:turn_tokens + len(reply)] == reply for t in out.tokens),
            "reply_logprobs": [v for row, mask in zip(out.logprobs, out.policy_mask) for v, m in zip(row, mask)
                               if not m],
            "vs_sequence_logprobs": max_abs_diff(policy(out.logprobs), policy(whole)),
            "fed_tokens": out.fed_tokens, **result,
            "fed_once": sum(len(r) + len(t) - 1 for r, t in zip(rows, out.tokens)) - sum(len(p) for p in prompts)}


def _overlapped(chunks, rows: list, out, config, *, seed: int, reply: list) -> dict:
    """``multi_turn_check``'s replies made in threads, each after its own delay, while the other rows decode
    (engine.py: a row waits for its future; the last row's reply comes last of all), through the multi-turn
    rollout's ``StepThreads``: at tp or pp > 1 the replica's first rank runs them and the ranks agree at each step
    which came (``settle``). The same episodes."""
    import random
    import time

    from megatron_rl.generation import generate
    from megatron_rl.rollout.multi_turn import StepThreads, model_parallel_share

    late, delays = [], random.Random(5)
    steps = StepThreads(4, model_parallel_share()[0])

    def slow_turn_ended(index, turn, finish):
        wait = 0.3 if index == len(rows) - 1 else delays.uniform(0.0, 0.05)
        return steps.run(lambda: (time.sleep(wait), late.append(index),
                                  list(reply) if late.count(index) == 1 else None)[2])

    try:
        overlapped = generate(chunks, rows, config, seed=seed, turn_ended=slow_turn_ended,
                              settle_replies=steps.settle if steps.share is not None else None)
    finally:
        steps.close()
    return {"overlapped_equal": (overlapped.tokens == out.tokens and overlapped.policy_mask == out.policy_mask
                                 and overlapped.finish_reasons == out.finish_reasons),
            "overlapped_logprob_diff": max_abs_diff(overlapped.logprobs, out.logprobs)}


LAYOUTS = {"tp1_dp2": ["--tp", "1"], "tp2": ["--tp", "2", "--attention", "unfused"],
           "pp2_vpp2": ["--pp", "2", "--vpp", "2", "--layers", "4"],
           "mla_moe_tp1": ["--model", "tiny-cpu-deepseek-v3"]}
"""Named layouts (``--layouts``), checked one after another in the same processes (Megatron's parallel state made
again); ``mla_moe_tp1`` runs on one process, the others on two."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True, help="comma-separated names of LAYOUTS")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    from dist_common import write_rank_result

    write_rank_result(args.out, {name: check(layout_options(LAYOUTS[name])) for name in args.layouts.split(",")})


def layout_options(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None, help="override the tiny model's layer count")
    parser.add_argument("--model", default="tiny-cpu", help="model preset (tiny-cpu, tiny-cpu-moe, tiny-cpu-deepseek-v3)")
    parser.add_argument("--attention", default="auto", help="runtime.attention of the trained layers")
    return parser.parse_args(argv)


def check(args: argparse.Namespace) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.generation import EngineConfig, generate
    from megatron_rl.runtime.training import sequence_logprobs
    from megatron_rl.runtime.phases import generation_phase, grad_buffer_tensors, optimizer_tensors
    from megatron_rl.models import unwrap
    from megatron_rl.trainers.common import job_engine
    from dist_common import progression_trainer, start_layout

    import dataclasses

    cfg = load_config(overrides=[f"parallel.tp={args.tp}", f"parallel.pp={args.pp}",
                                 f"parallel.vpp={args.vpp or 'null'}",
                                 "algorithm.name=pretrain", "parallel.micro_batch_size=1",
                                 "algorithm.global_batch_size=4", "run.seed=7", "optimizer.lr=0.01",
                                 f"runtime.attention={args.attention}"])
    start_layout(tp=args.tp, pp=args.pp, vpp=args.vpp or 1, seed=cfg.run.seed)
    shape = load_model_shape(args.model)
    if args.layers:
        shape = dataclasses.replace(shape, num_layers=args.layers)
    engine = job_engine(cfg, shape, total_steps=10)
    vocab = shape.vocab_size

    train_step = progression_trainer(engine, micro_batch_size=cfg.parallel.micro_batch_size)
    for step in (1, 2):
        train_step(step)

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    prompts = fixed_prompts()[dp_rank::dp]
    result: dict = {"model": args.model, "tp": args.tp, "pp": args.pp, "vpp": args.vpp, "layers": shape.num_layers,
                    "dp": dp, "dp_rank": dp_rank, "prompts": prompts}
    chunks = engine.chunks

    lazy = LazyBuffer(unwrap(chunks[0]))  # made in the next generate, updated by the last training step
    started = time.perf_counter()
    greedy_config = EngineConfig(vocab_size=vocab, max_new_tokens=NEW_TOKENS, temperature=0.0)
    greedy = generate(chunks, prompts, greedy_config)
    result["greedy_seconds"] = time.perf_counter() - started
    result["greedy"] = {"tokens": greedy.tokens, "logprobs": greedy.logprobs, "lengths": greedy.lengths,
                        "finish_reasons": greedy.finish_reasons, "forward_passes": greedy.forward_passes,
                        "kv_cache_bytes": greedy.kv_cache_bytes, "decode_attention": greedy.decode_attention}

    argmax_tokens, full_lp = full_forward_reference(chunks, prompts, greedy.tokens, vocab)
    result["full_forward_argmax"] = argmax_tokens
    result["greedy_vs_full_forward_logprobs"] = max_abs_diff(greedy.logprobs, full_lp)

    # Training-forward log-probs of the same tokens (the GRPO old/ref log-probs path).
    full = sequence_logprobs(chunks, padded(prompts, greedy.tokens))
    result["greedy_vs_sequence_logprobs"] = max_abs_diff(greedy.logprobs,
                                                         response_slice(full, prompts, greedy.lengths))

    if args.pp == 1:
        model = unwrap(chunks[0])
        model.eval()
        reference = [recompute_greedy(model, p, NEW_TOKENS, vocab) for p in prompts]
        result["recomputed_tokens"] = [r[0] for r in reference]
        result["greedy_vs_recomputed_logprobs"] = max_abs_diff(greedy.logprobs, [r[1] for r in reference])
        tokens = padded(prompts, greedy.tokens)
        with torch.no_grad():
            nll = model(tokens[:, :-1], torch.arange(tokens.shape[1] - 1).unsqueeze(0).expand(len(prompts), -1),
                        None, labels=tokens[:, 1:])
        result["greedy_vs_loss_path"] = max_abs_diff(greedy.logprobs,
                                                     response_slice(-nll.float(), prompts, greedy.lengths))
        model.train()

    sampled = generate(chunks, prompts, dataclasses.replace(greedy_config, temperature=0.8, top_k=20, top_p=0.9),
                       seed=11)
    result["sampled"] = {"tokens": sampled.tokens, "logprobs": sampled.logprobs,
                         "sampling_logprobs": sampled.sampling_logprobs}
    full = sequence_logprobs(chunks, padded(prompts, sampled.tokens))
    result["sampled_vs_sequence_logprobs"] = max_abs_diff(sampled.logprobs,
                                                          response_slice(full, prompts, sampled.lengths))

    # GRPO-style groups (each prompt 4 times, two prompts with the same 3-token start, two long prompts) with
    # 4-token blocks: the unbounded pool (every row's blocks at its longest; each group's prompt prefilled once)
    # against every row prefilled on its own, a cap of 5 rows, KV budgets of 10 and 24 blocks (rows wait, are
    # evicted and prefilled again) and, under PP, 1 and 3 pipeline parts instead of pp: the tokens, finish reasons
    # and log-probs must not move (each row's draws depend on its request and position only); greedy, sampled
    # with top-k/top-p and with a stop token; and the training forward's log-probs of the unbounded run.
    long_prompts = [[(7 * i) % 90 + 5 for i in range(30)], [(7 * i) % 90 + 5 for i in range(30)][::-1]]
    grouped = [p for p in prompts for _ in range(4)] + [prompts[0][:3] + [7, 8], prompts[0][:3] + [9], *long_prompts]
    parts = args.pp  # under PP the engine decodes in pp parts, each with its share of the budget
    graphs = args.pp == 1 and not unwrap(chunks[0]).config.num_moe_experts  # where generation.cuda_graphs runs
    result["paged"] = {"parts": parts, "distinct_prompts": len({tuple(p) for p in grouped}), "rows": len(grouped)}
    for name, seed, settings in (("greedy", 0, dict(temperature=0.0)),
                                 ("sampled", 5, dict(temperature=0.8, top_k=20, top_p=0.9)),
                                 ("greedy_eos", 0, dict(temperature=0.0, eos_id=greedy.tokens[0][2]))):
        config = EngineConfig(vocab_size=vocab, max_new_tokens=NEW_TOKENS, kv_block_tokens=4, **settings)
        run = lambda **more: generate(chunks, grouped, dataclasses.replace(config, **more), seed=seed)  # noqa: E731
        unbounded = run()
        block_bytes = unbounded.kv_cache_bytes // sum(-(-(len(p) + NEW_TOKENS) // 4) for p in grouped)
        variants = {"unshared": run(share_prefill=False), "capped": run(max_concurrent=5),
                    **{f"budget_{blocks}": run(kv_memory_gib=blocks * parts * block_bytes / 2**30)
                       for blocks in (10, 24)}}
        if args.pp > 1:
            variants.update({f"parts_{n}": run(pipeline_microbatches=n) for n in (1, 3)})
        if graphs:  # decode steps padded to row buckets on fixed buffers (what a GPU replays from CUDA graphs),
            # under the budget that evicts
            variants.update(graphs_budget_10=run(cuda_graphs=True, kv_memory_gib=10 * block_bytes / 2**30))
        # the fed session (the async worker's engine) runs with decode graphs where the layout has them
        fed = fed_session(chunks, grouped, dataclasses.replace(config, kv_memory_gib=24 * parts * block_bytes / 2**30,
                                                               cuda_graphs=graphs), seed=seed)
        fed_rows = [fed.done[i] for i in range(len(grouped))]
        full = sequence_logprobs(chunks, padded(grouped, unbounded.tokens))
        summary = lambda out: {"evictions": out.evictions, "prefill_rows": out.prefill_rows,  # noqa: E731
                               "peak_blocks": out.kv_peak_blocks, "pool_bytes": out.kv_cache_bytes,
                               "forward_passes": out.forward_passes, "graph_steps": out.decode_graph_steps}
        result["paged"][name] = {
            "block_bytes": block_bytes, "stopped": unbounded.finish_reasons.count("stop"),
            "vs_sequence_logprobs": max_abs_diff(unbounded.logprobs, response_slice(full, grouped, unbounded.lengths)),
            "unbounded": summary(unbounded),
            **{variant: {**summary(out), "tokens_equal": out.tokens == unbounded.tokens,
                         "finish_reasons_equal": out.finish_reasons == unbounded.finish_reasons,
                         "logprob_diff": max_abs_diff(out.logprobs, unbounded.logprobs),
                         "sampling_logprob_diff": max_abs_diff(out.sampling_logprobs, unbounded.sampling_logprobs)}
               for variant, out in variants.items()},
            "fed": {"tokens_equal": [list(r[0]) for r in fed_rows] == unbounded.tokens,
                    "finish_reasons_equal": [r[2] for r in fed_rows] == unbounded.finish_reasons,
                    "logprob_diff": max_abs_diff([r[1] for r in fed_rows], unbounded.logprobs),
                    "questions": fed.questions, "graph_steps": fed.graph_steps}}

    result["multi_turn"] = multi_turn_check(chunks, prompts, vocab)

    # Stop token: row 0's third greedy token as eos; stop sequence: row 1's tokens 2..3.
    eos = greedy.tokens[0][2]
    stop_seq = greedy.tokens[1][1:3]
    stopped = generate(chunks, prompts, dataclasses.replace(greedy_config, eos_id=eos, stop_sequences=[stop_seq]))
    result["stops"] = {"eos": eos, "stop_sequence": stop_seq, "tokens": stopped.tokens,
                       "lengths": stopped.lengths, "finish_reasons": stopped.finish_reasons,
                       "logprobs": stopped.logprobs}

    # A stop at the first stop question (after STOP_POLL_STEPS steps, rows still decoding): the call is abandoned on
    # every rank, and the next one decodes as before (under PP no choice of the abandoned call is left in flight).
    from megatron_rl.generation import GenerationStopped
    from megatron_rl.generation.engine import STOP_POLL_STEPS

    try:
        generate(chunks, prompts, dataclasses.replace(greedy_config, max_new_tokens=3 * STOP_POLL_STEPS),
                 stop_requested=lambda generating: (True, True))
        result["stopped"] = "not stopped"
    except GenerationStopped as stopped:
        result["stopped"] = str(stopped)
    result["after_stop_equal"] = generate(chunks, prompts, greedy_config).tokens == greedy.tokens

    # Clear errors for what generation does not support or cannot do.
    errors = {}
    two_tokens = EngineConfig(vocab_size=vocab, max_new_tokens=2)
    too_long = EngineConfig(vocab_size=vocab, max_new_tokens=shape.max_position_embeddings)
    for name, call in {
        "empty_prompt": lambda: generate(chunks, [[]], two_tokens),
        "token_out_of_vocab": lambda: generate(chunks, [[vocab]], two_tokens),
        "too_long": lambda: generate(chunks, [[5]], too_long),
        "cuda_graphs": lambda: generate(chunks, [[5]], dataclasses.replace(two_tokens, cuda_graphs=True)),
    }.items():
        try:
            call()
            errors[name] = "no error"
        except (ValueError, NotImplementedError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    result["errors"] = errors
    # A config with sequence parallelism on: generation switches it off for the call, and back on.
    sp_tokens, sp_flag = _with_sequence_parallel(chunks, lambda: (generate(chunks, prompts, greedy_config).tokens,
                                                                  unwrap(chunks[0]).config.sequence_parallel))
    result["sequence_parallel_config"] = {"tokens_equal": sp_tokens == greedy.tokens, "flag_after_generate": sp_flag}

    # Offload round trip inside a generation phase; weights must be untouched by generation.
    weights = [p.detach().clone() for c in chunks for p in unwrap(c).parameters()]
    opt_before = [t.detach().clone() for t in optimizer_tensors(engine.optimizer)]
    grads_before = [t.detach().clone() for t in grad_buffer_tensors(chunks)]
    with generation_phase(engine, offload_optimizer=True, keep_grads=True) as parked:
        freed = [t.untyped_storage().nbytes() == 0 for t in optimizer_tensors(engine.optimizer)]
        grads_freed = [t.untyped_storage().nbytes() == 0 for t in grad_buffer_tensors(chunks)]
        inside = generate(chunks, prompts, greedy_config)
        eval_inside = all(not unwrap(c).training for c in chunks)
    result["offload"] = {
        "bytes_freed": parked.device_bytes_freed, "bytes_moved": parked.bytes_moved,
        "grad_buffers": len(grads_freed), "grad_buffers_freed": sum(grads_freed),
        "optimizer_tensors": len(opt_before), "optimizer_tensors_freed": sum(freed),
        "optimizer_exact": all(torch.equal(a, b) for a, b in zip(opt_before, optimizer_tensors(engine.optimizer),
                                                                 strict=True)),
        "grads_exact": all(torch.equal(a, b) for a, b in zip(grads_before, grad_buffer_tensors(chunks), strict=True)),
        "grads_nonzero_before": any(bool(g.abs().sum() > 0) for g in grads_before),
        "tokens_equal_inside_phase": inside.tokens == greedy.tokens, "eval_inside": eval_inside,
        "train_mode_after": all(unwrap(c).training for c in chunks)}
    with generation_phase(engine, offload_optimizer=True, keep_grads=False):
        pass
    result["offload"]["grads_zero_without_keep"] = all(bool((t == 0).all()) for t in grad_buffer_tensors(chunks))
    result["weights_untouched"] = all(torch.equal(a, p) for a, p in
                                      zip(weights, [p for c in chunks for p in unwrap(c).parameters()], strict=True))
    after = train_step(3)
    result["train_after_generation"] = {"loss": after["loss"], "grad_norm": after["grad_norm"]}
    result["lazy_buffer"] = lazy.result()
    return result


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
