"""JSON data (data.source json) says what seq_len cuts, as hf data does: samples cut, tokens cut and label tokens
lost in the row, a line before launch and in the trial's summary above 1% of the label tokens, and data.overflow
drop (truncate's alternative; split needs hf data)."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pytest
import yaml
from transformers import AutoTokenizer

from raybench.data.prepare import with_prepared_data
from raybench.drivers.trial import build_row, summary
from raybench.planning.plan import config_id, plan
from raybench.data import json_rows
from raybench.spec.errors import ConfigError
from raybench.spec.load import load_sweep, parse_sweep
from raybench.spec.sweep_spec import DataSpec, TrialConfig
from raybench.spec.tokenized_data import format_record

SEQ_LEN = 24  # the alpaca fixture's records hold 21 or 27 tokens (eos included)


@pytest.fixture(scope="module")
def record_tokens(model_dir, alpaca_file) -> list[int]:
    """Tokens per record, counted here from the tokenizer itself (the end-of-sequence token appended)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    records = [yaml.safe_load(line) for line in alpaca_file.read_text().splitlines()]
    return [len(tokenizer(format_record(r))["input_ids"]) + 1 for r in records]


def json_sweep(tmp_path, alpaca_file, model_dir, **data_fields) -> list:
    spec = {"name": "json-cut", "model": {"path": str(model_dir)},
            "data": {"source": "json", "path": str(alpaca_file), "packing": False, **data_fields},
            "train": {"seq_len": SEQ_LEN, "micro_batch": 2, "steps": 2, "warmup_steps": 1},
            "resources": {"workers": 1}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    return plan(load_sweep(tmp_path / "sweep.yaml"))


def test_truncated_json_samples_are_counted_before_launch_and_in_the_row(tmp_path, alpaca_file, model_dir,
                                                                          record_tokens, monkeypatch):
    longer = [n for n in record_tokens if n > SEQ_LEN]
    labels = sum(n - 1 for n in record_tokens)  # every token but a sample's first, as for hf data
    assert longer
    said: list[str] = []
    (trial,) = with_prepared_data(json_sweep(tmp_path, alpaca_file, model_dir), str(tmp_path / "store"), said.append)
    now = datetime.now(timezone.utc)
    row = build_row(trial.payload, "json-cut", "error", "a trial's message", None, now, now)
    assert (row["samples_cut"], row["tokens_cut"], row["label_tokens_cut"]) == (
        len(longer), sum(n - SEQ_LEN for n in longer), sum(n - SEQ_LEN for n in longer))
    assert row["label_tokens_cut_frac"] == pytest.approx(sum(n - SEQ_LEN for n in longer) / labels)
    assert row["data_samples"] == len(record_tokens) and row["sample_tokens_max"] == max(record_tokens)
    assert row["packing_efficiency"] == pytest.approx(sum(min(n, SEQ_LEN) for n in record_tokens)
                                                      / (len(record_tokens) * SEQ_LEN))
    assert any("of the label tokens" in line for line in said)  # before launch
    assert "[data.overflow truncate cut" in summary(row)  # the live view and the end of the run
    # The ranks find the rows the driver wrote: the same key, one Arrow file, a hit for the next sweep.
    assert row["data_cache"] == "build" and [p.name for p in (tmp_path / "store/_cache/data").iterdir()] == [
        f"{row['data_cache_key']}.arrow"]
    assert json_rows.dataset_cache_key(trial.config.data, str(model_dir), SEQ_LEN) == row["data_cache_key"]
    # A hit reads the counts the build kept in the file: nothing is tokenized again, and they are the same.
    def no_tokenizing(*args):
        raise AssertionError("a cache hit tokenized the data again")

    monkeypatch.setattr(json_rows, "tokenize_records", no_tokenizing)
    (again,) = with_prepared_data(json_sweep(tmp_path, alpaca_file, model_dir), str(tmp_path / "store"), said.append)
    assert again.payload.tokenized.cache == "hit" and again.payload.tokenized.build_s is None
    assert dataclasses.replace(again.payload.tokenized, cache="build", build_s=None) == dataclasses.replace(
        trial.payload.tokenized, build_s=None)


def test_overflow_drop_leaves_longer_json_samples_out(tmp_path, alpaca_file, model_dir, record_tokens):
    (trial,) = with_prepared_data(json_sweep(tmp_path, alpaca_file, model_dir, overflow="drop"), str(tmp_path / "s"),
                             lambda line: None)
    ref = trial.payload.tokenized
    longer = [n for n in record_tokens if n > SEQ_LEN]
    assert (ref.samples_cut, ref.tokens_cut, ref.label_tokens_cut) == (
        len(longer), sum(longer), sum(n - 1 for n in longer))
    rows = json_rows.cached_text_dataset(trial.config.data, str(model_dir), SEQ_LEN, str(tmp_path / "s" / "_cache"))
    ids, mask = rows.tensors
    assert len(ids) == len(record_tokens) - len(longer)  # one padded row per kept sample
    assert sorted(mask.sum(dim=1).tolist()) == sorted(n for n in record_tokens if n <= SEQ_LEN)  # none truncated


def test_packed_json_truncates_nothing(tmp_path, alpaca_file, model_dir, record_tokens):
    """Packed JSON samples run on from one row into the next: truncate cuts none of them."""
    (trial,) = with_prepared_data(json_sweep(tmp_path, alpaca_file, model_dir, packing=True), str(tmp_path / "s"),
                             lambda line: None)
    ref = trial.payload.tokenized
    assert (ref.samples_cut, ref.tokens_cut, ref.label_tokens_cut, ref.packing_efficiency) == (0, 0, 0, 1.0)
    assert ref.cut_note() is None


def test_json_takes_truncate_or_drop_and_keeps_its_trial_ids(alpaca_file, model_dir):
    def json_id(**fields) -> str:
        return config_id(TrialConfig.model_validate({"model": {"preset": "tiny"}, "data": {
            "source": "json", "path": "/data/a.json", "tokenizer": "/tok", **fields}}))

    assert json_id(overflow="truncate") == json_id() != json_id(overflow="drop")
    assert "overflow" not in DataSpec(source="json", path="/data/a.json").model_dump()
    base = {"name": "x", "model": {"path": str(model_dir)}, "data": {"source": "json", "path": str(alpaca_file)}}
    parse_sweep({**base, "data": {**base["data"], "overflow": "drop"}})
    with pytest.raises(ConfigError) as err:
        parse_sweep({**base, "data": {**base["data"], "overflow": "split"}})
    assert [p.field for p in err.value.problems] == ["data.overflow"] and "truncate or drop" in str(err.value)
