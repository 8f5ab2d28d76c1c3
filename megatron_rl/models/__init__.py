"""Megatron Core models as the job builds them: the GPT policy (``builder``), reward models and critics
(``reward_model``), LoRA adapters, router replay, and the attention and norm modules swapped in for CPUs."""


def unwrap(chunk):
    """The GPTModel inside a DDP (or other) wrapper."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
