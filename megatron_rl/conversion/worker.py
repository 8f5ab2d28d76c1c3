"""Conversion worker: one process per rank (torchrun), running a list of tasks at their own layouts.

    python -m torch.distributed.run --standalone --nproc-per-node N -m megatron_rl.conversion.worker TASKS.json

Started by ``megatron_rl.conversion.spawn.run_worker``; not meant to be run by hand. Tasks (JSON list):

* ``import``: build the model at (tp, pp, ep) on the meta device and save one of our checkpoints (step 0) into
  ``out``, each rank reading only its rows of the HF safetensors, one shard at a time, as it writes them
  (``streamed_save``).
* ``random``: a freshly initialised model (Megatron's own init) saved into ``out`` (test fixtures).
* ``reshard``: load ``ckpt`` at (tp, pp, ep) and save it again into ``out``.
* ``logits``: load ``ckpt`` at (tp, pp, ep), run ``tokens`` through the pipeline, save the full-vocabulary logits
  (and, for a reward model, the last-token rewards) to ``out_file``.

Each rank writes ``rank<R>.error`` into the work folder when a task fails; rank 0 writes ``result.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from megatron_rl.spec.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ST_TO_NAME = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", "0"))


def _model_source(task: dict[str, Any]):
    from megatron_rl.conversion.dist_reader import CheckpointReader
    from megatron_rl.conversion.export import resolve_model_source

    reader = CheckpointReader(task["ckpt"])
    return resolve_model_source(reader.folder, task.get("model"), reader.common_state()), reader


def run_import(task: dict[str, Any]) -> dict[str, Any]:
    from megatron_rl.conversion.export import HF_CONFIG_FILE, HF_TOKENIZER_DIR, model_metadata
    from megatron_rl.conversion.model_build import build_conversion_model
    from megatron_rl.conversion.names import shape_from_config
    from megatron_rl.conversion.safetensors_io import HFCheckpoint, copy_tokenizer_files
    from megatron_rl.conversion.streamed_save import HFShardReader, StreamedSaveStrategy
    from megatron_rl.runtime.checkpoint import save_checkpoint

    hf = HFCheckpoint.open(task["hf"])
    shape = shape_from_config(hf.config, str(Path(task["hf"]) / "config.json"), name=Path(task["hf"]).name)
    dtype = DTYPES[task.get("dtype") or ST_TO_NAME.get(hf.dtype(), "fp32")]
    model = build_conversion_model(shape, tp=task["tp"], pp=task["pp"], ep=task["ep"], dtype=dtype, meta=True)
    # FP8 weights are dequantized while read: the checkpoint (and what it exports) is unquantized
    hf_config = {k: v for k, v in hf.config.items() if k != "quantization_config"}
    extra = {"model": model_metadata(shape, hf_config), "converted_from": str(Path(task["hf"]).resolve())}
    try:
        folder = save_checkpoint(task["out"], step=0, chunks=[model], extra=extra, keep_last=1,
                                 sharded_strategy=StreamedSaveStrategy(HFShardReader(shape, hf)))
    finally:
        hf.close()
    if _rank() == 0:
        (folder / HF_CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        tok = folder / HF_TOKENIZER_DIR
        tok.mkdir(exist_ok=True)
        if not copy_tokenizer_files(Path(task["hf"]), tok):
            tok.rmdir()
    return {"folder": str(folder), "dtype": str(dtype).replace("torch.", "")}


def run_random(task: dict[str, Any]) -> dict[str, Any]:
    from megatron_rl.conversion.export import model_metadata
    from megatron_rl.conversion.model_build import build_conversion_model
    from megatron_rl.runtime.checkpoint import save_checkpoint
    from megatron_rl.spec.model_shape import load_model_shape

    shape = load_model_shape(task["model"])
    model = build_conversion_model(shape, tp=task["tp"], pp=task["pp"], ep=task["ep"], dtype=torch.float32,
                                   initialize=True)
    extra = {"model": model_metadata(shape)} if task.get("record_model", True) else {}
    folder = save_checkpoint(task["out"], step=task.get("step", 0), chunks=[model], extra=extra, keep_last=1)
    return {"folder": str(folder)}


def _load_model(task: dict[str, Any]):
    """The model at the task's layout, loaded the way trainers load (``runtime.checkpoint.load_checkpoint``);
    a reward-model checkpoint (no LM head) loads its trunk only."""
    from megatron.core import dist_checkpointing

    from megatron_rl.conversion.model_build import build_conversion_model
    from megatron_rl.runtime.checkpoint import load_checkpoint

    source, reader = _model_source(task)
    model = build_conversion_model(source.shape, tp=task["tp"], pp=task["pp"], ep=task["ep"], dtype=torch.float32)
    request = {"model0": model.sharded_state_dict()}
    stored = set(reader.metadata.state_dict_metadata)
    drop = [k for k, v in request["model0"].items() if getattr(v, "key", None) is not None and v.key not in stored
            and v.key.startswith("output_layer.")]
    if not drop:
        load_checkpoint(reader.folder, chunks=[model], load_optimizer=False)
        return model, source, reader
    for k in drop:
        request["model0"].pop(k)
    loaded = dist_checkpointing.load(request, str(reader.folder))
    missing, unexpected = model.load_state_dict(loaded["model0"], strict=False)
    bad = [k for k in missing if not k.startswith("output_layer.") and not k.endswith("_extra_state")]
    if bad or unexpected:
        raise ConfigError(f"{reader.folder}: does not fit the model (missing {bad[:3]}, unexpected {unexpected[:3]})")
    return model, source, reader


def run_reshard(task: dict[str, Any]) -> dict[str, Any]:
    from megatron_rl.runtime.checkpoint import save_checkpoint

    model, source, reader = _load_model(task)
    extra = reader.common_state().get("extra", {})
    folder = save_checkpoint(task["out"], step=0, chunks=[model], extra=extra, keep_last=1)
    return {"folder": str(folder)}


def _gather_tp(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    world = ps.get_tensor_model_parallel_world_size()
    if world == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def run_logits(task: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.conversion.names import REWARD_HEAD_BIAS, REWARD_HEAD_WEIGHT

    model, source, reader = _load_model(task)
    model.eval()
    tokens = torch.tensor(task["tokens"], dtype=torch.long)
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    hidden: list[torch.Tensor] = []
    if ps.is_pipeline_last_stage():
        model.decoder.register_forward_hook(lambda module, args, output: hidden.append(output))

    def loss_func(output, non_loss_data=False):
        return _gather_tp(output, dim=-1)

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        return chunk(tokens, positions, None), loss_func

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=seq, micro_batch_size=batch, forward_only=True, collect_non_loss_data=True)
    result: dict[str, Any] = {}
    if not ps.is_pipeline_last_stage():
        return result
    saved = {"logits": outputs[0][..., :source.shape.vocab_size].float().clone()}
    refs = {r.name: r for r in reader.index if r.name in (REWARD_HEAD_WEIGHT, REWARD_HEAD_BIAS)}
    if REWARD_HEAD_WEIGHT in refs:
        final = hidden[-1]
        if model.config.sequence_parallel:  # the decoder returns [seq/tp, batch, hidden]
            final = _gather_tp(final, dim=0)
        head = reader.read(refs.values(), dtype=torch.float32)
        saved["hidden_last"] = final[-1].float().clone()  # [batch, hidden] at the last position
        reward = saved["hidden_last"] @ head[refs[REWARD_HEAD_WEIGHT]].reshape(-1, 1)
        if REWARD_HEAD_BIAS in refs:
            reward = reward + head[refs[REWARD_HEAD_BIAS]].reshape(1, -1)
        saved["rewards"] = reward.reshape(-1)
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0:
        torch.save(saved, task["out_file"])
        result["written"] = task["out_file"]
    return result


TASKS = {"import": run_import, "random": run_random, "reshard": run_reshard, "logits": run_logits}


def _report(workdir: Path, kind: str, message: str) -> None:
    (workdir / f"rank{_rank()}.error").write_text(json.dumps({"kind": kind, "message": message}) + "\n")


def main(argv: list[str]) -> int:
    from megatron_rl.conversion.model_build import init_parallel

    tasks_file = Path(argv[0])
    workdir = tasks_file.parent
    tasks = json.loads(tasks_file.read_text())
    results = []
    try:
        for task in tasks:
            init_parallel(task["tp"], task["pp"], task["ep"], seed=task.get("seed", 0))
            results.append(TASKS[task["kind"]](task))
            torch.distributed.barrier()
    except ConfigError as exc:
        _report(workdir, "config", str(exc))
        return 2
    except BaseException as exc:  # the parent prints one line; the traceback goes to the worker log
        traceback.print_exc()
        _report(workdir, "internal", f"{type(exc).__name__}: {exc}".splitlines()[0])
        return 1
    if _rank() == 0:
        (workdir / "result.json").write_text(json.dumps(results) + "\n")
    from megatron_rl.runtime.distributed import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main(sys.argv[1:]))
