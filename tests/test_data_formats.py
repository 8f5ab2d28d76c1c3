"""Data files beyond JSONL (JSON, Parquet, Arrow, save_to_disk folders) read through Hugging Face datasets, field
mapping, chat messages and chat templates, for GRPO prompts, SFT examples and preference pairs.

Run: `.venv/bin/python -m pytest tests/test_data_formats.py -q` (~2.5 minutes on 2 cores, mostly the two run
comparisons, GRPO and SFT; `-k "not _run_"` leaves them out: ~15 s)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import REPO_ROOT, read_metrics, without_measurements
from megatron_rl.spec.config.schema import DataConfig
from megatron_rl.spec.errors import ConfigError
from megatron_rl.data.chat import ChatFormat
from megatron_rl.data.preferences import SequenceEncoder, read_preference_records
from megatron_rl.data.prompts import PromptDataset, encode_prompt, load_eval_prompts, load_prompts
from megatron_rl.data.sft import encode_sft_example, read_sft_records
from megatron_rl.data.synthetic import split_problems, write_synthetic_dataset
from megatron_rl.data.tokenizer import CharTokenizer, load_tokenizer
from test_grpo_run import SHORT

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT = [{"role": "user", "content": "last of 387="}]


def synthetic_rows(tmp_path, count=12):
    """Records of the built-in synthetic task, with the prompt and answer fields renamed question/solution."""
    paths = write_synthetic_dataset(tmp_path / "synthetic", num_train=count, num_test=0, seed=3)
    lines = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    rows = [{"question": r["prompt"], "solution": r["answer"], "task": r["task"]} for r in lines]
    return paths["train"], rows


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_arrow(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def write_folder(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def chat_tokenizer(tmp_path, *, template=TEMPLATE, characters=""):
    """A local Hugging Face tokenizer (word-level over characters and role tokens), with ``template`` as the
    ``chat_template`` of its tokenizer_config.json (None: no template); ``characters`` join the vocabulary."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    roles = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    words = ["<pad>", "<s>", "</s>", "<unk>", *roles, *"abcdefghijklmnopqrstuvwxyz0123456789=+ .!?", *characters]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|[a-z]+\|>|<s>|</s>|."), "isolated")
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 unk_token="<unk>", additional_special_tokens=roles)
    folder = tmp_path / (("chat_tok" if template else "plain_tok") + ("_more" if characters else ""))
    hf.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(str(folder))


def template_ids(tok, messages, **kwargs):
    return list(tok.hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


# ---------------------------------------------------------------- formats and field mapping


@pytest.mark.parametrize("fmt", ["json", "parquet", "arrow", "folder"])
def test_every_format_reads_the_same_prompts_as_jsonl(tmp_path, fmt):
    jsonl, rows = synthetic_rows(tmp_path)
    if fmt == "json":
        path = tmp_path / "train.json"
        path.write_text(json.dumps(rows))
    else:
        path = {"parquet": write_parquet, "arrow": write_arrow, "folder": write_folder}[fmt](
            tmp_path / f"train.{fmt}" if fmt != "folder" else tmp_path / "train_folder", rows)
    expected = PromptDataset.from_files(jsonl)
    data = PromptDataset.from_files(path, prompt_key="question", answer_key="solution")
    assert [(r.prompt, r.answer, r.metadata) for r in data] == [(r.prompt, r.answer, r.metadata) for r in expected]
    assert data[2].source == f"{path} row 2" and data[2].prompt_ids is None
    assert PromptDataset.from_files(path, prompt_key="question", answer_key="solution").fingerprint == data.fingerprint


def test_missing_column_names_the_file_and_its_columns(tmp_path):
    _, rows = synthetic_rows(tmp_path)
    path = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(ConfigError) as err:
        PromptDataset.from_files(path)  # prompt_key defaults to "prompt"
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: no column 'prompt' (columns: question, solution, task); set data.prompt_key")
    with pytest.raises(ConfigError, match=rf"^{path}: no column 'answer' \(columns: question, solution, task\)"):
        PromptDataset.from_files(path, prompt_key="question")
    json_path = tmp_path / "pairs.json"
    json_path.write_text(json.dumps([{"prompt": "p", "chosen": "a"}]))
    with pytest.raises(ConfigError, match=rf"^{json_path}: no column 'rejected' \(columns: prompt, chosen\)"):
        read_preference_records(json_path)
    with pytest.raises(ConfigError, match=rf"^{path}: no column 'completion' \(columns: question, solution, task\)"):
        read_sft_records(path, prompt_key="question")


def test_unreadable_inputs_are_one_line_config_errors(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"prompt": "a",')
    other = tmp_path / "train.csv"
    other.write_text("prompt,answer\n")
    import datasets

    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "p", "answer": 1}])}).save_to_disk(splits)
    for path, message in [(broken, "datasets could not read it"), (bad_json, "datasets could not read it"),
                          (other, "unsupported format '.csv'"), (splits, "is a DatasetDict with splits train"),
                          (tmp_path / "nope.parquet", "not found")]:
        with pytest.raises(ConfigError, match=message) as err:
            PromptDataset.from_files(path)
        assert str(err.value).startswith(f"prompt file {path}") and "\n" not in str(err.value)


def test_reading_writes_no_cache_outside_a_deleted_temporary_folder(tmp_path):
    _, rows = synthetic_rows(tmp_path)
    path = write_parquet(tmp_path / "train.parquet", rows)
    home, temp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_"))}
    env.update(HOME=str(home), TMPDIR=str(temp))
    code = ("from megatron_rl.data.prompts import PromptDataset; "
            f"print(len(PromptDataset.from_files({str(path)!r}, prompt_key='question', answer_key='solution')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "12", done.stderr[-2000:]
    assert list(home.rglob("*")) == [] and list(temp.iterdir()) == []


# ---------------------------------------------------------------- chat messages


def test_messages_field_for_prompts_sft_and_pairs(tmp_path):
    rows = [{"messages": CHAT, "answer": "7"},
            {"messages": [{"role": "system", "content": "be brief."}, *CHAT], "answer": "7"}]
    path = write_parquet(tmp_path / "chat.parquet", rows)
    data = PromptDataset.from_files(path)
    assert data[0].prompt == "user: last of 387=\nassistant: " and data[0].metadata == {}
    assert data[1].prompt == "system: be brief.\nuser: last of 387=\nassistant: "
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"prompt": "x", "messages": CHAT, "answer": 1}) + "\n")
    with pytest.raises(ConfigError, match=rf"{both}:1: give the prompt as 'prompt' or as 'messages', not both"):
        PromptDataset.from_files(both)

    sft_path = tmp_path / "sft.jsonl"
    sft_path.write_text(json.dumps({"conv": [*CHAT, {"role": "assistant", "content": "7"}]}) + "\n"
                        + json.dumps({"conv": CHAT}) + "\n")
    with pytest.raises(ConfigError, match=rf"{sft_path}:2: 'conv' must be a list of messages ending in the "
                                          "assistant's reply"):
        read_sft_records(sft_path, messages_key="conv")
    sft_path.write_text(json.dumps({"conv": [*CHAT, {"role": "assistant", "content": "7"}]}) + "\n")
    [example] = read_sft_records(sft_path, messages_key="conv")
    assert example == {"prompt": CHAT, "completion": "7"}
    tok = CharTokenizer()
    ids, mask = encode_sft_example(tok, example["prompt"], example["completion"])
    assert tok.decode(ids) == "user: last of 387=\nassistant: 7"
    assert tok.decode([t for t, m in zip(ids, mask) if m], stop_at_eos=False, skip_special_tokens=False) == "7<eos>"

    pairs = write_parquet(tmp_path / "pairs.parquet", [{"messages": CHAT, "chosen": "7", "rejected": "3"}])
    [pair] = read_preference_records(pairs)
    assert pair.prompt == CHAT and pair.source == f"{pairs} row 0"


# ---------------------------------------------------------------- chat templates


def test_chat_template_puts_the_template_into_the_prompt_ids(tmp_path):
    tok = chat_tokenizer(tmp_path)
    cfg = DataConfig(chat_template=True, system_prompt="be brief.")
    chat_path = write_parquet(tmp_path / "chat.parquet", [{"messages": CHAT, "answer": "7"}])
    text_path = tmp_path / "text.jsonl"
    text_path.write_text(json.dumps({"prompt": "last of 387=", "answer": "7"}) + "\n")
    expected = template_ids(tok, [{"role": "system", "content": "be brief."}, *CHAT], add_generation_prompt=True)
    for path in (chat_path, text_path):  # a text prompt is the user's turn
        [record] = load_prompts(cfg, path, tok)
        assert list(record.prompt_ids) == expected == encode_prompt(tok, record)
        assert record.prompt == "<s><|system|>be brief.<|end|><|user|>last of 387=<|end|><|assistant|>"
    [plain] = load_prompts(DataConfig(), text_path, tok)
    assert plain.prompt_ids is None and encode_prompt(tok, plain) == tok.encode("last of 387=", add_bos=True)
    own_system = write_parquet(tmp_path / "own.parquet", [
        {"messages": [{"role": "system", "content": "think."}, *CHAT], "answer": "7"}])
    [record] = load_prompts(cfg, own_system, tok)
    assert "think." in record.prompt and "be brief." not in record.prompt  # the record's own system message wins


def test_arabic_text_passes_the_chat_template_tokenizer_and_export_unchanged(tmp_path):
    from megatron_rl.conversion.safetensors_io import copy_tokenizer_files
    from megatron_rl.data.tokenizer import ARABIC_CHARACTERS

    tok = chat_tokenizer(tmp_path, characters=ARABIC_CHARACTERS)
    question = "آخر رقم من ٣٨٧، ما هو؟"
    chat = [{"role": "user", "content": question}]
    path = write_parquet(tmp_path / "ar.parquet", [{"messages": chat, "answer": "٧"}])
    [record] = load_prompts(DataConfig(chat_template=True, system_prompt="أجب باختصار."), path, tok)
    assert record.prompt == f"<s><|system|>أجب باختصار.<|end|><|user|>{question}<|end|><|assistant|>"
    assert record.answer == "٧" and tok.hf.unk_token_id not in record.prompt_ids
    pieces = lambda ids: "".join(tok.hf.convert_ids_to_tokens(ids))  # noqa: E731 (this toy decoder adds spaces)
    assert pieces(tok.encode(question)) == question  # every character its own token, none lost
    ids, mask = encode_sft_example(tok, chat, "٧", chat=ChatFormat.from_config(DataConfig(chat_template=True), tok))
    assert pieces([i for i, m in zip(ids, mask) if m]) == "٧<|end|></s>"  # the trained tokens: the answer's turn
    exported = tmp_path / "export"
    exported.mkdir()
    assert "tokenizer.json" in copy_tokenizer_files(Path(tok.name), exported)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (Path(tok.name) / name).read_bytes()
    assert load_tokenizer(str(exported)).encode(question) == tok.encode(question)


def test_chat_template_for_sft_and_preference_pairs(tmp_path):
    tok = chat_tokenizer(tmp_path)
    chat = ChatFormat.from_config(DataConfig(chat_template=True, system_prompt="be brief."), tok)
    system = {"role": "system", "content": "be brief."}
    reply = {"role": "assistant", "content": "7"}
    ids, mask = encode_sft_example(tok, CHAT, "7", chat=chat)
    prompt_ids = template_ids(tok, [system, *CHAT], add_generation_prompt=True)
    assert ids == template_ids(tok, [system, *CHAT, reply]) + [tok.eos_id]  # the template ends the turn, not <eos>
    assert mask == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids)) and ids[:len(prompt_ids)] == prompt_ids
    assert encode_sft_example(tok, "last of 387=", "7", chat=chat) == (ids, mask)  # text: the user's turn

    encoder = SequenceEncoder(tok, chat)
    assert encoder.encode("last of 387=", "7") == template_ids(tok, [system, *CHAT, reply])
    assert SequenceEncoder(tok).encode("last of 387=", "7") == tok.hf("last of 387=7")["input_ids"] + [tok.eos_id]


def test_chat_template_needs_a_tokenizer_that_has_one(tmp_path):
    for tok in (CharTokenizer(), chat_tokenizer(tmp_path, template=None)):
        with pytest.raises(ConfigError, match=r"^data.chat_template=true but the tokenizer .* has no chat template; "
                                              "set data.chat_template=false"):
            ChatFormat.from_config(DataConfig(chat_template=True), tok)
    with pytest.raises(ConfigError, match="data.system_prompt is set but data.chat_template=false"):
        DataConfig(system_prompt="be brief.")


# ---------------------------------------------------------------- evaluation prompts


def test_load_eval_prompts(tmp_path):
    _, rows = synthetic_rows(tmp_path)
    path = write_parquet(tmp_path / "eval.parquet", rows)
    tok = CharTokenizer()

    def job(**data):
        return DataConfig(**data)

    held_out = load_eval_prompts(job(eval_path=str(path), prompt_key="question", answer_key="solution"), tok, seed=3)
    assert [(r.prompt, r.answer) for r in held_out] == [(r["question"], r["solution"]) for r in rows]
    synthetic = load_eval_prompts(job(task="last_digit"), tok, seed=3)
    train_problems, test_problems = split_problems("last_digit", seed=3)
    assert [(r.prompt, r.answer) for r in synthetic] == [(p["prompt"], p["answer"]) for p in test_problems]
    assert not {r.prompt for r in synthetic} & {p["prompt"] for p in train_problems}
    assert load_eval_prompts(job(train_path=str(path)), tok, seed=3) is None


# ---------------------------------------------------------------- a GRPO run from Parquet


def test_grpo_run_from_parquet_with_field_mapping_equals_the_jsonl_run(launch, tmp_path):
    """Same prompts, same order, same seed: a run reading Parquet through datasets (prompt_key=question,
    answer_key=solution) logs exactly the metrics of the run reading the same records from JSONL."""
    jsonl, rows = synthetic_rows(tmp_path, count=64)
    parquet = write_parquet(tmp_path / "train.parquet", rows)
    runs = {}
    for name, data in [("jsonl", [f"data.train_path={jsonl}"]),
                       ("parquet", [f"data.train_path={parquet}", "data.prompt_key=question",
                                    "data.answer_key=solution"])]:
        run_dir = tmp_path / name
        result = launch(*SHORT, f"run.dir={run_dir}", *data)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = without_measurements(read_metrics(run_dir))
    grpo = [m for m in runs["jsonl"] if m.get("phase") is None]
    assert [m["step"] for m in grpo] == [1, 2, 3, 4] and all("reward_mean" in m for m in grpo)
    assert runs["parquet"] == runs["jsonl"]


def test_sft_run_from_chat_parquet_equals_the_run_from_its_plain_text_jsonl(launch, tmp_path):
    """The SFT trainer reads a Parquet chat column (last message = completion) and trains exactly as on the same
    examples written out as the plain-text prompt/completion lines they render to without a chat template."""
    problems, _ = split_problems("add", seed=0)
    chats = [{"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["answer"]}]}
             for p in problems]
    parquet = write_parquet(tmp_path / "sft.parquet", chats)
    jsonl = tmp_path / "sft.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"user: {p['prompt']}\nassistant: ", "completion": p["answer"]})
                             + "\n" for p in problems))
    runs = {}
    for name, path in [("parquet", parquet), ("jsonl", jsonl)]:
        run_dir = tmp_path / name
        result = launch("cluster.executor=local", "logging.tensorboard=false", "algorithm.name=sft", "run.steps=3",
                        "algorithm.global_batch_size=8", "parallel.micro_batch_size=4", f"data.train_path={path}",
                        f"run.dir={run_dir}")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = without_measurements(read_metrics(run_dir))
    assert [m["step"] for m in runs["parquet"]] == [1, 2, 3] and runs["parquet"] == runs["jsonl"]
