"""Char tokenizer, JSONL prompt datasets (other formats and chat: tests/test_data_formats.py), the resumable prompt sampler and the synthetic tasks.

Run: `.venv/bin/python -m pytest tests/test_prompt_data.py -q`
"""

import json

import pytest

from megatron_rl.spec.errors import ConfigError
from megatron_rl.data import CharTokenizer, PromptDataset, PromptSampler
from megatron_rl.data.synthetic import (
    TASKS,
    answer_space,
    problem_space,
    split_problems,
    write_synthetic_dataset,
)
from megatron_rl.data.sft import encode_sft_example, read_sft_records
from megatron_rl.data.tokenizer import BUILTIN_TOKENIZERS, load_tokenizer
from megatron_rl.rewards import build_reward_fn

# ---------------------------------------------------------------- tokenizer


def test_char_tokenizer_round_trip_and_ids():
    tok = CharTokenizer()
    assert tok.vocab_size == 100 <= 128
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "last of 387=7\n{x}~"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len(text) + 2
    assert max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.encode(" ") == [5] and tok.encode("~") == [99]  # '\n' is 4, then ' '..'~' in code order
    assert tok.decode(tok.encode("é")) == ""  # outside the vocabulary -> unk, dropped on decode
    assert tok.decode([tok.encode("a")[0], tok.eos_id, tok.encode("b")[0]]) == "a"  # stops at eos
    assert tok.decode([1, 3], skip_special_tokens=False) == "<bos><unk>"


def test_arabic_char_tokenizer_round_trip_and_the_builtin_names():
    tok = load_tokenizer("builtin:char-arabic")
    assert tok.name == "char-arabic-v1" and tok.vocab_size == 70 <= 128
    text = "آخر رقم من ٣٨٧=٧\nما هو ٢+٣؟ ٥، أو 5."
    ids = tok.encode(text, add_eos=True)
    assert tok.unk_id not in ids and tok.decode(ids) == text and max(ids) < tok.vocab_size
    assert tok.decode(tok.encode("x")) == ""  # Latin letters are outside this vocabulary
    assert load_tokenizer("builtin:char-ascii").encode("last of 387=") == CharTokenizer().encode("last of 387=")
    assert sorted(BUILTIN_TOKENIZERS) == ["builtin:char-arabic", "builtin:char-ascii"]
    with pytest.raises(ConfigError, match="built-in ones: builtin:char-ascii, builtin:char-arabic"):
        load_tokenizer("builtin:char-greek")


def task_tokenizer(task: str):
    """The built-in tokenizer of a synthetic task (the Arabic ones are in Arabic script)."""
    return load_tokenizer("builtin:char-arabic" if task.endswith("_ar") else None)


# ---------------------------------------------------------------- JSONL datasets


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_dataset_reads_prompts_answers_and_metadata(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "1+1=", "answer": "2", "level": 1}),
            "",
            json.dumps({"prompt": "q", "solution": 7}),
        ],
    )
    with pytest.raises(ConfigError, match=rf"{path}:3: no 'answer' field"):
        PromptDataset.from_files(path)
    data = PromptDataset.from_files(path, require_answer=False)
    assert len(data) == 2
    first = data[0]
    assert (first.prompt, first.answer, first.metadata, first.source) == ("1+1=", "2", {"level": 1}, f"{path}:1")
    assert data[1].answer is None and data[1].metadata == {"solution": 7}
    data = PromptDataset.from_files(path, answer_key="solution", require_answer=False)
    assert data[1].answer == 7


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", "answer": 1', r":2: not valid JSON"),
        ('["prompt"]', r":2: expected a JSON object"),
        ('{"answer": 1}', r":2: no 'prompt' field \(fields: answer\)"),
        ('{"prompt": "", "answer": 1}', r":2: 'prompt' must be a non-empty string"),
    ],
)
def test_dataset_errors_name_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "ok", "answer": 1}', line])
    with pytest.raises(ConfigError, match=str(path) + message):
        PromptDataset.from_files(path)


def test_dataset_missing_or_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        PromptDataset.from_files(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="hold no prompts"):
        PromptDataset.from_files(write_lines(tmp_path / "empty.jsonl", [""]))


# ---------------------------------------------------------------- sampler


def numbers_dataset(tmp_path, count=10):
    lines = [json.dumps({"prompt": f"p{i}", "answer": i}) for i in range(count)]
    return PromptDataset.from_files(write_lines(tmp_path / "n.jsonl", lines))


def test_sampler_visits_each_prompt_once_per_epoch_across_batch_boundaries(tmp_path):
    data = numbers_dataset(tmp_path, 10)
    sampler = PromptSampler(data, batch_size=4, seed=3)
    batches = [[r.answer for r in sampler.next_batch()] for _ in range(5)]  # 20 prompts = 2 epochs
    flat = [a for b in batches for a in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a fresh permutation each epoch
    assert flat[:10] != list(range(10))
    assert (sampler.epoch, sampler.position, sampler.consumed_samples) == (2, 0, 20)


def test_sampler_is_identical_on_every_rank_and_seed_dependent(tmp_path):
    data = numbers_dataset(tmp_path, 10)
    ranks = [PromptSampler(data, batch_size=3, seed=7) for _ in range(2)]
    assert [ranks[0].next_indices() for _ in range(6)] == [ranks[1].next_indices() for _ in range(6)]
    seed7, seed8 = PromptSampler(data, batch_size=3, seed=7), PromptSampler(data, batch_size=3, seed=8)
    assert [seed7.next_indices() for _ in range(6)] != [seed8.next_indices() for _ in range(6)]


def test_sampler_resume_continues_exactly(tmp_path):
    data = numbers_dataset(tmp_path, 10)
    straight = PromptSampler(data, batch_size=4, seed=11)
    expected = [straight.next_indices() for _ in range(9)]

    first = PromptSampler(data, batch_size=4, seed=11)
    seen = [first.next_indices() for _ in range(4)]  # stops mid-epoch (epoch 1, position 6)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip, like a checkpoint
    assert (state["epoch"], state["position"]) == (1, 6)
    resumed = PromptSampler(data, batch_size=4, seed=11)
    resumed.load_state_dict(state)
    seen += [resumed.next_indices() for _ in range(5)]
    assert seen == expected


def test_sampler_refuses_a_state_from_other_data_or_seed(tmp_path):
    data = numbers_dataset(tmp_path, 10)
    state = PromptSampler(data, batch_size=4, seed=1).state_dict()
    with pytest.raises(ConfigError, match="seed=1"):
        PromptSampler(data, batch_size=4, seed=2).load_state_dict(state)
    (tmp_path / "other").mkdir()
    with pytest.raises(ConfigError, match="prompt data changed"):
        PromptSampler(numbers_dataset(tmp_path / "other", 11), batch_size=4, seed=1).load_state_dict(state)


def test_sampler_batch_larger_than_dataset(tmp_path):
    sampler = PromptSampler(numbers_dataset(tmp_path, 3), batch_size=7, seed=0)
    batch = [r.answer for r in sampler.next_batch()]
    assert len(batch) == 7 and sorted(batch[:3]) == sorted(batch[3:6]) == [0, 1, 2]


# ---------------------------------------------------------------- synthetic tasks


def test_problem_spaces():
    assert problem_space("last_digit")[387] == ("last of 387=", "7")
    assert problem_space("first_digit")[387] == ("first of 387=", "3")
    assert problem_space("add")[34] == ("3+4=", "7")
    assert ("rev abc=", "cba") in problem_space("reverse")
    assert answer_space("last_digit") == [str(d) for d in range(10)]
    assert answer_space("add") == [str(n) for n in range(19)]
    assert problem_space("last_digit_ar")[387] == ("آخر رقم من ٣٨٧=", "٧")
    assert problem_space("first_digit_ar")[387] == ("أول رقم من ٣٨٧=", "٣")
    assert answer_space("last_digit_ar") == [chr(0x0660 + d) for d in range(10)]
    for task in TASKS:  # every prompt and answer is inside the task's tokenizer's vocabulary
        tok = task_tokenizer(task)
        for prompt, answer in problem_space(task):
            assert tok.decode(tok.encode(prompt + answer)) == prompt + answer
    with pytest.raises(ConfigError, match="unknown"):
        problem_space("sudoku")


def test_splits_are_disjoint_and_deterministic():
    train, test = split_problems("last_digit", seed=0)
    assert len(test) == 100 and len(train) == 900
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    assert split_problems("last_digit", seed=0) == (train, test)
    assert split_problems("last_digit", seed=1)[1] != test


@pytest.mark.parametrize("task", TASKS)
def test_written_dataset_is_deterministic_and_loadable(tmp_path, task):
    first = write_synthetic_dataset(tmp_path / "a", task=task, num_train=50, num_test=20, seed=5)
    second = write_synthetic_dataset(tmp_path / "b", task=task, num_train=50, num_test=20, seed=5)
    for split in ("train", "test", "sft"):
        assert first[split].read_bytes() == second[split].read_bytes()
    train = PromptDataset.from_files(first["train"])
    test = PromptDataset.from_files(first["test"])
    assert len(train) == 50 and len(test) == 20
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    exact = build_reward_fn("exact")
    # the dataset's own answers score 1 with the task's reward
    assert exact([r.prompt for r in train], [str(r.answer) for r in train], [r.answer for r in train]) == [1.0] * 50
    sft = [json.loads(line) for line in first["sft"].read_text().splitlines()]
    assert [s["prompt"] for s in sft] == [r.prompt for r in train]
    assert all(s["completion"] in answer_space(task) for s in sft)


def test_format_only_sft_answers_sit_near_chance(tmp_path):
    paths = write_synthetic_dataset(tmp_path, task="last_digit", num_train=2000, num_test=10, seed=0)
    train = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    sft = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    agreement = sum(t["answer"] == s["completion"] for t, s in zip(train, sft)) / len(train)
    assert 0.07 < agreement < 0.13  # random digits: 1/10 on average
    correct = write_synthetic_dataset(tmp_path / "c", task="add", num_train=30, num_test=5, sft_answers="correct")
    pairs = zip(correct["train"].read_text().splitlines(), correct["sft"].read_text().splitlines())
    assert all(json.loads(t)["answer"] == json.loads(s)["completion"] for t, s in pairs)


def test_encode_sft_example_masks_the_prompt():
    tok = CharTokenizer()
    ids, mask = encode_sft_example(tok, "3+4=", "7")
    assert ids == [tok.bos_id, *tok.encode("3+4=7"), tok.eos_id]
    assert mask == [0, 0, 0, 0, 0, 1, 1]
    assert encode_sft_example(tok, "3+4=", "7", max_length=6) == (ids[:6], mask[:6])


def test_sft_jsonl_reads_completion_or_answer_and_names_bad_lines(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text('{"q": "1+1=", "completion": "2"}\n\n{"q": "2+2=", "answer": 4}\n')
    assert read_sft_records(path, prompt_key="q") == [{"prompt": "1+1=", "completion": "2"},
                                                   {"prompt": "2+2=", "completion": "4"}]
    path.write_text('{"q": "1+1=", "completion": "2"}\n{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: no 'q' field \(fields: prompt\)"):
        read_sft_records(path, prompt_key="q")
