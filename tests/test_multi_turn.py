"""Multi-turn rollouts in process: only the policy's tokens are trained (the environment's replies are context, in
both the padded and the packed micro-batches, through the real GRPO loss), and a conversation's replies render
through the chat format as the continuation of what the row holds. The engine's side (replies fed onto the row's
blocks, log-probs equal to the training forward) runs on a real model in tests/test_generation.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms.policy_loss import GRPOLossConfig, grpo_loss
from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.prompts import PromptRecord, prompt_record
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.rollout.batch import Rollout, collate_rollout, rollout_rows
from megatron_rl.rollout.multi_turn import Conversation, env_record
from megatron_rl.rollout.packing import collate_packed
from megatron_rl.spec.errors import ConfigError
from test_data_formats import TEMPLATE, chat_tokenizer

CONFIG = GRPOLossConfig(eps_low=0.2, eps_high=0.2, kl_coef=0.1, kl_kind="k3", loss_agg_mode="token-mean")


def _rollout() -> Rollout:
    """Two episodes: prompt, a 3-token turn, a 2-token reply, a 2-token turn (and one single-turn answer)."""
    gen = torch.Generator().manual_seed(3)
    lp = lambda n: (-torch.rand(n, generator=gen) * 2).tolist()  # noqa: E731
    return Rollout(prompt_ids=[[1, 5, 6], [1, 7]], response_ids=[[10, 11, 12, 40, 41, 13, 14], [20, 21]],
                   logprobs=[lp(3) + [0.0, 0.0] + lp(2), lp(2)], response_mask=[[1, 1, 1, 0, 0, 1, 1], [1, 1]],
                   prompts=["a", "b"], completions=["x", "y"], answers=[1, 2], truncated=[False, False],
                   advantages=torch.tensor([0.7, -0.4]))


def _batches(rollout: Rollout) -> dict:
    rows = rollout_rows(rollout)
    padded = collate_rollout(rows, seq_length=rollout.seq_length, pad_id=0)
    packed = collate_packed(rows, packed_length=16, pad_id=0, thd=False)
    return {"padded": padded, "packed": packed}


def _grad(batch: dict, *, logp_shift=None, ref_shift=None, old_shift=None) -> torch.Tensor:
    """d loss / d logp of the real GRPO loss, the current log-probs being the stored ones plus a small offset."""
    old = batch["behav_logp"].clone()
    base = old + 0.05 * torch.arange(old.numel(), dtype=torch.float32).view_as(old).sin()
    logp = (base + (logp_shift if logp_shift is not None else 0)).requires_grad_(True)
    ref = old - 0.1 + (ref_shift if ref_shift is not None else 0)
    loss, _ = grpo_loss(logp, old + (old_shift if old_shift is not None else 0), batch["advantages"],
                        batch["loss_mask"], config=CONFIG, ref_logp=ref)
    loss.backward()
    return logp.grad


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_only_the_policys_tokens_are_trained(layout):
    batch = _batches(_rollout())[layout]
    mask = batch["loss_mask"]
    # label positions of row 0: the response starts at label index len(prompt) - 1 = 2
    reply = [(0, 2 + 3), (0, 2 + 4)]
    policy = [(0, 2), (0, 2 + 5), (1, 1)]
    assert all(mask[i, j] == 0 for i, j in reply) and all(mask[i, j] == 1 for i, j in policy)
    assert int(mask.sum()) == 7
    grad = _grad(batch)
    assert all(grad[i, j] == 0 for i, j in reply) and all(grad[i, j] != 0 for i, j in policy)
    for i, j in reply:  # an environment token's log-prob (current, old or reference) moves nothing
        shift = torch.zeros_like(mask)
        shift[i, j] = 0.5
        for kind in ("logp_shift", "ref_shift", "old_shift"):
            assert torch.equal(_grad(batch, **{kind: shift}), grad), kind
    for i, j in policy:  # a policy token's does
        shift = torch.zeros_like(mask)
        shift[i, j] = 0.5
        assert not torch.equal(_grad(batch, old_shift=shift), grad)


def test_the_packed_and_padded_batches_mask_the_same_tokens():
    batches = _batches(_rollout())
    padded, packed = batches["padded"], batches["packed"]
    for row, width in enumerate((9, 3)):
        assert torch.equal(packed["loss_mask"][row, :width], padded["loss_mask"][row, :width])
        assert torch.equal(packed["behav_logp"][row, :width], padded["behav_logp"][row, :width])


def _record(chat: ChatFormat, given) -> PromptRecord:
    return prompt_record(chat, given, 2146, {"task": "t"}, "test")


def _text(tok, ids: list[int]) -> str:
    return "".join(tok.hf.convert_ids_to_tokens(ids))


def test_a_plain_conversation_appends_role_lines():
    tok = CharTokenizer()
    chat = ChatFormat(tok)
    record = _record(chat, "37*58=")
    assert env_record(record) == {"task": "t", "prompt": "37*58=", "answer": 2146}
    conversation = Conversation(chat, record, [{"role": "user", "content": "37*58="}])
    assert conversation.prompt_ids == tok.encode("37*58=", add_bos=True)  # the data's prompt, as without an env
    ids = conversation.reply_ids("<calc>37*58</calc>", [{"role": "tool", "content": "2146"}], ended_with_eos=False)
    assert tok.decode(ids) == "\ntool: 2146\nassistant: "
    changed = Conversation(chat, record, [{"role": "system", "content": "use the tool"},
                                          {"role": "user", "content": "37*58="}])
    assert tok.decode(changed.prompt_ids) == "system: use the tool\nuser: 37*58=\nassistant: "


def test_a_chat_template_reply_continues_exactly_what_the_row_holds(tmp_path):
    tok = chat_tokenizer(tmp_path)
    chat = ChatFormat(tok, chat_template=True)
    first = [{"role": "user", "content": "what is 2+2?"}]
    conversation = Conversation(chat, _record(chat, first), first)
    prompt_text = _text(tok, conversation.prompt_ids)
    assert prompt_text == "<s><|user|>what is 2+2?<|end|><|assistant|>"
    reply = [{"role": "user", "content": "sure?"}]
    ids = conversation.reply_ids("4", reply, ended_with_eos=False)
    assert _text(tok, ids) == "<|end|><|user|>sure?<|end|><|assistant|>"
    # the row's text, prompt + turn + reply, is the template's rendering of the whole conversation
    whole = chat.render(conversation.messages, add_generation_prompt=True)
    assert prompt_text + "4" + _text(tok, ids) == whole


def test_a_template_that_rewrites_history_is_refused(tmp_path):
    rewriting = TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] if loop.last or m['role'] != 'assistant' "
                                                        "else '' }}")
    chat = ChatFormat(chat_tokenizer(tmp_path, template=rewriting), chat_template=True)
    first = [{"role": "user", "content": "hi"}]
    conversation = Conversation(chat, _record(chat, first), first)
    with pytest.raises(ConfigError, match="renders an earlier turn differently"):
        conversation.reply_ids("thinking", [{"role": "user", "content": "go on"}], ended_with_eos=False)


def test_a_turn_that_ended_with_the_end_of_turn_token_is_not_closed_twice(tmp_path):
    tok = chat_tokenizer(tmp_path, template=TEMPLATE.replace("<|end|>", "{{ eos_token }}"))
    chat = ChatFormat(tok, chat_template=True)
    first = [{"role": "user", "content": "hi"}]
    reply = [{"role": "user", "content": "more"}]
    closed_by_policy = Conversation(chat, _record(chat, first), first)
    assert _text(tok, closed_by_policy.reply_ids("ok", reply, ended_with_eos=True)) == "<|user|>more</s><|assistant|>"
    cut = Conversation(chat, _record(chat, first), first)
    assert _text(tok, cut.reply_ids("ok", reply, ended_with_eos=False)) == "</s><|user|>more</s><|assistant|>"


COUNTED = ["--config", "configs/grpo_calculator_tiny.yaml", "environment.name=counting_env:CountingCalculator",
           "environment.options.tag=c", "environment.options.max_calls=1", "logging.console=quiet",
           "logging.tensorboard=false", "logging.plot=false"]
"""The calculator job with tests/counting_env.py's environment, which writes each reset and step to a ledger."""


def _counted_run(launch, run_dir, ledger, *overrides: str, env: dict | None = None):
    return launch(*COUNTED, f"run.dir={run_dir}", f"environment.options.ledger={ledger}", *overrides,
                  env={"PYTHONPATH": str(Path(__file__).parent), **(env or {})}, timeout=600)


@pytest.mark.slow
def test_the_calculator_job_runs_episodes_and_logs_whole_conversations(launch, tmp_path):
    """configs/grpo_calculator_tiny.yaml at PP2 (its calculator counting its calls), a few steps: episodes call the
    calculator and answer after its reply; the metrics count turns and tool calls; the sample log holds whole
    conversations, the reply as context. The first stage makes the environment calls and shares them with the
    other (rollout/multi_turn.py ``model_parallel_share``): one reset per episode. The checkpoint evaluates at
    PP1."""
    import json

    from helpers import read_metrics

    run_dir, ledger = tmp_path / "calc", tmp_path / "calls"
    result = _counted_run(launch, run_dir, ledger, "parallel.pp=2", "run.steps=3", "algorithm.sft_warmup_steps=200",
                          "algorithm.prompts_per_step=8", "algorithm.global_batch_size=64",
                          "parallel.micro_batch_size=16", "logging.sample_every=1", "logging.samples=16")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    resets = [line for line in ledger.read_text().splitlines() if line.startswith('["reset"')]
    assert len(resets) == 3 * 8 * 8  # steps x prompts x group: once per episode, not once per pipeline stage
    steps = [m for m in read_metrics(run_dir) if m.get("phase") is None]
    assert len(steps) == 3
    assert all(0 < m["env_tool_call_rate"] <= 1 and 1 <= m["env_turns"] <= 2 for m in steps)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    called = [s for s in samples
              if s["episode"]["turns"][0]["reply"] and s["episode"]["turns"][0].get("reply_fed", True)]
    assert called, "no logged episode called the calculator"
    for sample in called:
        first, *rest = sample["episode"]["turns"]
        assert "<c>" in first["text"] and first["text"].endswith("</c>")  # a turn that ends in a call, as the
        # environment defines one (the policy may write before the tag: "3<c>\n389</c>" was sampled once)
        assert first["reply"] == [{"role": "tool", "content": first["reply"][0]["content"]}]
        reply_tokens = len("\ntool: " + first["reply"][0]["content"] + "\nassistant: ")
        assert sample["response_tokens"] == sample["trained_tokens"] + reply_tokens  # the reply is not trained
        assert sample["completion"] == (rest[-1]["text"] if rest else first["text"])
    # the trained checkpoint evaluated on held-out prompts, each sample an episode with the calculator
    evaluated = launch("eval", "--ckpt", str(run_dir / "checkpoints"), "--config", "configs/grpo_calculator_tiny.yaml",
                       f"run.dir={tmp_path / 'eval'}", "eval.max_prompts=8", "eval.samples=2",
                       "logging.tensorboard=false", timeout=300)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    entry = json.loads((tmp_path / "eval" / "eval.json").read_text())["default"]
    assert entry["n_prompts"] == 8 and entry["k"] == 2 and 0 <= entry["pass@1"] <= entry["pass@k"] <= 1
    assert 0 < entry["env_tool_call_rate"] <= 1 and 1 <= entry["env_turns"] <= 2, entry


def test_episodes_run_with_grpo_ppo_and_eval_only():
    from megatron_rl.spec.config import load_config

    for name in ("eval", "ppo"):
        assert load_config("grpo_calculator_tiny", [f"algorithm.name={name}"]).environment.name == "calculator"
    with pytest.raises(ConfigError, match="multi-turn episodes run with algorithm.name=grpo, ppo or eval, not sft"):
        load_config("grpo_calculator_tiny", ["algorithm.name=sft"])


@pytest.mark.slow
def test_ppo_runs_episodes_with_its_critic_over_the_policys_tokens(launch, tmp_path):
    """PPO on the calculator task at TP2: episodes as in GRPO, the episode's reward (the sum of its turns') at the
    last policy token, GAE and the critic's loss over the policy's tokens only (the replies are masked holes, which
    tests/test_gae.py shows take no part); the first mini-batch's ratio is 1 (the episode's log-probs are the
    training forward's). The first TP rank makes the environment calls and shares them: one reset per episode."""
    import json
    import math

    from helpers import read_metrics

    run_dir = tmp_path / "ppo"
    result = _counted_run(launch, run_dir, tmp_path / "calls", "algorithm.name=ppo", "run.steps=2",
                          "algorithm.sft_warmup_steps=100", "algorithm.prompts_per_step=8", "algorithm.group_size=2",
                          "algorithm.global_batch_size=16", "parallel.micro_batch_size=8", "logging.sample_every=1",
                          "logging.samples=16", "parallel.tp=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [m for m in read_metrics(run_dir) if m.get("phase") is None]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 1 <= m["env_turns"] <= 2 and abs(m["first_ratio_max"] - 1) < 1e-5, m
        assert math.isfinite(m["value_loss"]) and math.isfinite(m["loss"]), m
    resets = [line for line in (tmp_path / "calls").read_text().splitlines() if line.startswith('["reset"')]
    assert len(resets) == 2 * 8 * 2  # steps x prompts x group: once per episode, not once per TP rank
    for sample in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines()):
        replies = sum(len("\ntool: " + t["reply"][0]["content"] + "\nassistant: ")
                      for t in sample["episode"]["turns"] if t["reply"] and t.get("reply_fed", True))
        assert sample["response_tokens"] == sample["trained_tokens"] + replies


@pytest.mark.slow
def test_moe_episodes_run_with_experts_over_two_workers_and_router_replay(launch, tmp_path):
    """tiny-cpu-moe at TP2·EP2·SP: two rollout workers of two TP ranks each, the experts spanning the workers, so
    they decode in lockstep while each worker's first rank steps its environments in threads (the ranks settling
    which replies came at each step); with router replay: the episodes' routes (the replies' positions included)
    replay in the training forwards, whose first mini-batch's ratio is 1; one reset per episode."""
    from helpers import read_metrics

    run_dir, ledger = tmp_path / "moe", tmp_path / "calls"
    result = _counted_run(launch, run_dir, ledger, "model.name=tiny-cpu-moe", "cluster.tasks_per_node=4",
                          "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                          "algorithm.router_replay=true", "run.steps=2", "algorithm.sft_warmup_steps=120",
                          "algorithm.prompts_per_step=4", "algorithm.group_size=4", "algorithm.global_batch_size=16",
                          "parallel.micro_batch_size=8")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [m for m in read_metrics(run_dir) if m.get("phase") is None]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["replayed_routes"] > 0 and abs(m["first_ratio_max"] - 1) < 1e-5, m
        assert 1 <= m["env_turns"] <= 2, m
    assert any(m["env_turns"] > 1 for m in steps)  # replies were fed, and their routes replayed
    resets = [line for line in ledger.read_text().splitlines() if line.startswith('["reset"')]
    assert len(resets) == 2 * 4 * 4


@pytest.mark.slow
def test_a_run_killed_between_turns_resumes_without_repeating_an_environment_call(launch, tmp_path):
    """SIGKILLed in step 2 right after an environment's step (other episodes of the step half done; the steps run in
    threads beside generation), the rerun resumes from step 1's checkpoint and replays step 2's journaled calls
    instead of making them again: every reset and step is made exactly as often as in an uninterrupted run (the
    counting environment's ledger), and every metric equals that run's, bit for bit."""
    import json
    from collections import Counter

    from helpers import read_metrics, without_measurements

    def run(name: str, **env) -> tuple:
        ledger = tmp_path / f"{name}.ledger"
        return _counted_run(launch, tmp_path / name, ledger, "run.steps=2", "algorithm.sft_warmup_steps=60",
                            "algorithm.prompts_per_step=4", "algorithm.group_size=4", "algorithm.global_batch_size=16",
                            "parallel.micro_batch_size=8", "checkpoint.save_interval=1", env=env), ledger

    whole, whole_ledger = run("whole")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    killed, ledger = run("resumed", MEGATRON_RL_FAULT="kill-between-turns:2")
    assert killed.returncode == 137 and "was killed by signal 9" in killed.stderr, killed.stderr[-3000:]
    journals = sorted((tmp_path / "resumed" / "episodes").glob("step_00000002_*.jsonl"))
    stepped = [e for j in journals for e in map(json.loads, j.read_text().splitlines()) if e["turn"] > 0]
    assert stepped  # step 2's environments had stepped when the kill came
    made_before = Counter(ledger.read_text().splitlines())
    resumed, _ = run("resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    calls, expected = Counter(ledger.read_text().splitlines()), Counter(whole_ledger.read_text().splitlines())
    assert sum(expected.values()) > sum(made_before.values()) > 0
    assert calls == expected  # nothing called twice, nothing skipped
    assert sum(n for line, n in expected.items() if line.startswith('["reset"')) == 2 * 4 * 4  # once per episode
    steps = lambda run_dir: [m for m in read_metrics(run_dir) if m.get("phase") is None]  # noqa: E731
    # every figure to the bit: the replies join their rows at fixed steps (environment.reply_steps), whenever the
    # threads (or the journal, on the resumed run) give them
    assert without_measurements(steps(tmp_path / "resumed")) == without_measurements(steps(tmp_path / "whole"))
    assert [m["step"] for m in steps(tmp_path / "resumed")] == [1, 2]
    assert not list((tmp_path / "resumed" / "episodes").glob("step_00000001_*"))  # checkpointed steps forgotten


@pytest.mark.slow
def test_async_grpo_runs_episodes_on_its_rollout_worker(launch, tmp_path):
    """Split placement (a rollout worker of two pipeline stages, max_staleness 1): the worker's session runs each
    prompt's group of episodes (FedPrompt.turns, the first stage making each environment call for both) and sends
    back what the trainer trains on: the conversation's prompt, the policy mask (replies not trained), the
    environment's rewards and each episode's log. The trainer gets one reset per episode, never more (the worker
    alone steps environments). The trainers' stop comes while the worker decodes orders ahead: its stages take the
    choices in flight and leave together (engine.py ``Engine._run_pipelined``)."""
    import json

    from helpers import read_metrics

    run_dir, ledger = tmp_path / "async", tmp_path / "calls"
    result = _counted_run(launch, run_dir, ledger, "cluster.tasks_per_node=3", "cluster.rollout_tasks=2",
                          "parallel.rollout_pp=2", "algorithm.max_staleness=1",
                          "algorithm.weight_sync=files", "algorithm.off_policy_correction=decoupled",
                          "algorithm.is_cap=2.0", "run.steps=3", "algorithm.sft_warmup_steps=200",
                          "algorithm.prompts_per_step=4", "algorithm.group_size=4", "algorithm.global_batch_size=16",
                          "parallel.micro_batch_size=8", "logging.sample_every=1", "logging.samples=16")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [m for m in read_metrics(run_dir) if m.get("phase") is None]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(1 <= m["env_turns"] <= 2 for m in steps) and any(m["env_tool_call_rate"] > 0 for m in steps)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    called = [s for s in samples if s["episode"]["turns"][0]["reply"] and s["episode"]["turns"][0].get("reply_fed", True)]
    assert called, "no episode called the calculator"
    for sample in called:
        reply = sample["episode"]["turns"][0]["reply"][0]["content"]
        assert sample["response_tokens"] == sample["trained_tokens"] + len("\ntool: " + reply + "\nassistant: ")
    resets = [line for line in ledger.read_text().splitlines() if line.startswith('["reset"')]
    # every prompt the trainer issued (3 steps, and at most one order ahead at max_staleness 1) once per episode
    assert 3 * 4 * 4 <= len(resets) <= 5 * 4 * 4 and len(resets) % 4 == 0
