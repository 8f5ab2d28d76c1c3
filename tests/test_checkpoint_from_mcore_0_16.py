"""A checkpoint written by megatron-core 0.16.1 (before the move to 0.19) resumes and exports under 0.19.

``tests/data/checkpoint_mcore_0.16.1/step_00000001`` is the final checkpoint of the default job run for one GRPO
step without the SFT warm-up, by megatron-core 0.16.1 on Python 3.11 (commit 82e219b:
``python launch.py run.steps=1 algorithm.sft_warmup_steps=0``): the model, the distributed optimizer's state and
the common state in 0.16's ``common.pt`` (0.19 writes it into the shards as the object ``common_state``).

Run: ``.venv/bin/python -m pytest tests/test_checkpoint_from_mcore_0_16.py -q``
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers import read_metrics, run_launch

LEGACY = Path(__file__).parent / "data" / "checkpoint_mcore_0.16.1" / "step_00000001"
RESPONSE_LENGTH_AT_STEP_2 = 3.984375
"""The mean response length of step 2 resumed from LEGACY, by megatron-core 0.16.1 (same command, run.steps=2): the
128 completions are drawn from the loaded policy, so any weight that loads differently moves it."""


def test_a_0_16_checkpoint_resumes_at_its_step_with_the_same_policy(tmp_path):
    from megatron_rl.conversion.dist_reader import CheckpointReader

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(LEGACY, run_dir / "checkpoints" / LEGACY.name)
    result = run_launch("run.steps=2", "algorithm.sft_warmup_steps=0", f"run.dir={run_dir}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / LEGACY.name} (step 1)" in result.stdout
    (step,) = read_metrics(run_dir)
    assert step["step"] == 2 and step["response_length"] == RESPONSE_LENGTH_AT_STEP_2
    saved = run_dir / "checkpoints" / "step_00000002"
    assert not (saved / "common.pt").exists()  # 0.19's format: the common state inside the shards
    assert CheckpointReader(saved).common_state()["step"] == 2  # read there by the torch-free reader
    assert CheckpointReader(LEGACY).common_state()["step"] == 1  # and from common.pt


def test_a_0_16_checkpoint_exports_to_hugging_face(tmp_path):
    result = run_launch("convert", "megatron-to-hf", "--ckpt", str(LEGACY), "--out", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and list((tmp_path / "hf").glob("*.safetensors"))
