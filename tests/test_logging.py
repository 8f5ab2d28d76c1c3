"""Metrics logging: TensorBoard and W&B (offline) continue a resumed run without duplicate steps, the warning
without tensorboard, the logging.wandb config, and the plotting CLI on a real GRPO run.

Run: `.venv/bin/python -m pytest tests/test_logging.py -q`
"""

from __future__ import annotations

import io
import json
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from helpers import REPO_ROOT, read_metrics
from megatron_rl.spec.config.loader import load_config
from megatron_rl.spec.config.schema import WandbConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.runtime.metrics import MetricsLogger


def _logger(run_dir, **kwargs) -> MetricsLogger:
    return MetricsLogger(run_dir, total_steps=5, stream=io.StringIO(), **kwargs)


def _attempts(run_dir, **kwargs) -> None:
    """A run that logs 2 warm-up and 4 GRPO steps, is killed after a checkpoint at step 2, resumes and ends at 5:
    the redone steps 3 and 4 log other values than the first attempt's (loss = 10 * attempt + step)."""
    for attempt, (kept, steps) in enumerate([(0, [1, 2, 3, 4]), (2, [3, 4, 5])]):
        logger = _logger(run_dir, **kwargs)
        logger.truncate_after(kept, warmup_kept=0 if attempt == 0 else 2)
        if attempt == 0:
            for step in (1, 2):
                logger.log(step, {"loss": float(step)}, phase="sft", total=2)
        for step in steps:
            logger.log_samples(step, _samples(attempt, step))
            logger.log(step, {"loss": 10.0 * attempt + step, "kl": float("nan")})
        logger.close()


def _samples(attempt: int, step: int) -> list[dict]:
    """What ``Rollout.sample_records`` gives: here Arabic text, which must come back as written."""
    return [{"prompt": f"كم يساوي ٣ + {step}؟", "completion": f"{attempt}\n٧", "answer": 3 + step,
             "reward": float(attempt), "rewards": {"math": float(attempt)}, "advantage": 0.5,
             "response_tokens": 2, "truncated": False}]


def _scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_progress_lines_show_the_step_only_for_training_records(tmp_path):
    logger = _logger(tmp_path)
    logger.log(3, {"loss": 0.5})
    logger.log(1, {"loss": 0.25}, phase="sft", total=2)
    logger.log(0, {"pass_at_1": 0.75}, phase="eval", total=0)  # an eval run has no training step
    logger.close()
    assert logger.stream.getvalue().splitlines() == ["step    3/5  loss 0.5000", "sft step    1/2  loss 0.2500",
                                                     "eval pass_at_1 0.7500"]


def test_tensorboard_resume_purges_redone_steps(tmp_path):
    _attempts(tmp_path, tensorboard=True)
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path) if "phase" not in r] == \
        [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    board = tmp_path / "tensorboard"
    assert _scalars(board / "train", "train/loss") == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert _scalars(board / "sft", "sft/loss") == [(1, 1.0), (2, 2.0)]  # the warm-up is not redone


def test_missing_tensorboard_is_said_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # importing it now raises ImportError
    _attempts(tmp_path, tensorboard=True)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "tensorboard" in line]
    assert warnings == ["warning: logging.tensorboard=true but tensorboard is not installed, so no TensorBoard "
                        "logs are written: pip install 'megatron-rl[logging]' (or set logging.tensorboard=false)"] * 2
    assert not (tmp_path / "tensorboard").exists() and len(read_metrics(tmp_path)) == 7


def _wandb_runs(wandb_dir: Path) -> list[tuple[str, list[dict]]]:
    """(run id, history rows) of each offline run under wandb_dir, oldest first, read from its .wandb file (a
    LevelDB-style log of protobuf records: 32 KiB blocks of chunks with 7-byte headers, after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunk, rows, run_id = path.read_bytes(), 7, b"", [], None
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            chunk += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last chunk of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(chunk)
                chunk = b""
                if record.WhichOneof("record_type") == "run":
                    run_id = record.run.run_id
                elif record.WhichOneof("record_type") == "history":
                    rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                 for item in record.history.item})
        runs.append((run_id, rows))
    return runs


def _wandb_processes() -> list[str]:
    return [p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith("wandb")]


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    (tmp_path / "wandb_dir").mkdir()
    yield tmp_path / "wandb_dir"
    assert _wandb_processes() == []  # close() stopped the wandb service


def test_samples_are_logged_once_per_step_after_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    _attempts(run_dir, tensorboard=False)
    lines = (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    # the first attempt's steps 1 and 2 (saved), then the second attempt's 3, 4 and 5; the redone 3 and 4 once
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert [json.loads(line)["completion"] for line in lines] == ["0\n٧", "0\n٧", "1\n٧", "1\n٧", "1\n٧"]
    assert json.loads(lines[0])["prompt"] == "كم يساوي ٣ + 1؟" and "كم يساوي" in lines[0]  # UTF-8, not \u escapes
    assert stat.S_IMODE((run_dir / "samples.jsonl").stat().st_mode) == 0o600


def test_wandb_offline_resume_continues_the_run(tmp_path, wandb_env):
    run_dir = tmp_path / "run"
    _attempts(run_dir, tensorboard=False, wandb=WandbConfig(project="test", mode="offline"))
    id_file = run_dir / "wandb_run_id"
    assert stat.S_IMODE(id_file.stat().st_mode) == 0o600
    (first_id, first), (second_id, second) = _wandb_runs(wandb_env)
    assert first_id == second_id == id_file.read_text().strip()
    logged = [(row["_step"], row.get("sft/step", row.get("train/step")), row.get("sft/loss", row.get("train/loss")))
              for row in first + second]
    # W&B's step is the metrics.jsonl line; the resumed attempt skips the lines W&B already has (train 3 and 4)
    assert logged == [(0, 1, 1.0), (1, 2, 2.0), (2, 1, 1.0), (3, 2, 2.0), (4, 3, 3.0), (5, 4, 4.0), (6, 5, 15.0)]
    # each training step's samples table sits on that step's line, also skipped where W&B had the line already
    tables = [row for row in first + second if "samples/_type" in row]
    assert [(row["_step"], row["samples/_type"], row["samples/nrows"]) for row in tables] == [
        (step, "table-file", 1) for step in (2, 3, 4, 5, 6)]
    assert all("train/kl" not in row for row in first + second)  # nan is not logged


def test_only_rank_zero_logs(tmp_path, wandb_env):
    logger = _logger(tmp_path / "run", wandb=WandbConfig(mode="offline"), enabled=False)
    logger.truncate_after(0, warmup_kept=0)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists() and not any(wandb_env.iterdir())


def test_wandb_not_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"logging.wandb is set but wandb is not installed: pip install "
                                          r"'megatron-rl\[logging\]'"):
        _logger(tmp_path, wandb=WandbConfig(mode="offline"))


def test_wandb_config():
    assert load_config(None, []).logging.wandb is None
    wandb = load_config(None, ["logging.wandb.project=p", "logging.wandb.mode=offline"]).logging.wandb
    assert (wandb.project, wandb.entity, wandb.mode) == ("p", None, "offline")
    with pytest.raises(ConfigError, match="logging.wandb.mode='cloud' is not valid; use one of: online, offline"):
        load_config(None, ["logging.wandb.mode=cloud"])
    with pytest.raises(ConfigError, match="unknown config key 'logging.wandb.api_key'.*valid keys here: project, "
                                          "entity, mode"):
        load_config(None, ["logging.wandb.api_key=secret"])  # the key comes only from WANDB_API_KEY


def test_real_grpo_run_logs_everywhere_and_plots(launch, tmp_path, monkeypatch):
    """A 4-step GRPO job (5 warm-up steps) of the Arabic config with TensorBoard, offline W&B and sample logs on,
    then the plotting CLI: the samples come back in Arabic script, in samples.jsonl, W&B and ``logs --samples``."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)  # W&B files go to the run folder
    run_dir = tmp_path / "run"
    result = launch("--config", "grpo_arabic_tiny", "algorithm.sft_warmup_steps=5", "algorithm.prompts_per_step=4",
                    "algorithm.group_size=4", "algorithm.global_batch_size=8", "parallel.micro_batch_size=4",
                    "run.steps=4", "logging.tensorboard=true", "logging.wandb.mode=offline", "logging.sample_every=2",
                    "logging.samples=2", f"run.dir={run_dir}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = read_metrics(run_dir)
    train = [m for m in metrics if "phase" not in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4] and len(metrics) == 9
    assert [v for _, v in _scalars(run_dir / "tensorboard" / "train", "train/reward_mean")] == \
        pytest.approx([m["reward_mean"] for m in train])
    [(run_id, rows)] = _wandb_runs(run_dir)
    assert run_id == (run_dir / "wandb_run_id").read_text().strip()
    assert [row.get("train/reward_mean") for row in rows[5:]] == pytest.approx([m["reward_mean"] for m in train])
    assert [row["_step"] for row in rows if "samples/_type" in row] == [6, 8]  # the lines of steps 2 and 4

    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [s["step"] for s in samples] == [2, 2, 4, 4]
    for sample in samples:  # the Arabic task, whole: prompt, answer and the reward of the completion as decoded
        assert sample["prompt"].startswith("آخر رقم من ") and sample["answer"] in "٠١٢٣٤٥٦٧٨٩"
        assert sample["reward"] == float(sample["completion"].strip() == sample["answer"])
    shown = launch("logs", str(run_dir), "--samples")
    assert shown.returncode == 0 and samples[-1]["prompt"] in shown.stdout, shown.stderr

    plot = subprocess.run([sys.executable, "-m", "megatron_rl.plotting", str(run_dir)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    png = Path(plot.stdout.strip())
    assert png == run_dir / "curves.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, "-m", "megatron_rl.plotting", str(tmp_path / "nothing")],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "metrics.jsonl not found" in missing.stderr
