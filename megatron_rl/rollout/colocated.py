"""Sampling a rollout with the colocated generator, and held-out evaluation on it: what GRPO's steps and evals,
and the eval job (megatron_rl/trainers/evaluate.py), share.

``sample_rollout`` splits the completions over the rollout workers (data-parallel x context-parallel ranks),
generates each worker's share on the training weights and gathers them whole on every rank. ``held_out`` samples
``samples`` completions of every held-out prompt in batches of at most a rollout, each batch with its own seed
(so an evaluation leaves a run's random stream alone); ``summarize`` turns the scored completions into pass@1,
pass@k (Chen et al. 2021's unbiased estimator, megatron_rl/algorithms/pass_at_k.py), mean reward and length.

Test: ``.venv/bin/python -m pytest tests/test_evaluate.py -q``
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_rl.algorithms.pass_at_k import mean_pass_at_k
from megatron_rl.data.prompts import encode_prompt
from megatron_rl.generation.config import EngineConfig
from megatron_rl.rollout.batch import Rollout
from megatron_rl.runtime import checkpoint as ckpt
from megatron_rl.runtime.training import data_parallel_share, gather_data_parallel

RULE_VERIFIERS = ("exact", "math", "math_verify")
"""Rewards that judge an answer right or wrong: a completion is correct when one of them gives it full score."""


def engine_config(generation, tokenizer, *, vocab_size: int, **more) -> EngineConfig:
    """The engine's settings from the job's ``generation`` section (sampling, stopping, KV memory), for a model of
    ``vocab_size`` tokens and ``tokenizer``; ``more``: fields the section does not hold (``record_routes``)."""
    return EngineConfig.from_generation(generation, vocab_size=min(tokenizer.vocab_size, vocab_size),
                                        eos_id=tokenizer.eos_id,
                                        stop_sequences=[tokenizer.encode(s) for s in generation.stop], **more)


def sample_rollout(chunks: list, prompts: list, *, config: EngineConfig, tokenizer, group: int, seed: int,
                   seq_multiple: int, stop_requested: Optional[Callable[[bool], tuple]] = None) -> Rollout:
    """``group`` completions of each prompt record (prompt-major) from the model ``chunks``, sampled with the
    engine settings ``config`` (``engine_config``); every rank gets the whole rollout. Call it inside a generation
    phase.
    ``stop_requested(generating) -> (stop, anyone generating)``: the engines' stop question, a collective
    (``GenerationStopped`` on a yes; megatron_rl/generation/engine.py)."""
    from megatron_rl.generation import data_parallel_seed, generate

    texts = [p.prompt for p in prompts for _ in range(group)]
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts for _ in range(group)]
    mine = data_parallel_share(prompt_ids, with_context_parallel=True)
    out = generate([ckpt.unwrap(c) for c in chunks], mine,
                   config, seed=data_parallel_seed(seed),
                   stop_requested=stop_requested)
    routes = out.routes or [None] * len(out.tokens)
    sampled = gather_data_parallel([(list(tokens), list(map(float, lp)), reason == "length", route)
                                    for tokens, lp, reason, route in zip(out.tokens, out.logprobs,
                                                                         out.finish_reasons, routes)],
                                   with_context_parallel=True)
    responses = [tokens for tokens, _, _, _ in sampled]
    return Rollout(prompt_ids=prompt_ids, response_ids=responses, logprobs=[lp for _, lp, _, _ in sampled],
                   prompts=texts, completions=[tokenizer.decode(r) for r in responses],
                   answers=[p.answer for p in prompts for _ in range(group)],
                   truncated=[cut for _, _, cut, _ in sampled], seq_multiple=seq_multiple,
                   routes=[route for *_, route in sampled] if out.routes is not None else [])


def held_out(sample: Callable[[list, int, int], Rollout], prompts: list, *, samples: int, batch_prompts: int,
             seed_of: Callable[[int], int]) -> Rollout:
    """``samples`` completions of every prompt, prompt-major: ``sample(prompts, group, seed)`` (a
    ``sample_rollout``) on batches of at most ``batch_prompts`` prompts, rounded up to a multiple of the rollout
    workers by repeating prompts (whose extra completions are dropped); ``seed_of(first prompt index)`` seeds a
    batch."""
    from megatron.core import parallel_state

    workers = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    per_batch = -(-max(1, batch_prompts) // workers) * workers
    parts = []
    for start in range(0, len(prompts), per_batch):
        batch = prompts[start:start + per_batch]
        padded = [batch[i % len(batch)] for i in range(-(-len(batch) // workers) * workers)]
        parts.append(sample(padded, samples, seed_of(start)).select(list(range(len(batch) * samples))))
    return Rollout.concat(parts)


def correct_answers(rollout: Rollout) -> torch.Tensor:
    """Per completion: a rule verifier's full score, or (without one) a positive reward."""
    verifier = next((name for name in RULE_VERIFIERS if name in rollout.per_fn), None)
    return torch.tensor(rollout.per_fn[verifier]) >= 1.0 if verifier else rollout.rewards > 0


def summarize(rollout: Rollout, *, samples: int, k: Optional[int] = None) -> dict[str, float]:
    """pass@1, pass@k (k = ``samples`` unless given), mean reward and mean response length (tokens) of a scored
    held-out rollout with ``samples`` completions per prompt, and the prompt count."""
    k = samples if k is None else k
    correct = correct_answers(rollout).tolist()
    per_prompt = [correct[i:i + samples] for i in range(0, len(correct), samples)]
    return {"pass@1": mean_pass_at_k(per_prompt, 1), "pass@k": mean_pass_at_k(per_prompt, k), "k": k,
            "mean_reward": float(rollout.rewards.mean()),
            "mean_response_length": sum(map(len, rollout.response_ids)) / len(rollout.response_ids),
            "n_prompts": len(per_prompt)}
