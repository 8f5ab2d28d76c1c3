"""Colocated generation on the training model: KV-cache decoding and sampling.

Public API: ``generate`` / ``GenerationOutput`` (decoding.py), ``EngineConfig`` (config.py), ``SamplingParams`` /
``choose_tokens`` (sampling.py). ``generate`` runs the paged engine (engine.py and its rooms: sequence.py, block_manager.py, scheduler.py,
runner.py, turns.py, feed.py; the cache and kernels: paged.py, paged_attention.py, paged_mla.py; pipeline.py) on the
``GPTModel`` modules. The memory phases around generation live in ``megatron_rl.runtime.phases``, and the
training-forward log-probs that generation's are checked against in ``megatron_rl.runtime.training``.
Test: ``.venv/bin/python -m pytest tests/test_generation.py -q``; benchmark: ``.venv/bin/python bench/generation.py``.
"""

from megatron_rl.generation.config import EngineConfig
from megatron_rl.generation.decoding import GenerationOutput, GenerationStopped, data_parallel_seed, generate
from megatron_rl.generation.sampling import SamplingParams, choose_tokens, sampling_logits

__all__ = ["EngineConfig", "GenerationOutput", "GenerationStopped", "SamplingParams", "choose_tokens",
           "data_parallel_seed", "generate", "sampling_logits"]
