"""The teacher of on-policy distillation (``algorithm.teacher``): a frozen model from another run's checkpoint,
held in the training processes, that scores the student's own samples token by token.

    teacher = Teacher(cfg.algorithm.teacher, engine=engine, tokenizer=tokenizer)
    teacher.logprobs(minibatches)   # per mini-batch, each micro-batch's teacher log-probs

Where it runs, and why: colocated, in the training processes at the job's tp, pp and cp (its own pipeline split
of its own layers, resharded at load by Megatron's distributed checkpointing), like the reference model. Its
forward is one pass over the rollout per step, which needs no process of its own, and Megatron's parallel state
is one per process, so a teacher at another tp would need its own processes and a transfer of the rollout and
log-probs (the split placement of ``cluster.rollout_tasks`` is where such a teacher would live). With
``offload`` (default) its weights wait in host memory outside ``logprobs`` (``runtime.phases.HostOffload``),
so generation's KV cache and training's activations have the device memory; the planner counts the copies.

The teacher's model is what its run recorded in the checkpoint (``extra["model"]``); its tokenizer must give the
student's tokens the same ids (``same_tokenizer``), else the job stops with one line naming the key. A teacher
trained with ``model.lora`` scores with its adapters.

Test: `.venv/bin/python -m pytest tests/test_distillation.py -q`
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping

import torch

from megatron_rl.models import unwrap
from megatron_rl.runtime.phases import HostOffload
from megatron_rl.spec.config.algorithm import TeacherConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.model_shape import ModelShape

KEY = "algorithm.teacher.checkpoint"


def read_teacher_record(checkpoint: str) -> tuple:
    """(step folder, the checkpoint's ``extra``, which records the model under "model") of a teacher checkpoint;
    ConfigError naming the key when it is missing, not a policy, or does not record its model."""
    from megatron.core import dist_checkpointing

    from megatron_rl.runtime.checkpoint import resolve_checkpoint

    try:
        folder = resolve_checkpoint(checkpoint)
    except FileNotFoundError as err:
        raise ConfigError(f"{KEY}: {err}") from None
    extra = dist_checkpointing.load_common_state_dict(str(folder)).get("extra") or {}
    if "reward_model" in extra:
        raise ConfigError(f"{KEY}={checkpoint}: {folder} is a reward model, not a policy; give a checkpoint of an "
                          "sft, grpo, ppo or dpo run")
    if not extra.get("model"):
        raise ConfigError(f"{KEY}={checkpoint}: {folder} does not record its model (a checkpoint of this "
                          "project's trainers does); give one, or import the teacher (launch.py convert hf-to-megatron)")
    return folder, extra


class Teacher:
    """A frozen teacher model at the job's layout; ``logprobs`` scores micro-batches."""

    def __init__(self, settings: TeacherConfig, *, engine, tokenizer) -> None:
        from megatron_rl.data.tokenizer import load_tokenizer, same_tokenizer
        from megatron_rl.models.builder import build_model_chunks
        from megatron_rl.models.lora import stored_lora_config
        from megatron_rl.runtime.checkpoint import load_checkpoint, preserved_rng

        self.folder, extra = read_teacher_record(settings.checkpoint)
        self.shape = ModelShape.from_dict(extra["model"]["shape"])
        recorded_tokenizer = extra["model"].get("tokenizer_dir")
        teacher_tokenizer = load_tokenizer(recorded_tokenizer, trust_remote_code=False)
        if not same_tokenizer(teacher_tokenizer, tokenizer):
            raise ConfigError(f"{KEY}={settings.checkpoint}: the teacher's tokenizer ({recorded_tokenizer or 'the '
                              'built-in character one'}) does not match model.tokenizer ({tokenizer.name}); "
                              "distillation compares log-probs of the same tokens, so give a teacher trained with "
                              "the student's tokenizer")
        dims = dataclasses.replace(engine.opts.dims, first_stage_layers=None, last_stage_layers=None,
                                   account_for_embedding=False, account_for_loss=False,
                                   pipeline_layout=None).with_split(self.shape.num_layers)
        try:
            dims.check_model(self.shape)
        except ConfigError as err:
            raise ConfigError(f"{KEY}: the teacher {self.shape.name} at the job's layout: {err}") from None
        self.opts = dataclasses.replace(engine.opts, dims=dims, lora=stored_lora_config(extra), router_replay=False,
                                        recompute="none", recompute_num_layers=None)
        with preserved_rng():
            self.chunks = build_model_chunks(self.shape, self.opts)
        load_checkpoint(self.folder, chunks=self.chunks, load_optimizer=False, load_rng=False)
        for chunk in self.chunks:
            chunk.eval()
            chunk.requires_grad_(False)
        self.parked = HostOffload(keep_values=True) if settings.offload else None
        self._park()

    def parameters(self) -> list[torch.Tensor]:
        return [p for chunk in self.chunks for p in unwrap(chunk).parameters()]

    def _park(self) -> None:
        if self.parked is not None:
            params = self.parameters()
            self.parked.offload(params, device=params[0].device, protected=set())

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """The teacher's weights on the device for the block (back in host memory after it, with ``offload``)."""
        if self.parked is not None:
            self.parked.restore()
        try:
            yield
        finally:
            self._park()

    def logprobs(self, minibatches: list[list[Mapping]]) -> list[list]:
        """Per mini-batch, each micro-batch's teacher log-probs of its labels (on the last pipeline stage, the
        only one that computes the loss; empty elsewhere), in one residency of its weights for the whole rollout."""
        from megatron_rl.runtime.training import forward_logprobs

        with self.resident():
            return [forward_logprobs(self.chunks, microbatches, seq_length=microbatches[0]["tokens"].shape[1])
                    for microbatches in minibatches]
