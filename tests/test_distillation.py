"""On-policy distillation (algorithm.teacher): the per-token advantages and loss against hand-computed values, the
config's checks, the tokenizer refusal, and real runs: a student trains with a teacher of another size at pp=2, and
a student that starts from its teacher's weights sees a reverse KL of zero (the teacher's forward and the sampler
agree token by token)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.policy_loss import GRPOLossConfig, distillation_advantages, grpo_loss
from megatron_rl.data.tokenizer import load_tokenizer, same_tokenizer
from megatron_rl.spec.config.loader import load_config
from megatron_rl.spec.errors import ConfigError
from tests.helpers import read_metrics, run_launch

MASK = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.float32)
STUDENT = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, 0.0, -3.0, -1.0]])
TEACHER = torch.tensor([[0.0, -2.0, -1.0, 0.0], [0.0, 0.0, -1.0, -4.0]])


def test_advantages_by_hand():
    # k1 = s - t per response token: row 0: 1, -1; row 1: -2, 3 (response positions 1, 2)
    # position 1 mean of -k1: (-1 + 2) / 2 = 0.5; position 2: (1 - 3) / 2 = -1
    adv, kl = distillation_advantages(torch.tensor([1.0, 2.0]), STUDENT, TEACHER, MASK, coef=1.0)
    assert adv.tolist() == [[0.0, -1.5, 2.0, 0.0], [0.0, 0.0, 1.5, -2.0]]
    assert kl.item() == pytest.approx((1 - 1 - 2 + 3) / 4)
    mixed, _ = distillation_advantages(torch.tensor([1.0, 2.0]), STUDENT, TEACHER, MASK, coef=0.5, with_rewards=True)
    assert mixed.tolist() == [[0.0, 0.25, 2.0, 0.0], [0.0, 0.0, 2.75, 1.0]]
    # k3 = exp(t - s) - (t - s) - 1: row 0 pos 1: e^-1 + 1 - 1 = 0.3679; row 1 pos 1: e^2 - 2 - 1 = 4.3891
    k3, _ = distillation_advantages(torch.zeros(2), STUDENT, TEACHER, MASK, coef=1.0, kind="k3")
    first = [-(torch.tensor(-1.0).exp().item()), -(torch.tensor(2.0).exp().item() - 3.0)]
    mean = sum(first) / 2
    assert k3[0, 1].item() == pytest.approx(first[0] - mean, rel=1e-6)
    assert k3[1, 2].item() == pytest.approx(first[1] - mean, rel=1e-6)


def test_loss_gradient_is_the_token_advantage():
    """At ratio 1 the clipped surrogate's gradient in log pi is -A_t / tokens (token-mean): the teacher's
    per-token advantages, not the rows' reward advantages, which distillation alone leaves out."""
    config = GRPOLossConfig(eps_low=0.2, eps_high=0.2, kl_coef=0.0, kl_kind="k3", loss_agg_mode="token-mean",
                            teacher_coef=1.0)
    logp = STUDENT.clone().requires_grad_(True)
    loss, metrics = grpo_loss(logp, STUDENT, torch.tensor([5.0, -5.0]), MASK, config=config, teacher_logp=TEACHER)
    loss.backward()
    expected, _ = distillation_advantages(torch.zeros(2), STUDENT, TEACHER, MASK, coef=1.0)
    assert torch.allclose(logp.grad, -expected / MASK.sum())
    assert metrics["teacher_kl"].item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="teacher_logp"):
        grpo_loss(logp, STUDENT, torch.zeros(2), MASK, config=config)


def test_config_checks():
    cfg = load_config(None, ["algorithm.teacher={checkpoint: runs/t, coef: 0.5, with_rewards: true}"])
    loss = GRPOLossConfig.from_algorithm(cfg.algorithm, max_response_len=4)
    assert (loss.teacher_coef, loss.teacher_kl, loss.teacher_with_rewards) == (0.5, "k1", True)
    for overrides, message in (
            (["algorithm.teacher.checkpoint=a", "algorithm.teacher.coef=0"], r"algorithm.teacher.coef=0(\.0)? must be positive"),
            (["algorithm.teacher.checkpoint=a", "algorithm.teacher.kl_estimator=k4"], "kl_estimator='k4'"),
            (["algorithm.teacher={checkpoint: a, coeff: 1}"], "did you mean 'algorithm.teacher.coef'"),
            (["--config", "dpo_tiny", "algorithm.teacher.checkpoint=a"], "algorithm.name=dpo takes none")):
        config = overrides[1] if overrides[0] == "--config" else None
        with pytest.raises(ConfigError, match=message):
            load_config(config, overrides[2:] if config else overrides)


def test_tokenizers_compared_by_vocabulary():
    assert same_tokenizer(load_tokenizer(None), load_tokenizer("builtin:char-ascii"))
    assert not same_tokenizer(load_tokenizer(None), load_tokenizer("builtin:char-arabic"))


def test_distillation_runs(tmp_path):
    """A 3-layer teacher trained 2 steps; a 2-layer student at pp=2 distils from it (the teacher resharded to its
    own split); a 3-layer student started from the teacher's weights measures a reverse KL of 0 at its first step;
    an Arabic-tokenizer student is refused before anything starts."""
    model = tmp_path / "tiny-3l.yaml"
    model.write_text((load_model_text() .replace("num_layers: 2", "num_layers: 3")
                      .replace("name: tiny-cpu", "name: tiny-cpu-3l")))
    teacher = tmp_path / "teacher"
    quick = ["logging.plot=false", "logging.tensorboard=false", "algorithm.sft_warmup_steps=2",
             "checkpoint.save_at_end=true"]
    done = run_launch(f"run.dir={teacher}", f"model.name={model}", "run.steps=2", *quick)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ckpt = f"algorithm.teacher.checkpoint={teacher / 'checkpoints'}"

    student = tmp_path / "student"
    done = run_launch(f"run.dir={student}", "run.steps=2", "parallel.pp=2", "parallel.micro_batch_size=16", ckpt,
                      "algorithm.teacher.with_rewards=true", *quick)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    train = [m for m in read_metrics(student) if m.get("phase", "train") == "train"]
    assert len(train) == 2 and all(abs(m["teacher_kl"]) > 1e-4 and torch.isfinite(torch.tensor(m["loss"])) for m in train)

    same = tmp_path / "same"
    done = run_launch(f"run.dir={same}", f"model.name={model}", f"model.init_from={teacher / 'checkpoints'}",
                      "run.steps=1", ckpt, *quick[:2], "algorithm.sft_warmup_steps=0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = [m for m in read_metrics(same) if m.get("phase", "train") == "train"][0]
    assert abs(first["teacher_kl"]) < 1e-5, first

    refused = run_launch(f"run.dir={tmp_path / 'arabic'}", "model.tokenizer=builtin:char-arabic",
                         "data.task=last_digit_ar", "data.warmup_task=first_digit_ar", ckpt)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "algorithm.teacher.checkpoint" in lines[0] and "builtin:char-arabic" in lines[0]
    assert not (tmp_path / "arabic" / "logs").exists()


def load_model_text() -> str:
    from megatron_rl.spec.resources import configs_dir

    return (configs_dir() / "models" / "tiny-cpu.yaml").read_text()


def test_teacher_not_a_checkpoint(tmp_path):
    """A folder that is not a checkpoint: the job (the launcher reads no checkpoint) stops before training with
    exit code 2 and the line naming the key, which the launcher shows with the rank's log."""
    bad = tmp_path / "not_a_checkpoint"
    bad.mkdir()
    refused = run_launch(f"run.dir={tmp_path / 'run'}", f"algorithm.teacher.checkpoint={bad}")
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert f"algorithm.teacher.checkpoint: {bad} holds no complete checkpoint" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_the_shipped_distillation_pipeline_resolves_its_teacher(tmp_path):
    """configs/pipeline_distill_tiny.yaml: the student stage distils from the teacher stage's checkpoint folder
    (its learning is the README's figure, measured at three seeds; CI keeps the short runs above)."""
    shown = run_launch("pipeline", "--config", "configs/pipeline_distill_tiny.yaml", f"pipeline.dir={tmp_path}",
                       "--dry-run")
    assert shown.returncode == 0, shown.stderr[-2000:]
    student = shown.stdout.split("# ---- stage 3/6: student ")[1].split("# ---- stage 4/6")[0]
    assert f"checkpoint: {tmp_path / 'teacher' / 'checkpoints'}" in student
    assert f"init_from: {tmp_path / 'student_base' / 'checkpoints'}" in student
