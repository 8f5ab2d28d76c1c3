"""Colocated generation on the training model: KV-cache decoding, sampling, training-forward log-probs, memory phases.

Public API: ``generate`` / ``GenerationOutput`` (decoding.py), ``sequence_logprobs`` (logprobs.py),
``SamplingParams`` / ``choose_tokens`` (sampling.py), ``generation_phase`` (memory.py); decode steps run through
``LeanDecoder`` (lean_decode.py) where it applies, else the ``GPTModel`` modules.
Test: ``.venv/bin/python -m pytest tests/test_generation.py -q``; benchmark: ``.venv/bin/python bench/generation.py``.
"""

from megatron_rl.generation.decoding import GenerationOutput, data_parallel_seed, generate
from megatron_rl.generation.logprobs import sequence_logprobs
from megatron_rl.generation.memory import generation_phase
from megatron_rl.generation.sampling import SamplingParams, choose_tokens, sampling_logits

__all__ = ["GenerationOutput", "SamplingParams", "choose_tokens", "data_parallel_seed", "generate",
           "generation_phase", "sampling_logits", "sequence_logprobs"]
