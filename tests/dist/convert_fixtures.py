"""Tiny random Hugging Face models of every converted family, and the torchrun entry of the conversion tests.

As a module: ``make_hf_model(kind, folder)`` builds a tiny model with ``transformers`` from a config in this file
(no downloads), gives every tensor random values (biases and norms included, so nothing is trivially zero or
one) and saves it as safetensors.

As a script (one torchrun job runs every Megatron-side task of tests/test_conversion.py):

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 tests/dist/convert_fixtures.py TASKS.json

it runs ``megatron_rl.conversion.worker`` with one more task kind, ``reward_fixture``: a reward model built by
``megatron_rl.models.reward_model`` (trunk filled in memory from an HF model by ``fill_from_hf``, a seeded
head), saved as one of our checkpoints, with the rewards that model computes on the given tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

COMMON = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
TINY_HF = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON, tie_word_embeddings=False, rope_theta=10000.0)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON, tie_word_embeddings=True, rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(COMMON, vocab_size=150, tie_word_embeddings=True,
                                                      rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, head_dim=32, tie_word_embeddings=False,
                                                      rope_theta=1000000.0)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
        norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1000000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        rope_theta=1000000.0)),
}
TOKENIZER_FILES = {"tokenizer_config.json": '{"model_max_length": 128}\n', "special_tokens_map.json": "{}\n"}


def make_hf_model(kind: str, folder: Path, *, seed: int = 0) -> Path:
    import torch
    import transformers

    config_cls, model_cls, kwargs = TINY_HF[kind]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    randomize_weights(model)
    folder = Path(folder)
    model.save_pretrained(str(folder))
    for name, text in TOKENIZER_FILES.items():
        (folder / name).write_text(text)
    return folder


def randomize_weights(model) -> None:
    """Random values for every parameter from torch's global RNG: norms around 1, embeddings wider."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.5 if "embed" in name else 0.15)


def sharded_tensors(model) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    return [sh for sh in nested_values(sd) if isinstance(sh, ShardedTensor)]


def fill_from_hf(model, shape, hf, *, skip_prefixes: tuple[str, ...] = ()) -> None:
    """Copy this rank's share of every parameter of an in-memory ``model`` from the HF checkpoint ``hf``, with
    the importer's reader; parameters and keys starting with ``skip_prefixes`` (a reward head) are left out."""
    import torch

    from megatron_rl.conversion.streamed_save import HFShardReader

    reader = HFShardReader(shape, hf)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
        for sh in sharded_tensors(model):
            if not sh.key.startswith(skip_prefixes):
                sh.data.copy_(reader.read(sh))
        unset = [name for name, p in model.named_parameters()
                 if not name.startswith(skip_prefixes) and torch.isnan(p).any()]
    assert not unset, f"{len(unset)} parameter(s) got no value from the HF checkpoint (first: {unset[0]})"


def run_reward_fixture(task: dict) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from megatron_rl.conversion.export import model_metadata
    from megatron_rl.conversion.names import shape_from_config
    from megatron_rl.conversion.safetensors_io import HFCheckpoint
    from megatron_rl.models.builder import ModelOptions
    from megatron_rl.runtime.distributed import current_dims
    from megatron_rl.models.reward_model import build_reward_model
    from megatron_rl.runtime.checkpoint import save_checkpoint

    hf = HFCheckpoint.open(task["hf"])
    shape = shape_from_config(hf.config, task["hf"])
    model = build_reward_model(shape, ModelOptions(dims=current_dims()))
    fill_from_hf(model, shape, hf, skip_prefixes=("rm_head.",))
    generator = torch.Generator().manual_seed(7)
    head = {"rm_head.weight": 0.3 * torch.randn(1, shape.hidden_size, generator=generator),
            "rm_head.bias": torch.tensor([0.25])}
    with torch.no_grad():
        for sh in sharded_tensors(model):
            if sh.key in head:
                rows = zip(sh.global_offset, sh.local_shape, strict=True)
                block = head[sh.key][tuple(slice(o, o + s) for o, s in rows)]
                sh.data.copy_(block)
    save_checkpoint(task["out"], step=0, chunks=[model], extra={"model": model_metadata(shape, hf.config)})
    tokens = torch.tensor(task["tokens"])
    batch, seq = tokens.shape
    with torch.no_grad():
        rewards = model.eval()(tokens, torch.arange(seq).expand(batch, seq), None,
                               last_index=torch.full((batch,), seq - 1))
    if torch.distributed.get_rank() == 0 and ps.is_pipeline_last_stage():
        torch.save({"rewards": rewards.float(), "head": head}, task["out_file"])
    return {}


if __name__ == "__main__":
    from megatron_rl.conversion import worker

    worker.TASKS["reward_fixture"] = run_reward_fixture
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(worker.main(sys.argv[1:]))
