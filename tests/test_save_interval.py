"""checkpoint.save_interval: auto (the default), a number of steps, or 0; the auto rule itself."""

from __future__ import annotations

import pytest

from megatron_rl.spec.config.schema import CheckpointConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.trainers.common import AUTO_SAVE_OVERHEAD, auto_save_due


def test_auto_is_the_default_and_numbers_keep_their_meaning() -> None:
    assert CheckpointConfig().save_interval == "auto"
    assert CheckpointConfig(save_interval=0).save_interval == 0
    assert CheckpointConfig(save_interval=20).save_interval == 20


@pytest.mark.parametrize("value", ["often", "-1", -1])
def test_other_values_are_one_line_errors(value) -> None:
    with pytest.raises(ConfigError, match="checkpoint.save_interval") as info:
        CheckpointConfig(save_interval=value)
    assert "\n" not in str(info.value)


def test_auto_waits_one_warning_window_between_saves() -> None:
    assert not auto_save_due(since_save_s=119.0, last_save_s=1.0, warning_window_s=120)
    assert auto_save_due(since_save_s=120.0, last_save_s=1.0, warning_window_s=120)


def test_auto_keeps_saving_under_a_tenth_of_the_time_when_saves_are_slow() -> None:
    # a 405B save of 60 s with a 120 s window: saving every 120 s would spend a third of the time on it
    assert not auto_save_due(since_save_s=599.0, last_save_s=60.0, warning_window_s=120)
    assert auto_save_due(since_save_s=AUTO_SAVE_OVERHEAD * 60.0, last_save_s=60.0, warning_window_s=120)


def test_without_a_warning_window_the_first_step_is_saved_to_measure_a_save() -> None:
    assert auto_save_due(since_save_s=0.01, last_save_s=0.0, warning_window_s=0)


def test_the_shipped_large_configs_save_by_the_warning_window():
    """The >100B recipes (and the 8B one) save with save_interval=auto, what the project recommends: a hard kill
    loses about one warning window of work, whatever their steps take; none hand-caps the rows decoding at once,
    as a stop is honoured mid-rollout (megatron_rl/generation/engine.py STOP_POLL_STEPS)."""
    from megatron_rl.spec.config import load_config

    for name in ("grpo_deepseek_v3", "grpo_llama405b", "grpo_llama70b", "grpo_llama8b", "grpo_qwen3_235b",
                 "rm_qwen3_235b"):
        cfg = load_config(name, allow_missing=True)
        assert cfg.checkpoint.save_interval == "auto", name
        assert cfg.generation.max_concurrent is None, name
