"""Data for RL and SFT: records from JSONL/JSON/Parquet/Arrow/save_to_disk (``records``), chat formats (``chat``),
prompt datasets and a resumable sampler, the tiny char tokenizer.

Synthetic tasks live in `megatron_rl.data.synthetic` (not imported here, so `python -m` can run it cleanly).
Test: `.venv/bin/python -m pytest tests/test_prompt_data.py -q`
"""

from megatron_rl.data.prompts import PromptDataset, PromptRecord, PromptSampler
from megatron_rl.data.tokenizer import CharTokenizer

__all__ = ["CharTokenizer", "PromptDataset", "PromptRecord", "PromptSampler"]
