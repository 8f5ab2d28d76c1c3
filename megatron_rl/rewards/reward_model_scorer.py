"""Score (prompt, completion) pairs with a trained reward model held in the SAME processes as the policy.

``RewardModelScorer(checkpoint)`` reads the model shape, tokenizer and max length that the rm trainer stored in
the checkpoint (``extra["reward_model"]``), builds the reward model at the running job's layout (its TP, PP and
VPP from Megatron's parallel state; the checkpoint reshards on load), loads the weights and keeps them frozen.
A reward model trained with ``model.lora`` is rebuilt with the same adapters (the settings the checkpoint records
in ``extra["lora"]``) and scores with them, in eval mode (no adapter dropout).
Calling it is the batched reward-fn signature of ``megatron_rl.rewards``:

    scorer = RewardModelScorer("runs/rm_tiny/checkpoints")
    rewards = scorer(prompts, completions, answers)  # list[float], one per completion, on every rank

The call is COLLECTIVE: every rank of the job calls it with the same lists. Items are split over the
data-parallel ranks, run forward-only through the pipeline (no grad), and the rewards are shared back so that
every rank returns all of them. With ``micro_batch_tokens`` (the job's parallel.micro_batch_tokens) the rows are
packed into micro-batches of that many tokens, as the training forwards pack theirs (rollout/packing.py
``pack_rows``; each row attending within itself, its reward read at its last token); else right-padded
micro-batches of ``micro_batch_size`` rows. Sequences are formed exactly as in training (``SequenceEncoder``) and
cut to the RM's max length keeping the end. Registered in the rewards registry as ``rm`` (options: checkpoint, ...).

Test: `.venv/bin/python -m pytest tests/test_rm.py -q -k scorer`
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.preferences import SequenceEncoder
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.models.builder import ModelOptions, compute_dtype
from megatron_rl.models.reward_model import (
    build_reward_model_chunks,
    load_reward_model_weights,
    packed_reward_batch,
    padded_length,
    reward_forward,
    right_padded_batch,
    value_forward,
)
from megatron_rl.rewards.registry import register_reward, registered_rewards
from megatron_rl.runtime.checkpoint import preserved_rng
from megatron_rl.runtime.distributed import collective_device, current_dims
from megatron_rl.spec.config.schema import LoraConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape


def read_reward_model_metadata(checkpoint: str | Path) -> tuple[Path, dict, Optional[LoraConfig]]:
    """(step folder, the ``reward_model`` metadata the rm trainer stored, the model.lora its adapters were trained
    with or None); ConfigError when it is not an RM."""
    from megatron.core import dist_checkpointing

    from megatron_rl.models.lora import stored_lora_config
    from megatron_rl.runtime.checkpoint import resolve_checkpoint

    try:
        folder = resolve_checkpoint(checkpoint)
    except FileNotFoundError as err:
        raise ConfigError(f"algorithm.reward_model: {err}") from None
    common = dist_checkpointing.load_common_state_dict(str(folder))
    meta = (common.get("extra") or {}).get("reward_model")
    if meta is None:
        raise ConfigError(f"algorithm.reward_model={checkpoint}: {folder} is not a reward-model checkpoint "
                          "(train one with algorithm.name=rm)")
    return folder, meta, stored_lora_config(common.get("extra"))


class RewardModelScorer:
    """A frozen reward model colocated with the policy; ``scorer(prompts, completions, answers) -> list[float]``."""

    def __init__(self, checkpoint: str, *, micro_batch_size: int = 8, micro_batch_tokens: Optional[int] = None,
                 tokenizer: Optional[str] = None, dtype: str = "auto", sequence_parallel: bool = False,
                 max_length: Optional[int] = None, transformer_engine: Optional[bool] = None,
                 attention: str = "auto") -> None:
        """``checkpoint``: an rm run's checkpoint folder (or a step folder). ``micro_batch_size``: sequences per
        forward; ``micro_batch_tokens``: instead, tokens per packed forward. ``tokenizer``: override the stored
        tokenizer folder. ``dtype``: auto (bf16 on GPUs, fp32 on CPU), fp32, bf16 or fp16. ``sequence_parallel``: as the job's parallel.sequence_parallel (MoE with TP > 1).
        ``max_length``: override the stored max length. ``transformer_engine`` (None: whether TE is usable) and
        ``attention``: the job's runtime.* layers, which the policy's must match (TE's attention backend is one
        per process)."""
        if micro_batch_size < 1:
            raise ConfigError(f"reward model scorer: micro_batch_size={micro_batch_size} must be >= 1")
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ConfigError(f"reward model scorer: micro_batch_tokens={micro_batch_tokens} must be >= 1")
        self.folder, meta, lora = read_reward_model_metadata(checkpoint)
        self.shape = ModelShape.from_dict(meta["shape"])
        self.max_length = int(max_length or meta["max_length"])
        loaded = load_tokenizer(tokenizer if tokenizer is not None else meta.get("tokenizer"),
                                trust_remote_code=bool(meta.get("trust_remote_code", False)))
        # pairs are scored in the chat format the reward model was trained with (older checkpoints: plain text)
        self.encoder = SequenceEncoder(loaded, ChatFormat(loaded, chat_template=bool(meta.get("chat_template")),
                                                          system_prompt=meta.get("system_prompt")))
        self.micro_batch_size, self.micro_batch_tokens = micro_batch_size, micro_batch_tokens
        dims = current_dims()
        dims = dataclasses.replace(dims, sp=sequence_parallel and dims.tp > 1).with_split(self.shape.num_layers)
        dims.check_model(self.shape)
        pp = dims.pp
        self.opts = ModelOptions(dims=dims, dtype=compute_dtype(dtype), seq_length=self.max_length,
                                 attention=attention, lora=lora,
                                 **({} if transformer_engine is None else {"transformer_engine": transformer_engine}))
        self.multiple = dims.tp if dims.sp else 1
        self.fixed_length = padded_length(self.max_length, multiple=self.multiple) if pp > 1 else None
        with preserved_rng():
            self.chunks = build_reward_model_chunks(self.shape, self.opts)
        if not load_reward_model_weights(self.folder, self.chunks):
            raise ConfigError(f"algorithm.reward_model={checkpoint}: {self.folder} has no rm_head weights")
        for chunk in self.chunks:
            chunk.eval()
            chunk.config.calculate_per_token_loss = True
            for param in chunk.parameters():
                param.requires_grad_(False)

    def encode(self, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
        """Token ids the reward model reads for each (prompt, completion), cut to max_length keeping the end."""
        return [self.encoder.fit(self.encoder.encode(p, c), self.max_length) for p, c in zip(prompts, completions)]

    def __call__(self, prompts: list[str], completions: list[str], answers: list[Any]) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        return self.score_ids(self.encode(prompts, completions))

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]]) -> list[float]:
        """Rewards of token sequences (collective; every rank passes the same list and gets all rewards)."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        count = len(seqs)
        if count == 0:
            return []
        batches, rows = self._packed(seqs) if self.micro_batch_tokens is not None else self._padded(seqs)
        iterator = iter(batches) if len(self.chunks) == 1 else [iter(batches) for _ in self.chunks]
        outputs = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iterator, model=self.chunks,
            num_microbatches=len(batches), seq_length=max(b["tokens"].shape[1] for b in batches),
            micro_batch_size=batches[0]["tokens"].shape[0], forward_only=True)
        device = collective_device(ps.get_data_parallel_group())
        # each row is scored on one data-parallel rank, by its last pipeline stage: a sum over both shares them
        scores = torch.zeros(count, dtype=torch.float32, device=device)
        if outputs:
            picked = torch.cat([out["rewards"] for out in outputs]).to(device, torch.float32)
            index = torch.tensor(rows, dtype=torch.long, device=device)
            scores[index[index >= 0]] = picked[index >= 0]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(scores, group=ps.get_pipeline_model_parallel_group())
        torch.distributed.all_reduce(scores, group=ps.get_data_parallel_group())
        return scores.tolist()

    def _interleaved_multiple(self) -> int:
        """Micro-batches the schedule takes in groups of: pp under interleaved pipelining."""
        return self.opts.dims.pp if self.opts.dims.vpp > 1 else 1

    def _padded(self, seqs: list[list[int]]) -> tuple[list[dict], list[int]]:
        """This data-parallel rank's right-padded micro-batches of ``micro_batch_size`` rows, and each row's place
        in ``seqs`` (-1: a filler copy)."""
        from megatron.core import parallel_state as ps

        count, mbs = len(seqs), self.micro_batch_size
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        group = mbs * self._interleaved_multiple()
        per_rank = -(-count // (dp * group)) * group
        places = [i if i < count else -1 for i in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)]
        batches = []
        for start in range(0, per_rank, mbs):
            micro = [seqs[max(i, 0)] for i in places[start:start + mbs]]
            length = padded_length(max(len(s) for s in micro), fixed=self.fixed_length, multiple=self.multiple)
            batches.append(right_padded_batch(micro, pad_id=self.encoder.pad_id, length=length))
        return batches, places

    def _packed(self, seqs: list[list[int]]) -> tuple[list[dict], list[int]]:
        """This data-parallel rank's packed micro-batches of ``micro_batch_tokens``, and each row's place in
        ``seqs`` (-1: a filler copy); every rank runs as many, all at one length."""
        from megatron.core import parallel_state as ps

        from megatron_rl.rollout.packing import pack_rows, source_row

        per_rank, length = pack_rows([len(s) for s in seqs], dp=ps.get_data_parallel_world_size(),
                                     token_budget=self.micro_batch_tokens, multiple=self.multiple,
                                     count_multiple=self._interleaved_multiple())
        thd = self.opts.takes_packed_sequences(self.shape)
        batches, places = [], []
        for bin_ in per_rank[ps.get_data_parallel_rank()]:
            batches.append(packed_reward_batch([seqs[source_row(i)] for i in bin_],
                                               pad_id=self.encoder.pad_id, length=length, thd=thd))
            places += [i if i >= 0 else -1 for i in bin_]
        return batches, places


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    forward = value_forward if "last_position" in batch else reward_forward  # packed: the head at every position
    return forward(model, batch), partial(_collect, batch=batch)


def _collect(output: torch.Tensor, batch: dict):
    rewards = output[0, batch["last_position"]] if "last_position" in batch else output
    return rewards.sum(), torch.tensor(rewards.shape[0], dtype=torch.int), {"rewards": rewards.detach()}


if "rm" not in registered_rewards():
    register_reward("rm", RewardModelScorer)
