"""Seconds per GRPO step (generate + score + train) of our trainer against TRL's ``GRPOTrainer``, same run.

Run: ``.venv/bin/python bench/grpo_step.py`` (options: ``--sizes tiny,small,long,longtail --steps 16 --long-steps 6
--long-new-tokens 128 --longtail-steps 6 --longtail-new-tokens 192 --longtail-mean 32
--longtail-micro-batch-tokens 4096 --block 2 --warmup 2 --threads 1 --prompts 8 --group 8 --new-tokens 16
--profile``). Needs ``trl datasets accelerate`` (the ``bench`` extra). CPU, fp32, no network
(``HF_HUB_OFFLINE=1``).

Each side runs in its own worker process (ours: ``RLRun`` on Megatron Core, world size 1, gloo; TRL:
``GRPOTrainer`` on a ``LlamaForCausalLM``), both on ``--threads`` torch threads. This process only hands out
blocks of ``--block`` steps, alternating which side goes first, so both share the machine's noise; a worker
waits, idle, while the other runs. Steps are timed inside the workers from the start of one step to the
start of the next (TRL: between ``on_step_begin`` callbacks, so its batch fetch and logging count; ours:
prompts, generate, score, train, metrics and the metrics.jsonl line). ``--warmup`` steps per side are dropped.

Matched settings: the same prompts in the same order (our ``PromptSampler`` over the synthetic task; TRL gets
them unshuffled), ``--prompts`` x ``--group`` completions, one optimizer step per rollout (one micro-batch of
all completions on both sides), no reference model (``kl_coef=0`` / ``beta=0``), token-mean (DAPO) loss, clip
0.2, std-normalised group advantages, grad clip 1.0, constant lr 1e-6, no warm-up, no gradient checkpointing,
the same exact-match reward function, sampling at temperature 1. Every completion is exactly
``--new-tokens`` long on both sides: ours generates with no end-of-sequence id, TRL with ``min_new_tokens``.
The TRL model is a ``LlamaForCausalLM`` with the same sizes as ours (random weights; timing only) and the
tokenizer is our character vocabulary as a ``PreTrainedTokenizerFast`` (ids padded to the model's vocabulary
with unused tokens).

Sizes: ``tiny`` = the ``tiny-cpu`` preset (hidden 64, 2 layers, 4 heads / 2 KV heads, ffn 128, vocab 128);
``small`` = hidden 256, 4 layers, 8 heads / 4 KV heads, ffn 704, vocab 512; ``long`` = the small model with
``--long-new-tokens`` (128) per completion, ``--long-steps`` (6) timed steps; ``longtail`` (reasoning RL's shape) =
the small model, each completion ending at a drawn length (``forced_lengths``: exponential with mean
``--longtail-mean``, 32, rounded up and cut at ``--longtail-new-tokens``, 192: mean at most a quarter of the
maximum), forced on both sides (end-of-sequence at that length and never before: a logits processor in TRL's
``generate``, the sampled token in our paged engine; both sides' lengths are checked against the draw), and our
training packed (``parallel.micro_batch_tokens``, ``--longtail-micro-batch-tokens``) where TRL pads every row to the
longest prompt + the longest completion; it reports ``train_tokens_per_real_token`` of both (tokens the training
forwards compute over the rows' own tokens; TRL's from its padded batch). The main figure is the first size.
Each size reports the medians and the spread of the per-step ratios (TRL's i-th timed step over ours, taken in
the same block pair): median, quartiles, min and max. The last line is one JSON object; ``speedup`` = TRL seconds /
our seconds (medians, > 1: we are faster).
Threads: 1 by default. On this 2-core machine, shared with other jobs, 2 OpenMP threads per side measure
the neighbours more than the trainers (TRL's 2-thread steps swung between 0.1 s and 10 s while ours stayed
near 0.13 s); ``--threads 2`` is meaningful only on an idle machine.
``--profile`` adds a cProfile of our step (top functions by cumulative and by own time).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron_rl.spec.ports import free_port  # noqa: E402

SMALL_SHAPE_YAML = """\
name: small-cpu-bench
family: llama
hf_architecture: LlamaForCausalLM
num_layers: 4
hidden_size: 256
ffn_hidden_size: 704
num_attention_heads: 8
num_query_groups: 4
kv_channels: 32
vocab_size: 512
seq_length: 64
max_position_embeddings: 128
gated_linear_unit: true
normalization: RMSNorm
norm_epsilon: 1.0e-5
position_embedding_type: rope
rotary_base: 10000.0
tie_embeddings: false
"""
LEARNING_RATE = 1e-6
SIZES = ("tiny", "small", "long", "longtail")
WORKER_TIMEOUT_S = 900


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """What both sides run; sent to each worker process."""

    model: str
    """Model shape spec for ``load_model_shape`` (a preset name or a YAML path)."""
    prompts: int
    """Prompts per GRPO step."""
    group: int
    """Completions per prompt."""
    new_tokens: int
    """Tokens generated per completion (exactly: end-of-sequence is disabled on both sides)."""
    threads: int
    """torch.set_num_threads in each worker."""
    seed: int
    """Seed of weights, prompt order and sampling."""
    total_steps: int
    """Steps each side will be asked for (warm-up included); sizes TRL's prompt list."""
    work_dir: str
    """Scratch folder of this size (run dirs, TRL output dir)."""
    longtail_mean: float = 0.0
    """> 0: the longtail size. Each completion ends (end-of-sequence) at a length drawn by ``forced_lengths`` with
    this mean, up to new_tokens; 0: every completion runs to new_tokens."""
    micro_batch_tokens: int | None = None
    """Our parallel.micro_batch_tokens (packed training); None: padded, one micro-batch of every completion."""


def forced_lengths(settings: BenchSettings, call: int) -> list[int]:
    """The response lengths of the ``call``-th generation (1-based), completion by completion in rollout order
    (prompt after prompt, each ``group`` times): exponential with mean ``longtail_mean``, rounded up, cut at
    new_tokens. The same on both sides: a seeded generator per call."""
    import numpy as np

    rng = np.random.default_rng([settings.seed, call])
    drawn = np.ceil(rng.exponential(settings.longtail_mean, settings.prompts * settings.group))
    return [int(min(settings.new_tokens, max(1, n))) for n in drawn]


# ------------------------------------------------------------------------------------------- shared helpers
def char_tokenizer_as_hf(vocab_size: int):
    """Our CharTokenizer as a ``PreTrainedTokenizerFast``: same ids, <bos> prepended, padded to vocab_size ids."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    from megatron_rl.data.tokenizer import CHARACTERS, SPECIAL_TOKENS, CharTokenizer

    ours = CharTokenizer()
    if vocab_size < ours.vocab_size:
        raise ValueError(f"model vocabulary {vocab_size} is smaller than the tokenizer's {ours.vocab_size}")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: ours.encode(char)[0] for char in CHARACTERS})
    unused = [f"<unused_{i}>" for i in range(ours.vocab_size, vocab_size)]
    vocab.update({token: ours.vocab_size + i for i, token in enumerate(unused)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIAL_TOKENS) + unused)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", ours.bos_id)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def prompt_sequence(settings: BenchSettings) -> list[dict]:
    """The prompts our RLRun draws, step after step, as TRL records (each prompt once; TRL repeats it)."""
    from megatron_rl.data.prompts import PromptDataset, PromptSampler
    from megatron_rl.data.synthetic import write_synthetic_dataset

    data_dir = Path(settings.work_dir) / "trl_data"
    # What megatron_rl.data.prompts.load_prompt_data writes for data.task=last_digit and run.seed.
    paths = write_synthetic_dataset(data_dir, task="last_digit", seed=settings.seed, sft_answers="random")
    sampler = PromptSampler(PromptDataset.from_files(paths["train"]), settings.prompts, seed=settings.seed)
    return [{"prompt": r.prompt, "answer": r.answer} for _ in range(settings.total_steps) for r in sampler.next_batch()]


def _isolate_worker_env(threads: int) -> None:
    """Single-process, offline, quiet: library prints go to stderr so stdout holds only the bench's lines."""
    import warnings

    warnings.filterwarnings("ignore")
    sys.stdout = sys.stderr
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(key, None)
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "",
                       "OMP_NUM_THREADS": str(threads)})


# ------------------------------------------------------------------------------------------------ our side
def build_our_run(settings: BenchSettings):
    """(RLRun, TrainerContext) of our trainer with the matched settings; starts torch.distributed (world 1)."""
    from megatron_rl.spec.config.loader import load_config
    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.runtime.distributed import initialize, job_dims
    from megatron_rl.trainers.common import TrainerContext
    from megatron_rl.trainers.rl import RLRun

    completions = settings.prompts * settings.group
    cfg = load_config(None, [
        f"model.name={settings.model}", "model.dtype=fp32", "cluster.executor=local", "cluster.tasks_per_node=1",
        f"algorithm.prompts_per_step={settings.prompts}", f"algorithm.group_size={settings.group}",
        f"algorithm.global_batch_size={completions}", f"parallel.micro_batch_size={completions}",
        "algorithm.kl_coef=0", "algorithm.sft_warmup_steps=0", "algorithm.loss_aggregation=token-mean",
        "algorithm.advantage=std", "algorithm.clip_eps_low=0.2", "algorithm.clip_eps_high=0.2",
        f"generation.max_new_tokens={settings.new_tokens}", "generation.temperature=1.0",
        f"optimizer.lr={LEARNING_RATE}", "optimizer.lr_decay_style=constant", "optimizer.clip_grad=1.0",
        "data.task=last_digit", f"run.seed={settings.seed}", f"run.dir={Path(settings.work_dir) / 'ours'}",
        "run.steps=1000000", "checkpoint.resume=false", "checkpoint.save_at_end=false",
        "logging.console=quiet", "logging.tensorboard=false",
        *([f"parallel.micro_batch_tokens={settings.micro_batch_tokens}"] if settings.micro_batch_tokens else []),
        *(["generation.kv_block_tokens=16"] if settings.longtail_mean else [])])
    initialize(job_dims(), seed=cfg.run.seed, backend="gloo")
    ctx = TrainerContext(cfg)
    run = RLRun(cfg, load_model_shape(settings.model), ctx)
    run.resume_or_warm_up()
    if settings.longtail_mean:
        force_our_lengths(settings, eos=run.tokenizer.eos_id)
    else:
        run.tokenizer.eos_id = None  # every completion runs to max_new_tokens, as TRL's min_new_tokens does there
    return run, ctx


def force_our_lengths(settings: BenchSettings, *, eos: int) -> None:
    """Make the paged engine end each completion at its ``forced_lengths`` length: after it samples, a row's token
    becomes end-of-sequence at that length and never before (an early one is replaced). Generation, admission,
    stops and training run as in a job; only the sampled token changes."""
    import torch

    from megatron_rl.generation import engine

    calls = {"n": 0, "lengths": []}
    run, sample = engine.Engine.run, engine.Engine._sample

    def counted_run(self):
        calls["n"] += 1
        calls["lengths"] = forced_lengths(settings, calls["n"])
        return run(self)

    def forced_sample(self, part, logits):
        choice = sample(self, part, logits)
        tokens = choice.tokens.clone()
        for j, row in enumerate(part.runner.sampled):
            ends = len(row.tokens) - row.prompt_len + 1 >= calls["lengths"][row.index]
            tokens[j] = eos if ends else (eos + 1 if int(tokens[j]) == eos else tokens[j])
        changed = tokens != choice.tokens
        if not changed.any():
            return choice
        # the replaced tokens' log-probs, as sampling them would have given (the first step's ratio stays 1)
        rows = part.runner.sampled_logits(logits)
        logp = torch.log_softmax(rows.float(), dim=-1).gather(1, tokens[:, None])[:, 0]
        return dataclasses.replace(choice, tokens=tokens,
                                   policy_logprobs=torch.where(changed, logp, choice.policy_logprobs),
                                   sampling_logprobs=torch.where(changed, logp, choice.sampling_logprobs))

    engine.Engine.run = counted_run
    engine.Engine._sample = forced_sample


def ours_worker(conn, settings: BenchSettings) -> None:
    """Our RLRun in this process; answers {"steps": k} with k step timings, {"profile": k} with a cProfile."""
    _isolate_worker_env(settings.threads)
    os.environ["MASTER_PORT"] = str(free_port())
    import torch

    torch.set_num_threads(settings.threads)
    from megatron_rl.runtime.distributed import shutdown

    run, ctx = build_our_run(settings)
    step = 0

    def one_step() -> dict:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        sampled = run.source.sample(step)  # the trainer's own step: generate and score, then train, metrics, log
        t2 = time.perf_counter()
        train_metrics = run.train_on(sampled.kept, step)
        t3 = time.perf_counter()
        metrics = run.step_metrics(sampled, train_metrics, t3 - t2)
        ctx.end_step(run.engine, step, metrics)
        t4 = time.perf_counter()
        rollout = sampled.drawn
        other = t4 - t3 + (t2 - t0 - sampled.sample_s - sampled.score_s)
        return {"total": t4 - t0, "generate": sampled.sample_s, "score": sampled.score_s, "train": t3 - t2,
                "other": other, "prompts": rollout.prompts if step == 1 else None,
                "response_tokens": sum(len(r) for r in rollout.response_ids),
                "response_lengths": [len(r) for r in rollout.response_ids],
                "train_tokens_per_real_token": train_metrics["train_tokens_per_real_token"],
                "first_ratio": [metrics.get("first_ratio_min"), metrics.get("first_ratio_max")]}

    conn.send({"ready": True, "threads": torch.get_num_threads(), "torch": torch.__version__})
    while True:
        message = conn.recv()
        if "steps" in message:
            conn.send({"times": [one_step() for _ in range(message["steps"])], "threads": torch.get_num_threads()})
        elif "profile" in message:
            conn.send({"profile": _profile(lambda: [one_step() for _ in range(message["profile"])])})
        else:
            break
    ctx.logger.close()
    shutdown()


def _profile(fn) -> dict:
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    fn()
    profiler.disable()
    wall = time.perf_counter() - started
    out = {"wall_s": wall}
    for key in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(key).print_stats(30)
        out[key] = text.getvalue()
    return out


# ------------------------------------------------------------------------------------------------ TRL side
class _StopTraining(Exception):
    pass


def trl_worker(conn, settings: BenchSettings) -> None:
    """TRL's GRPOTrainer in this process; its training loop hands control back between blocks of steps."""
    _isolate_worker_env(settings.threads)
    import torch

    torch.set_num_threads(settings.threads)
    import datasets
    import transformers
    import trl
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rl.spec.model_shape import load_model_shape
    from megatron_rl.rewards import build_reward_fn

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    shape = load_model_shape(settings.model)
    tokenizer = char_tokenizer_as_hf(shape.vocab_size)
    torch.manual_seed(settings.seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups, head_dim=shape.kv_channels,
        max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=shape.norm_epsilon,
        rope_theta=shape.rotary_base, tie_word_embeddings=shape.tie_embeddings, attention_bias=False,
        mlp_bias=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)).float()
    exact = build_reward_fn("exact")
    first_prompts: list = []

    def exact_match(prompts, completions, answer, **kwargs):
        if not first_prompts:
            first_prompts.extend(prompts)
        return exact(prompts, completions, answer)

    split = {"generate": 0.0, "score": 0.0}
    shapes: dict = {}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                out = super()._generate(*args, **kwargs)
            finally:
                split["generate"] += time.perf_counter() - started
            prompt_ids, completion_ids = out[0], out[1]
            # what its training forwards compute: every row padded to the longest prompt + the longest completion
            real = sum(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
            shapes.update(lengths=[len(c) for c in completion_ids], ratio=len(prompt_ids) * (
                max(map(len, prompt_ids)) + max(map(len, completion_ids))) / real)
            return out

        def _calculate_rewards(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return super()._calculate_rewards(*args, **kwargs)
            finally:
                split["score"] += time.perf_counter() - started

    completions = settings.prompts * settings.group
    if settings.longtail_mean:
        force_trl_lengths(model, settings, eos=tokenizer.eos_token_id)
    args = GRPOConfig(
        output_dir=str(Path(settings.work_dir) / "trl"), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=completions, gradient_accumulation_steps=1,
        num_generations=settings.group, max_completion_length=settings.new_tokens,
        generation_kwargs={} if settings.longtail_mean else {"min_new_tokens": settings.new_tokens}, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", epsilon=0.2, scale_rewards="group", num_iterations=1,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, shuffle_dataset=False, max_steps=settings.total_steps + 1, seed=settings.seed,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        use_vllm=False)

    class Handoff(TrainerCallback):
        """Times each step (on_step_begin to the next) and waits for the next block at block boundaries."""

        def __init__(self) -> None:
            self.left, self.started, self.times, self.step = 0, None, [], 0

        def on_step_begin(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.started is not None:
                self.times.append({"total": now - self.started, "generate": split["generate"],
                                   "score": split["score"], "response_lengths": shapes.get("lengths"),
                                   "train_tokens_per_real_token": shapes.get("ratio"),
                                   "train": now - self.started - split["generate"] - split["score"],
                                   "prompts": list(first_prompts) if self.step == 1 else None})
            if self.left == 0:
                conn.send({"times": self.times, "threads": torch.get_num_threads()} if self.step else
                          {"ready": True, "threads": torch.get_num_threads(), "trl": trl.__version__,
                           "transformers": transformers.__version__})
                message = conn.recv()
                if "steps" not in message:
                    raise _StopTraining()
                self.left, self.times = message["steps"], []
            self.left -= 1
            self.step += 1
            split["generate"] = split["score"] = 0.0
            self.started = time.perf_counter()

    trainer = TimedGRPOTrainer(model=model, reward_funcs=[exact_match], args=args, processing_class=tokenizer,
                               train_dataset=datasets.Dataset.from_list(prompt_sequence(settings)),
                               callbacks=[Handoff()])
    try:
        trainer.train()
    except _StopTraining:
        pass


def force_trl_lengths(model, settings: BenchSettings, *, eos: int) -> None:
    """Make ``generate`` end each completion at its ``forced_lengths`` length (a logits processor: end-of-sequence
    only at that length, forced there), as ``force_our_lengths`` does on our side."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    calls = {"n": 0}

    class ForcedLengths(LogitsProcessor):
        def __init__(self, lengths: list[int], prompt_width: int) -> None:
            self.lengths, self.width = torch.tensor(lengths), prompt_width

        def __call__(self, input_ids, scores):
            ends = input_ids.size(1) - self.width + 1 >= self.lengths
            scores[:, eos] = float("-inf")
            scores[ends] = float("-inf")
            scores[ends, eos] = 0.0
            return scores

    generate = model.generate

    def forced_generate(*args, **kwargs):
        calls["n"] += 1
        processor = ForcedLengths(forced_lengths(settings, calls["n"]), kwargs["input_ids"].size(1))
        return generate(*args, logits_processor=LogitsProcessorList([processor]), **kwargs)

    model.generate = forced_generate


# --------------------------------------------------------------------------------------------- orchestrator
class Worker:
    """One worker process and its end of the pipe."""

    def __init__(self, name: str, target, settings: BenchSettings) -> None:
        context = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = context.Pipe()
        self.process = context.Process(target=target, args=(child, settings), name=f"grpo-bench-{name}")
        self.process.start()
        child.close()

    def ask(self, message: dict | None = None) -> dict:
        if message is not None:
            self.conn.send(message)
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"the {self.name} worker died (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} worker gave no answer in {WORKER_TIMEOUT_S} s")
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send({"stop": True})
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


def ratio_spread(ratios: list[float]) -> dict:
    """Median, quartiles, min and max of per-step ratios."""
    if len(ratios) < 2:
        return {"median": ratios[0], "q1": ratios[0], "q3": ratios[0], "min": ratios[0], "max": ratios[0]}
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3, "min": min(ratios), "max": max(ratios)}


def measure_size(size: str, model: str, args, work_root: Path, *, new_tokens: int, steps: int,
                 longtail_mean: float = 0.0, micro_batch_tokens: int | None = None) -> dict:
    """Interleaved blocks of steps on both sides for one model size; medians, splits and the ratios' spread."""
    total = args.warmup + steps + (args.profile_steps if args.profile else 0)
    blocks = [args.warmup] + [args.block] * (steps // args.block) + (
        [steps % args.block] if steps % args.block else [])
    settings = BenchSettings(model=model, prompts=args.prompts, group=args.group, new_tokens=new_tokens,
                             threads=args.threads, seed=args.seed, total_steps=total,
                             work_dir=str(work_root / size), longtail_mean=longtail_mean,
                             micro_batch_tokens=micro_batch_tokens)
    load_before = os.getloadavg()[0]
    ours = Worker("ours", ours_worker, settings)
    theirs = Worker("trl", trl_worker, settings)
    try:
        ready = {"ours": ours.ask(), "trl": theirs.ask()}
        times: dict[str, list[dict]] = {"ours": [], "trl": []}
        threads_seen = {"ours": {ready["ours"]["threads"]}, "trl": {ready["trl"]["threads"]}}
        for index, steps in enumerate(blocks):
            order = (ours, theirs) if index % 2 == 0 else (theirs, ours)
            for worker in order:
                answer = worker.ask({"steps": steps})
                threads_seen[worker.name].add(answer["threads"])
                times[worker.name].extend(answer["times"])
        profile = ours.ask({"profile": args.profile_steps})["profile"] if args.profile else None
    finally:
        ours.stop()
        theirs.stop()
    first = {name: times[name][0]["prompts"] for name in times}
    if first["ours"] != first["trl"]:
        raise RuntimeError(f"the two sides saw different prompts at step 1: {first['ours'][:3]} vs {first['trl'][:3]}")
    if longtail_mean:  # both sides decoded the drawn lengths, completion by completion
        for name in ("ours", "trl"):
            for call, t in enumerate(times[name], start=1):
                if t["response_lengths"] != forced_lengths(settings, call):
                    raise RuntimeError(f"{name}: step {call}'s response lengths differ from the drawn ones")
    else:
        expected_tokens = args.prompts * args.group * new_tokens
        lengths = {t["response_tokens"] for t in times["ours"]}
        if lengths != {expected_tokens}:
            raise RuntimeError(f"our completions held {sorted(lengths)} tokens per step, expected {expected_tokens}")
    timed = {name: runs[args.warmup:] for name, runs in times.items()}

    def median(name: str, key: str) -> float:
        return statistics.median(t[key] for t in timed[name])

    result = {
        "model": model, "ours_s": median("ours", "total"), "trl_s": median("trl", "total"),
        "ours_split_s": {k: median("ours", k) for k in ("generate", "score", "train", "other")},
        "trl_split_s": {k: median("trl", k) for k in ("generate", "score", "train")},
        "ours_s_all": [t["total"] for t in timed["ours"]], "trl_s_all": [t["total"] for t in timed["trl"]],
        "new_tokens": new_tokens, "steps_timed": len(timed["ours"]), "warmup_steps": args.warmup, "block": args.block,
        "speedup_per_step": ratio_spread([t["total"] / o["total"] for o, t in zip(timed["ours"], timed["trl"])]),
        "threads": {name: sorted(seen) for name, seen in threads_seen.items()},
        "first_ratio_ours": times["ours"][-1]["first_ratio"],
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "versions": {"torch": ready["ours"]["torch"], "trl": ready["trl"]["trl"],
                     "transformers": ready["trl"]["transformers"]},
    }
    result["speedup"] = result["trl_s"] / result["ours_s"]
    if longtail_mean:
        drawn = [n for call in range(args.warmup + 1, args.warmup + steps + 1) for n in forced_lengths(settings, call)]
        result["longtail"] = {
            "distribution": f"exponential, mean {longtail_mean:g}, rounded up, cut at {new_tokens}",
            "response_mean": statistics.mean(drawn), "response_p90": statistics.quantiles(drawn, n=10)[-1],
            "response_max": max(drawn), "micro_batch_tokens": micro_batch_tokens,
            "train_tokens_per_real_token": {name: median(name, "train_tokens_per_real_token") for name in timed}}
    if profile is not None:
        result["profile"] = profile
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small,long,longtail",
                        help="comma list of tiny, small, long, longtail; the first is the main one")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per side and size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument("--block", type=int, default=2, help="steps per turn before the other side runs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each side (1: see the module docstring)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--long-new-tokens", type=int, default=128, help="new tokens per completion of size long")
    parser.add_argument("--long-steps", type=int, default=6, help="timed steps per side of size long")
    parser.add_argument("--longtail-new-tokens", type=int, default=192,
                        help="longest response of size longtail (its lengths are drawn: --longtail-mean)")
    parser.add_argument("--longtail-mean", type=float, default=32.0,
                        help="mean response of size longtail (exponential, cut at --longtail-new-tokens)")
    parser.add_argument("--longtail-steps", type=int, default=6, help="timed steps per side of size longtail")
    parser.add_argument("--longtail-micro-batch-tokens", type=int, default=4096,
                        help="our parallel.micro_batch_tokens in size longtail (packed training)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--profile", action="store_true", help="also cProfile our step and print the top")
    parser.add_argument("--profile-steps", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(s not in SIZES for s in sizes):
        parser.error(f"--sizes takes a comma list of {', '.join(SIZES)}")
    if not 0 < args.longtail_mean <= args.longtail_new_tokens / 4:
        parser.error("--longtail-mean must be positive and at most a quarter of --longtail-new-tokens")
    if min(args.steps, args.block, args.threads, args.long_steps, args.long_new_tokens) < 1 or args.warmup < 1:
        parser.error("--steps, --long-steps, --long-new-tokens, --block, --threads and --warmup must be >= 1")

    with tempfile.TemporaryDirectory(prefix="grpo_step_bench_") as tmp:
        work_root = Path(tmp)
        small_yaml = work_root / "small-cpu-bench.yaml"
        small_yaml.write_text(SMALL_SHAPE_YAML)
        long_yaml = work_root / "small-cpu-bench-long.yaml"  # the same model, with room for long responses
        long_yaml.write_text(SMALL_SHAPE_YAML.replace("seq_length: 64", "seq_length: 512").replace(
            "max_position_embeddings: 128", "max_position_embeddings: 512"))
        models = {"tiny": "tiny-cpu", "small": str(small_yaml), "long": str(long_yaml), "longtail": str(long_yaml)}
        results = {}
        for size in sizes:
            if size == "longtail":
                results[size] = measure_size(size, models[size], args, work_root, new_tokens=args.longtail_new_tokens,
                                             steps=args.longtail_steps, longtail_mean=args.longtail_mean,
                                             micro_batch_tokens=args.longtail_micro_batch_tokens)
            else:
                long = size == "long"
                results[size] = measure_size(size, models[size], args, work_root,
                                             new_tokens=args.long_new_tokens if long else args.new_tokens,
                                             steps=args.long_steps if long else args.steps)
            results[size]["model"] = size if size == "tiny" else "small-cpu-bench (hidden 256, 4 layers, vocab 512)"

    print(f"GRPO step, {args.prompts} prompts x {args.group} completions, fp32, {args.threads} torch threads per "
          f"side, medians after {args.warmup} warm-up steps, blocks of {args.block} alternating")
    for size, r in results.items():
        o, t, spread = r["ours_split_s"], r["trl_split_s"], r["speedup_per_step"]
        print(f"{size:6} {r['new_tokens']} new tokens, {r['steps_timed']} steps")
        print(f"{'':6} ours {r['ours_s']:.4f} s (generate {o['generate']:.4f}, score {o['score']:.4f}, "
              f"train {o['train']:.4f}, other {o['other']:.4f})")
        print(f"{'':6} TRL  {r['trl_s']:.4f} s (generate {t['generate']:.4f}, score {t['score']:.4f}, "
              f"train+rest {t['train']:.4f})")
        print(f"{'':6} speedup TRL/ours {r['speedup']:.2f}; per step median {spread['median']:.2f}, quartiles "
              f"{spread['q1']:.2f}..{spread['q3']:.2f}, range {spread['min']:.2f}..{spread['max']:.2f}")
        if "longtail" in r:
            lt = r["longtail"]
            print(f"{'':6} responses {lt['distribution']}: mean {lt['response_mean']:.1f}, p90 "
                  f"{lt['response_p90']:.0f}, max {lt['response_max']}; training computes "
                  f"{lt['train_tokens_per_real_token']['ours']:.3f} tokens per real token (ours, packed in "
                  f"{lt['micro_batch_tokens']}-token micro-batches) against "
                  f"{lt['train_tokens_per_real_token']['trl']:.3f} (TRL, padded)")
        if "profile" in r:
            print(f"--- cProfile of our step ({size}, {args.profile_steps} steps, {r['profile']['wall_s']:.2f} s)")
            print(r["profile"]["cumulative"])
            print(r["profile"]["tottime"])
    main_size = sizes[0]
    summary = {
        "benchmark": "grpo_step", "main_size": main_size, "speedup": results[main_size]["speedup"],
        "speedups": {size: r["speedup"] for size, r in results.items()},
        "speedup_spreads": {size: r["speedup_per_step"] for size, r in results.items()},
        "train_tokens_per_real_token": results["longtail"]["longtail"]["train_tokens_per_real_token"]
        if "longtail" in results else None,
        "settings": {"prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
                     "long_new_tokens": args.long_new_tokens, "threads": args.threads, "steps": args.steps,
                     "long_steps": args.long_steps, "warmup": args.warmup, "block": args.block,
                     "longtail_new_tokens": args.longtail_new_tokens, "longtail_mean": args.longtail_mean,
                     "longtail_steps": args.longtail_steps,
                     "longtail_micro_batch_tokens": args.longtail_micro_batch_tokens,
                     "dtype": "fp32", "lr": LEARNING_RATE, "eos": "disabled (exact new_tokens per completion)"},
        "sizes": {size: {k: v for k, v in r.items() if k != "profile"} for size, r in results.items()},
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
