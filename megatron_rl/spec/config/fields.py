"""Config-section building blocks: the choices a key may take, and the one-line checks sections run on their
values (``ConfigError`` naming the key and the fix).
"""

from __future__ import annotations

import re
from typing import Optional

from megatron_rl.spec.errors import ConfigError

EXECUTORS = ("auto", "local", "slurm")
ALGORITHMS = ("grpo", "ppo", "rm", "sft", "pretrain", "dpo", "eval")
CRITIC_INITS = ("policy", "rm")
RECOMPUTE_MODES = ("none", "selective", "full")
DTYPES = ("auto", "fp32", "bf16", "fp16")
BACKENDS = ("auto", "nccl", "gloo")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
ADVANTAGE_MODES = ("std", "mean")
WANDB_MODES = ("online", "offline", "disabled")
IMPORTANCE_RATIOS = ("token", "sequence")
POLICY_LOSSES = ("clip", "cispo")
TRUNCATION_POLICIES = ("truncate", "drop")
MOE_LOAD_BALANCING = ("none", "aux_loss", "seq_aux_loss")
DPO_LOSSES = ("sigmoid", "ipo")
ATTENTION_KERNELS = ("auto", "flash", "unfused")
GRAD_DTYPES = ("fp32", "bf16")
WEIGHT_SYNCS = ("gloo", "nccl", "files")
OFF_POLICY_CORRECTIONS = ("none", "truncated_is", "decoupled")


def _one_of(section: str, key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{key}={value!r} is not valid; use one of: {', '.join(choices)}")


def _positive(section: str, **values: Optional[float]) -> None:
    for key, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{section}.{key}={value} must be positive (> 0)")


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_WORLD_SIZE = 1 << 20
"""Most processes (GPUs) in one job: cluster.nodes x cluster.tasks_per_node."""
MAX_LENGTH = 1 << 24
"""Largest sequence length and global batch size accepted."""


def _at_most(section: str, high: int, **values: Optional[int]) -> None:
    for key, value in values.items():
        if value is not None and value > high:
            raise ConfigError(f"{section}.{key}={value} is too large; give at most {high:,}")


def _non_negative(section: str, **values: Optional[float]) -> None:
    for key, value in values.items():
        if value is not None and value < 0:
            raise ConfigError(f"{section}.{key}={value} must be >= 0")
