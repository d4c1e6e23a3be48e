"""Real data's content is checked before launch: a directory of one format, every record (streamed, bounded, each
problem by file and line), the tokenizer against the model's embeddings; and a build that fails anyway leaves
nothing in the store."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raybench.cli import main as cli
from raybench.data import records, tokenized
from raybench.spec.sweep_spec import DataSpec
from tests.conftest import CHAT_TEMPLATE, chat_records, make_chat_tokenizer, write_sweep


def text_spec(path, **extra) -> DataSpec:
    return DataSpec(source="hf", path=str(path), **extra)


def write_lines(path, records_or_lines) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records_or_lines))


def test_a_directory_of_mixed_formats_is_refused(tmp_path, chat_tokenizer):
    data = tmp_path / "data"
    data.mkdir()
    write_lines(data / "part-a.jsonl", [{"text": f"the fox {i}"} for i in range(100)])
    pq.write_table(pa.table({"text": [f"a dog {i}" for i in range(300)]}), data / "part-b.parquet")
    (data / "README.md").write_text("# a dataset card is not a record file")
    (data / "dataset_infos.json").write_text("{}")  # nor its metadata, which datasets never reads as records
    found = tokenized.problems(text_spec(data), str(chat_tokenizer))
    assert [(p.field, p.value) for p in found] == [("data.path", str(data))]
    assert "json (1 file(s): part-a.jsonl), parquet (1 file(s): part-b.parquet)" in found[0].message
    (data / "part-a.jsonl").unlink()  # one format (and its card): read as it is
    assert tokenized.problems(text_spec(data), str(chat_tokenizer)) == []


def test_every_record_is_checked_and_each_problem_named_by_file_and_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    good = chat_records(200)
    lines = [*good[:99], *({"text": "not a conversation"} for _ in range(101))]  # records 100 on lack messages
    write_lines(path, lines)
    found = records.problems(text_spec(path, format="messages"))
    assert len(found) == records.MAX_PROBLEMS + 1  # bounded: the first ten, and that the check stopped
    assert [p.value for p in found[:3]] == [f"{path}:100", f"{path}:101", f"{path}:102"]
    assert "no 'messages' (the record has: text)" in found[0].message
    assert "stopped at the first 10 problems" in found[-1].message


@pytest.mark.parametrize("bad, expected", [
    ('{"text": "an unclosed string}', "not JSON: Unterminated string starting at column 10"),
    ('["a list"]', "a JSON list, not a record"),
    ('{"text": 7}', "'text' holds int (7), not text"),
    ('{"text": null}', "no 'text' (the record has: nothing)"),
])
def test_a_bad_line_deep_in_a_file_is_found(tmp_path, bad, expected):
    path = tmp_path / "big.jsonl"
    write_lines(path, [*({"text": f"the quick fox {i}"} for i in range(4999)), bad, {"text": "last"}])
    found = records.problems(text_spec(path))
    assert [(p.field, p.value) for p in found] == [("data.path", f"{path}:5000")] and expected in found[0].message


def test_messages_and_alpaca_records_are_checked_field_by_field(tmp_path):
    chats = chat_records(4)
    chats[2]["messages"][1]["content"] = {"nested": 1}
    chats[3]["messages"] = []
    write_lines(tmp_path / "chat.jsonl", chats)
    found = records.problems(text_spec(tmp_path / "chat.jsonl", format="messages"))
    assert [p.value.rsplit(":", 1)[1] for p in found] == ["3", "4"]
    assert "'messages' message 1 is" in found[0].message and "a non-empty list" in found[1].message
    write_lines(tmp_path / "alpaca.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "a", "input": 3,
                                                                                  "output": "b"}])
    found = records.problems(text_spec(tmp_path / "alpaca.jsonl", format="alpaca"))
    assert [p.value for p in found] == [f"{tmp_path / 'alpaca.jsonl'}:2"] and "'input' holds int" in found[0].message


def test_parquet_and_saved_datasets_are_checked_by_record(tmp_path):
    import datasets

    table = pa.table({"text": ["a", None, "c"]})
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    pq.write_table(table, repo / "train-00000-of-00001.parquet")
    found = records.problems(text_spec(tmp_path / "repo"))
    assert [p.value for p in found] == [f"{repo / 'train-00000-of-00001.parquet'} record 2"]
    datasets.DatasetDict({"train": datasets.Dataset(table)}).save_to_disk(str(tmp_path / "saved"))
    found = records.problems(text_spec(tmp_path / "saved"))
    assert [p.value for p in found] == [f"{tmp_path / 'saved'} (train) record 2"]


def test_records_past_max_samples_are_never_tokenized_but_every_json_line_must_parse(tmp_path):
    path = tmp_path / "data.jsonl"
    write_lines(path, [{"text": "a"}, {"text": "b"}, {"body": "past max_samples"}])
    assert records.problems(text_spec(path, max_samples=2)) == []
    write_lines(path, [{"text": "a"}, {"text": "b"}, "{not json"])
    assert [p.value for p in records.problems(text_spec(path, max_samples=2))] == [f"{path}:3"]


def test_a_wrong_column_is_said_once_as_a_setting(tmp_path, chat_file):
    found = records.problems(text_spec(chat_file))  # messages records read as text
    assert [(p.field, p.value) for p in found] == [("data.field", None)]
    assert "no column 'text'" in found[0].message and "set data.field" in found[0].message


def test_a_build_that_fails_leaves_nothing_in_the_store(tmp_path, capsys, model_dir):
    """The checks pass (every record has {role, content} messages); the build then fails on a record the template
    refuses: `run` exits 2, and the store, its cache folders included, is not there."""
    tokenizer = make_chat_tokenizer(tmp_path / "tok")
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool "
                               "turns') }}{% endif %}{% endfor %}" + CHAT_TEMPLATE)
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    (tokenizer / "chat_template.jinja").unlink(missing_ok=True)
    chats = chat_records(3)
    chats[2]["messages"][0]["role"] = "tool"
    write_lines(tmp_path / "chat.jsonl", chats)
    sweep = write_sweep(tmp_path / "sweep.yaml", f"""
name: build-fails
model: {{path: {model_dir}}}
train: {{steps: 2, warmup_steps: 1, seq_len: 32}}
data: {{source: hf, path: {tmp_path / 'chat.jsonl'}, tokenizer: {tokenizer}, format: messages}}
""")
    store = tmp_path / "store"
    assert cli.main(["validate", str(sweep)]) == 0
    assert cli.main(["run", str(sweep), "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert "no tool turns" in err and "nothing was launched or written" in err
    assert not store.exists()


def test_a_tokenizer_with_more_tokens_than_the_model_has_rows_is_refused(tmp_path, capsys, chat_file, model_dir):
    from transformers import AutoTokenizer

    tokenizer = make_chat_tokenizer(tmp_path / "tok")  # 36 tokens; the model has 128 embedding rows
    sweep = write_sweep(tmp_path / "sweep.yaml", f"""
name: vocab
model: {{path: {model_dir}}}
data: {{source: hf, path: {chat_file}, tokenizer: {tokenizer}, format: messages}}
""")
    assert cli.main(["validate", str(sweep)]) == 0
    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.add_tokens([f"<extra_{i}>" for i in range(100)])  # added tokens are ids the data can hold
    tok.save_pretrained(tokenizer)
    capsys.readouterr()
    assert cli.main(["validate", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert f"data.tokenizer = '{tokenizer}': has 136 tokens" in err
    assert f"the model (model.path {model_dir}) has vocab_size 128" in err and "use the model's own tokenizer" in err
