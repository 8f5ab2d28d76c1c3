"""Verifiable synthetic tasks for tiny models on CPU, written as JSONL for GRPO and for an SFT warm-up.

Tasks (prompt -> answer; the reward is an exact match of the completion, registry name "exact"):
- "last_digit" (default): "last of 387=" -> "7" (1000 problems, answers "0".."9" uniform). Learnable by GRPO
  alone from chance (0.1): a 2-layer hidden-64 GPT goes from ~0.1 to > 0.95 mean reward in ~150 steps of
  8-16 prompts x 8 completions (measured with a pure-torch model; see tests/test_grpo_math.py).
- "first_digit": "first of 387=" -> "3"; the same, the answer sits further from the end of the prompt.
- "add": single-digit addition, "3+4=" -> "7" (100 problems, answers "0".."18"). Too hard for GRPO from chance
  on a tiny model (it collapses onto the most common answer); use it with a correct-answer SFT warm-up.
- "reverse": reverse 3 letters from a-e, "rev abc=" -> "cba" (125 problems); chance is 1/125, SFT first.
- "multiply": two-digit products, "37*58=" -> "2146" (8100 problems): a tiny model cannot compute them, but it
  can call the calculator environment (``environment.name: calculator``, ``tag: c``) and copy its result.
  "multiply_tool" is its warm-up: half of the problems are worked conversations as the calculator environment
  renders them without a chat template ("<c>37*58</c>\ntool: 2146\nassistant: 2146"), half direct answers, so
  a warmed-up policy calls the tool about half the time and GRPO has the rest to learn.
- "last_digit_ar" and "first_digit_ar": the digit tasks in Arabic with Arabic-Indic digits, "آخر رقم من ٣٨٧=" ->
  "٧" and "أول رقم من ٣٨٧=" -> "٣" (model.tokenizer: builtin:char-arabic; configs/grpo_arabic_tiny.yaml).

Train and test splits hold DISJOINT problems: the problem space is shuffled with the seed and the first
`num_test_problems` (default: a tenth of the space) go to test; lines are then drawn (seeded) from each side.

SFT warm-up data (`sft_records`) is prompt + completion; with answers="random" the completion is a random
well-formed answer of the task, so the warm-up teaches the output format only and a policy starts GRPO near
chance (last_digit: 1/10), leaving the task itself for the reward to teach. With answers="correct" it is plain SFT.

Write the files: `.venv/bin/python -m megatron_rl.data.synthetic --out runs/data --task last_digit --seed 0`
Test: `.venv/bin/python -m pytest tests/test_prompt_data.py -q`
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path

from megatron_rl.spec.errors import ConfigError

TASKS: tuple[str, ...] = ("last_digit", "first_digit", "add", "reverse", "last_digit_ar", "first_digit_ar", "multiply",
                          "multiply_tool")
_REVERSE_LETTERS = "abcde"
_ARABIC_DIGITS = str.maketrans("0123456789", "".join(chr(0x0660 + digit) for digit in range(10)))
_ARABIC_WORDS = {"last_digit_ar": "آخر رقم من", "first_digit_ar": "أول رقم من"}


def problem_space(task: str) -> list[tuple[str, str]]:
    """Every (prompt, answer) of task, in a fixed order."""
    if task in ("last_digit", "first_digit"):
        position = -1 if task == "last_digit" else 0
        word = task.split("_")[0]
        return [(f"{word} of {digits}=", digits[position]) for digits in (f"{number:03d}" for number in range(1000))]
    if task in _ARABIC_WORDS:
        return [(f"{_ARABIC_WORDS[task]} {prompt.split(' of ')[1].translate(_ARABIC_DIGITS)}",
                 answer.translate(_ARABIC_DIGITS)) for prompt, answer in problem_space(task.removesuffix("_ar"))]
    if task == "add":
        return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    if task == "reverse":
        return [
            (f"rev {''.join(word)}=", "".join(reversed(word))) for word in itertools.product(_REVERSE_LETTERS, repeat=3)
        ]
    if task == "multiply":
        return [(f"{a}*{b}=", str(a * b)) for a in range(10, 100) for b in range(10, 100)]
    if task == "multiply_tool":
        return [(prompt, (f"<c>{prompt[:-1]}</c>\ntool: {answer}\nassistant: {answer}"
                          if (int(answer) // 7) % 2 else answer)) for prompt, answer in problem_space("multiply")]
    raise ConfigError(f"synthetic task {task!r} is unknown; use one of {', '.join(TASKS)}")


def answer_space(task: str) -> list[str]:
    """Every well-formed answer of task (what a format-only warm-up samples from)."""
    return sorted({answer for _, answer in problem_space(task)}, key=lambda text: (len(text), text))


def split_problems(task: str, *, num_test_problems: int | None = None, seed: int) -> tuple[list[dict], list[dict]]:
    """(train problems, test problems) as {"prompt", "answer"} dicts, disjoint, chosen by seed."""
    space = problem_space(task)
    if num_test_problems is None:
        num_test_problems = len(space) // 10
    if not 0 <= num_test_problems < len(space):
        raise ConfigError(
            f"synthetic data: num_test_problems={num_test_problems} must be in [0, {len(space)}) for task {task!r}"
        )
    order = list(range(len(space)))
    random.Random(f"synthetic-split:{task}:{seed}").shuffle(order)
    problems = [{"prompt": space[i][0], "answer": space[i][1]} for i in order]
    return problems[num_test_problems:], problems[:num_test_problems]


def sample_records(problems: Sequence[dict], num_records: int, *, task: str, split: str, seed: int) -> list[dict]:
    """num_records lines {"prompt", "answer", "task"} from problems: each problem once per pass, passes shuffled."""
    if not problems and num_records > 0:
        raise ConfigError(f"synthetic data: the {split} split of task {task!r} has no problems to draw from")
    rng = random.Random(f"synthetic-sample:{task}:{split}:{seed}")
    records: list[dict] = []
    while len(records) < num_records:
        block = list(problems)
        rng.shuffle(block)
        records.extend(block[: num_records - len(records)])
    return [dict(record, task=task) for record in records]


def sft_records(records: Sequence[dict], *, task: str, answers: str = "random", seed: int = 0) -> list[dict]:
    """SFT lines {"prompt", "completion"}; answers="correct" copies the answer, "random" draws a well-formed one."""
    if answers == "correct":
        return [{"prompt": r["prompt"], "completion": r["answer"]} for r in records]
    if answers == "random":
        rng = random.Random(f"synthetic-sft:{task}:{seed}")
        choices = answer_space(task)
        return [{"prompt": r["prompt"], "completion": rng.choice(choices)} for r in records]
    raise ConfigError(f"synthetic SFT data: answers={answers!r} must be 'random' (format only) or 'correct'")


def write_jsonl(path: str | Path, records: Sequence[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def write_synthetic_dataset(
    out_dir: str | Path,
    *,
    task: str = "last_digit",
    num_train: int = 2000,
    num_test: int = 200,
    num_test_problems: int | None = None,
    sft_answers: str = "random",
    seed: int = 0,
) -> dict[str, Path]:
    """Write train.jsonl, test.jsonl (prompt/answer/task) and sft.jsonl (prompt/completion) under out_dir.

    Same arguments -> byte-identical files. Returns {"train", "test", "sft"} -> path.
    """
    train_problems, test_problems = split_problems(task, num_test_problems=num_test_problems, seed=seed)
    train = sample_records(train_problems, num_train, task=task, split="train", seed=seed)
    test = sample_records(test_problems, num_test, task=task, split="test", seed=seed) if test_problems else []
    out = Path(out_dir)
    return {
        "train": write_jsonl(out / "train.jsonl", train),
        "test": write_jsonl(out / "test.jsonl", test),
        "sft": write_jsonl(out / "sft.jsonl", sft_records(train, task=task, answers=sft_answers, seed=seed)),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--task", default="last_digit", choices=TASKS)
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--num-test-problems", type=int, default=None, help="default: a tenth of the problems")
    parser.add_argument("--sft-answers", default="random", choices=("random", "correct"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = write_synthetic_dataset(
        args.out,
        task=args.task,
        num_train=args.num_train,
        num_test=args.num_test,
        num_test_problems=args.num_test_problems,
        sft_answers=args.sft_answers,
        seed=args.seed,
    )
    for split, path in paths.items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
