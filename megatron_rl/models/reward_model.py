"""A Megatron Core reward model: the GPT trunk plus a scalar head read at the LAST REAL token of each sequence.

``GPTRewardModel`` is a ``GPTModel`` whose last pipeline stage has no vocabulary projection; instead
``rm_head`` (a ``RowParallelLinear`` hidden -> 1 with bias, ``input_is_parallel=False``, as in NeMo-Aligner)
maps the final-normed hidden state of each sequence's last real token to one reward. Under tensor parallelism
each rank holds ``hidden / tp`` input columns of the head and the partial products are all-reduced, so the
reward is the same at every TP size. Earlier pipeline stages return hidden states as usual.

Checkpoint keys (our ``torch_dist`` format, global shapes): every trunk key of the policy (``embedding.*``,
``decoder.*``; ``decoder.final_layernorm.weight``) plus ``rm_head.weight`` [1, hidden] (sharded on dim 1
under TP) and ``rm_head.bias`` [1] (replicated). There is no ``output_layer.weight``. Loading a policy or
HF-imported checkpoint fills the trunk and leaves the head freshly initialised (``load_reward_model_weights``).

``last_index=None`` reads the head at every position instead: values [batch, seq], the per-token mode that PPO's
critic uses (``value_forward``).

Batches are right-padded (real tokens first): the causal mask then keeps padding out of every real token's
view on every attention backend, and no attention mask is needed. Left padding works with the local (CPU)
spec when an explicit causal-and-padding mask is passed; ``last_token_index`` handles either.

Test: `.venv/bin/python -m pytest tests/test_rm.py -q`
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.models.builder import ModelOptions, build_gpt_model
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape

HEAD_NAME = "rm_head"
HEAD_KEYS = (f"{HEAD_NAME}.weight", f"{HEAD_NAME}.bias", f"{HEAD_NAME}._extra_state")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """[batch] index of the last position where ``mask`` [batch, seq] is true (left or right padding).

    A row with no real token gets index 0 (its reward is meaningless; callers never produce such rows).
    """
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).max(dim=1).values


def pick_last_tokens(hidden: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """[batch, hidden] rows of ``hidden`` [seq, batch, hidden] (Megatron's layout) at ``last_index`` [batch]."""
    batch = torch.arange(hidden.shape[1], device=hidden.device)
    return hidden[last_index.to(hidden.device), batch]


def padded_length(longest: int, *, fixed: Optional[int] = None, multiple: int = 1) -> int:
    """Length to pad a micro-batch to: ``fixed`` (pipeline stages exchange fixed shapes) or the longest row,
    rounded up to ``multiple`` (the TP size under sequence parallelism)."""
    length = fixed if fixed is not None else longest
    if length < longest:
        raise ValueError(f"a sequence of {longest} tokens does not fit the fixed length {length}")
    return -(-length // multiple) * multiple


def right_padded_batch(seqs: list[list[int]], *, pad_id: int, length: int) -> dict:
    """A reward-model micro-batch: tokens [batch, length] right-padded, position_ids, last_index [batch]."""
    tokens = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    for row, ids in enumerate(seqs):
        tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    batch = {"tokens": tokens, "position_ids": torch.arange(length).unsqueeze(0).expand_as(tokens).contiguous(),
             "last_index": torch.tensor([len(ids) - 1 for ids in seqs], dtype=torch.long)}
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    return batch


def packed_reward_batch(seqs: list[list[int]], *, pad_id: int, length: int, thd: bool) -> dict:
    """A packed reward-model micro-batch: the rows one after another in tokens [1, length] (each at its own
    positions, attending within itself: ``packed_sequences.attention_inputs``), and ``last_position`` [rows], where
    each row's reward is read."""
    from megatron_rl.models.packed_sequences import attention_inputs, with_padding_segments

    if sum(map(len, seqs)) > length:
        raise ValueError(f"{sum(map(len, seqs))} tokens do not fit a packed micro-batch of {length}")
    tokens = torch.full((1, length), pad_id, dtype=torch.long)
    position_ids = torch.zeros((1, length), dtype=torch.long)
    starts = [0]
    for ids in seqs:
        start, n = starts[-1], len(ids)
        tokens[0, start:start + n] = torch.tensor(ids, dtype=torch.long)
        position_ids[0, start:start + n] = torch.arange(n)
        starts.append(start + n)
    last = torch.tensor(starts[1:], dtype=torch.long) - 1
    starts = with_padding_segments(starts, length)
    batch = {"tokens": tokens, "position_ids": position_ids, "last_position": last}
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    return {**batch, **attention_inputs(starts, thd=thd, device=batch["tokens"].device)}


def causal_padding_mask(mask: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] boolean attention mask (True = blocked): causal, and no attention to padding keys.

    For left-padded batches on the local spec. Padding query rows attend to themselves so softmax stays finite.
    """
    seq = mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).triu(1)
    blocked = causal.unsqueeze(0) | ~mask.bool().unsqueeze(1)
    blocked = blocked & ~torch.eye(seq, dtype=torch.bool, device=mask.device).unsqueeze(0)
    return blocked.unsqueeze(1)


def _gpt_model_class():
    from megatron.core.models.gpt import GPTModel

    class GPTRewardModel(GPTModel):
        """GPTModel trunk + ``rm_head``; forward returns rewards [batch] (float32) on the last stage."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if not self.post_process:
                return
            from megatron.core import tensor_parallel

            del self.output_layer  # the vocabulary projection is not part of a reward model
            head_config = copy.copy(self.config)
            head_config.sequence_parallel = False  # the head sees the gathered last-token states, not a sequence
            setattr(self, HEAD_NAME, tensor_parallel.RowParallelLinear(
                self.config.hidden_size, 1, config=head_config, init_method=self.config.init_method, bias=True,
                input_is_parallel=False, skip_bias_add=False))

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
            """Every submodule's sharded tensors (LanguageModule's output-layer handling skipped: there is none)."""
            from megatron.core.transformer.module import MegatronModule
            from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

            assert not sharded_offsets, "unexpected sharded offsets at the model level"
            return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets,
                                                     ensure_metadata_has_dp_cp_group(metadata))

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    attention_mask: Optional[torch.Tensor] = None, *, last_index: Optional[torch.Tensor],
                    decoder_input: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
            """Rewards [batch] on the last pipeline stage, hidden states [seq, batch, hidden] elsewhere.
            ``last_index=None``: the head at every position, values [batch, seq] (PPO's critic; a packed
            micro-batch's rows as one sequence, ``packed_seq_params`` its THD boundaries)."""
            pre = self._preprocess(input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
                                   packed_seq_params=packed_seq_params)
            hidden = self.decoder(hidden_states=pre[0], attention_mask=attention_mask, rotary_pos_emb=pre[1],
                                  rotary_pos_cos=pre[2], rotary_pos_sin=pre[3], sequence_len_offset=pre[4],
                                  packed_seq_params=packed_seq_params)
            if not self.post_process:
                return hidden
            if self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                # Every TP rank then picks the same rows; the backward only splits the grad (no reduction).
                hidden = tensor_parallel.gather_from_sequence_parallel_region(
                    hidden, tensor_parallel_output_grad=False)
            if last_index is None:
                values, _ = getattr(self, HEAD_NAME)(hidden)  # [seq, batch, 1]
                return values.squeeze(-1).transpose(0, 1).float()
            picked = pick_last_tokens(hidden, last_index).unsqueeze(0)  # [1, batch, hidden]: Megatron's 3-D layout
            reward, _ = getattr(self, HEAD_NAME)(picked)
            return reward.reshape(-1).float()

    return GPTRewardModel


_MODEL_CLASS = None


def reward_model_class():
    """The GPTRewardModel class (built lazily so importing this module does not import megatron)."""
    global _MODEL_CLASS
    if _MODEL_CLASS is None:
        _MODEL_CLASS = _gpt_model_class()
    return _MODEL_CLASS


def build_reward_model(shape: ModelShape, opts: ModelOptions, *, vp_stage: Optional[int] = None,
                       pre_process: Optional[bool] = None, post_process: Optional[bool] = None):
    """One reward-model chunk of ``shape`` for this rank's pipeline stage (and virtual stage ``vp_stage``)."""
    if opts.dims.cp > 1:
        raise ConfigError(f"parallel.cp={opts.dims.cp}: the reward model does not support context parallelism yet; "
                          "set parallel.cp=1")
    # No output layer to tie; the embedding key is unchanged.
    return build_gpt_model(shape, opts, vp_stage=vp_stage, pre_process=pre_process, post_process=post_process,
                           model_class=reward_model_class(), tie_embeddings=False)


def build_reward_model_chunks(shape: ModelShape, opts: ModelOptions) -> list:
    """All reward-model chunks this rank holds (vpp of them with interleaved pipelining); for ``build_engine``."""
    if opts.dims.vpp > 1:
        return [build_reward_model(shape, opts, vp_stage=i) for i in range(opts.dims.vpp)]
    return [build_reward_model(shape, opts)]


def reward_forward(model, batch: dict) -> torch.Tensor:
    """``forward_fn`` for ``Engine.train_step``/``forward_only``: rewards [batch] (or hidden states mid-pipeline)."""
    return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), last_index=batch["last_index"])


def value_forward(model, batch: dict) -> torch.Tensor:
    """``forward_fn`` of a critic: the head at every position, values [batch, seq] (or hidden states mid-pipeline;
    a packed micro-batch's [1, T]: ``packed_sequences.as_rows`` gives its rows)."""
    from megatron_rl.models.packed_sequences import packed_forward_kwargs

    return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), last_index=None,
                 **packed_forward_kwargs(batch))


def load_reward_model_weights(path: str | Path, chunks: list) -> bool:
    """Load model weights from a checkpoint into reward-model ``chunks``; returns whether the head was loaded.

    A reward-model checkpoint fills everything. A policy (or HF-imported) checkpoint fills the trunk; the head
    keeps its fresh initialisation and the policy's ``output_layer`` is not read. Any other missing key is an
    error that names it.
    """
    from megatron.core import dist_checkpointing

    from megatron_rl.models import unwrap
    from megatron_rl.models.lora import adapters, is_adapter_key
    from megatron_rl.runtime.checkpoint import checkpoint_tensor_keys, resolve_checkpoint

    try:
        folder = resolve_checkpoint(path)
    except FileNotFoundError as err:
        raise ConfigError(f"{err}; point model.init_from / algorithm.reward_model at a checkpoint folder") from None
    stored = checkpoint_tensor_keys(folder)
    if any(is_adapter_key(key) for key in stored) and next(adapters(chunks), None) is None:
        raise ConfigError(f"checkpoint {folder} holds LoRA adapters and this model has none, so they would be "
                          "dropped; set the model.lora it was trained with (eval, a PPO critic), or train the reward "
                          "model without model.lora")
    request, skipped = {}, set()
    for i, chunk in enumerate(chunks):
        sharded = unwrap(chunk).sharded_state_dict()
        for name, item in list(sharded.items()):
            key = getattr(item, "key", None)
            if key is not None and key not in stored:
                if key not in HEAD_KEYS and not is_adapter_key(key):
                    raise ConfigError(f"checkpoint {folder} has no tensor {key!r}: it was saved from a different "
                                      "model shape; check model.name against the checkpoint")
                skipped.add(key)
                del sharded[name]
        request[f"model{i}"] = sharded
    loaded = dist_checkpointing.load(request, str(folder))
    for i, chunk in enumerate(chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        bad = [k for k in missing if not k.startswith(HEAD_NAME + ".") and not k.endswith("_extra_state")
               and not is_adapter_key(k)]
        if bad or unexpected:
            raise RuntimeError(f"loading {folder}: missing {bad}, unexpected {unexpected}")
    return not skipped
