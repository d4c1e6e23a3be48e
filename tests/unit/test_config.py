"""Sweep validation: every problem reported at once, with field, value and fix; exit 2; nothing written."""

from __future__ import annotations

from fractions import Fraction

import pytest

from raybench.cli import main as cli
from raybench.planning.plan import plan
from raybench.spec.errors import ConfigError
from raybench.spec.load import load_sweep, parse_sweep
from raybench.spec.values import parse_ratio
from conftest import make_model_dir

BASE = {"name": "t", "model": {"preset": "tiny"}}


def problems(raw: dict) -> list:
    with pytest.raises(ConfigError) as info:
        parse_sweep(raw)
    return info.value.problems


def fields(raw: dict) -> set[str]:
    return {p.field for p in problems(raw)}


def test_three_separate_mistakes_reported_together():
    raw = {**BASE, "train": {"stpes": 10, "micro_batch": 0, "strategy": "dpp"}}
    found = problems(raw)
    assert {p.field for p in found} == {"train.stpes", "train.micro_batch", "train.strategy"}
    typo = next(p for p in found if p.field == "train.stpes")
    assert "did you mean 'steps'" in typo.message
    strategy = next(p for p in found if p.field == "train.strategy")
    assert strategy.value == "dpp" and "ddp" in strategy.message


def test_wrong_types_and_unknown_top_level_key():
    raw = {**BASE, "resources": {"workers": "two"}, "repeat": 3}
    assert fields(raw) == {"resources.workers", "repeat"}
    assert "did you mean 'repeats'" in next(p for p in problems(raw) if p.field == "repeat").message


@pytest.mark.parametrize("value", [1.5, "1/0", "__import__('os').system('true')", "1/2+1/4", True, -0.25, "3/2"])
def test_bad_ac_ratio_names_the_field(value):
    found = problems({**BASE, "train": {"ac_ratio": value}})
    assert [p.field for p in found] == ["train.ac_ratio"]


@pytest.mark.parametrize("value, expected", [("3/4", Fraction(3, 4)), (0.5, Fraction(1, 2)), ("0.25", Fraction(1, 4)),
                                             (0, Fraction(0)), (1, Fraction(1)), (" 1 / 3 ", Fraction(1, 3))])
def test_ac_ratio_parsing(value, expected):
    assert parse_ratio(value) == expected


def test_equal_ratios_have_one_spelling():
    a = parse_sweep({**BASE, "train": {"ac_ratio": 0.5}})
    b = parse_sweep({**BASE, "train": {"ac_ratio": "1/2"}})
    assert a.train.ac_ratio == b.train.ac_ratio == "1/2"


def test_axes_errors_point_at_the_bad_value():
    raw = {**BASE, "axes": {"train.strategy": ["ddp", "zero9"], "train.micro_bach": [1], "train.seq_len": []}}
    assert fields(raw) == {"axes.train.strategy[1]", "axes.train.micro_bach", "axes.train.seq_len"}
    assert "did you mean 'train.micro_batch'" in next(p.message for p in problems(raw)
                                                      if p.field == "axes.train.micro_bach")


def test_model_needs_exactly_one_source():
    assert fields({"name": "t", "model": {}}) == {"model"}
    assert fields({"name": "t", "model": {"preset": "tiny", "path": "/nonexistent"}}) >= {"model"}


def test_an_axis_picks_the_model_as_the_model_section_does():
    """The model section may be left to an axis; every trial still gets exactly one of a preset or a path."""
    assert [t.config.model.preset for t in plan(parse_sweep({"name": "t", "axes": {"model.preset": ["tiny", "llama-3.2-1b"]}}))] == ["tiny", "llama-3.2-1b"]
    assert [(p.field, p.value) for p in problems({"name": "t", "axes": {"model.preset": ["tiny", None]}})] == [
        ("model", {"preset": None, "path": None})]
    both = problems({**BASE, "axes": {"model.path": ["/nonexistent"]}})
    assert [(p.field, p.value) for p in both][0] == ("model", {"preset": "tiny", "path": "/nonexistent"})


def test_paths_an_axis_sets_are_resolved_against_the_sweep_file_and_checked_as_the_sections_are(tmp_path):
    make_model_dir(tmp_path / "models" / "a")
    make_model_dir(tmp_path / "models" / "b", layers=3)
    (tmp_path / "sweeps").mkdir()
    sweep = tmp_path / "sweeps" / "models.yaml"
    sweep.write_text("name: m\ntrain: {steps: 2, warmup_steps: 1}\n"
                     "axes: {model.path: [../models/a, ../models/b, ../models/c]}\n")
    with pytest.raises(ConfigError) as err:
        load_sweep(sweep)
    assert [(p.field, p.value) for p in err.value.problems] == [("model.path", str(tmp_path / "models" / "c"))]
    # A bundle's paths too; an excluded point is not checked (nor planned).
    sweep.write_text("name: m\ntrain: {steps: 2, warmup_steps: 1}\n"
                     "axes: {setup: [{model.path: ../models/a, data.source: json, data.path: ../chat.json},"
                     " {model.path: ../models/b}, {model.path: ../models/c}]}\n"
                     "exclude: [{setup: {model.path: ../models/c}}]\n")
    with pytest.raises(ConfigError) as err:
        load_sweep(sweep)
    assert [(p.field, p.value) for p in err.value.problems] == [("data.path", str(tmp_path / "chat.json"))]
    sweep.write_text("name: m\ntrain: {steps: 2, warmup_steps: 1}\naxes: {model.path: [../models/a, ../models/b]}\n")
    trials = plan(load_sweep(sweep))
    assert [t.config.model.path for t in trials] == [str(tmp_path / "models" / "a"), str(tmp_path / "models" / "b")]
    assert len({t.trial_id for t in trials}) == 2


def test_missing_paths_and_pickle_only_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80")
    found = problems({"name": "t", "model": {"path": str(tmp_path)},
                      "data": {"source": "json", "path": str(tmp_path / "missing.jsonl")}})
    by_field = {p.field: p.message for p in found}
    assert "pickle" in by_field["model.path"] and "allow_pickle" in by_field["model.path"]
    assert by_field["data.path"] == "file not found; point it at a JSON or JSON Lines file of records"
    parse_sweep({"name": "t", "model": {"path": str(tmp_path), "allow_pickle": True}})  # explicit opt-in is accepted


def test_a_missing_path_says_the_fix_and_the_shipped_example_data_how_to_make_it(tmp_path):
    """A shipped CPU sweep's example-data paths, before `raybench example-data` made them: each problem names the
    command that does (the folder as the sweep resolves it); any other missing path says what to point it at."""
    sweep = tmp_path / "chat.yaml"
    sweep.write_text("name: c\nmodel: {path: example-data/tiny-model}\ndata: {source: hf, path: example-data/chat.jsonl,"
                     " tokenizer: example-data/chat-tokenizer, format: messages}\n")
    with pytest.raises(ConfigError) as err:
        load_sweep(sweep)
    made_by = f"raybench example-data {tmp_path / 'example-data'}"
    assert {p.field for p in err.value.problems} == {"model.path", "data.path", "data.tokenizer"}
    assert all(p.message.endswith(made_by) for p in err.value.problems), err.value.problems
    elsewhere = problems({"name": "t", "model": {"path": str(tmp_path / "models" / "llama")}})
    assert [p.message for p in elsewhere] == ["directory not found; point it at a local Hugging Face model directory "
                                              "(config.json and safetensors weights)"]


def test_cli_validate_exits_2_and_lists_all(tmp_path, capsys):
    sweep = tmp_path / "bad.yaml"
    sweep.write_text("name: bad\nmodel: {preset: tiny}\ntrain: {stpes: 10, micro_batch: 0, strategy: dpp}\n"
                     "store: " + str(tmp_path / "store") + "\n")
    assert cli.main(["validate", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "3 problem(s)" in err
    for name in ("train.stpes", "train.micro_batch", "train.strategy"):
        assert name in err
    assert "Traceback" not in err
    assert cli.main(["run", str(sweep)]) == 2
    assert not (tmp_path / "store").exists()


def test_cross_field_rule_rejected_at_plan_time(tmp_path, capsys):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nmodel: {preset: tiny}\ntrain: {steps: 4}\naxes: {train.warmup_steps: [1, 4]}\n")
    assert cli.main(["validate", str(sweep)]) == 2
    assert "train.warmup_steps" in capsys.readouterr().err
    assert cli.main(["validate", str(sweep), "--keep-invalid"]) == 0


def test_a_key_given_twice_is_bad_input_not_the_last_one_silently(tmp_path, capsys):
    sweep = tmp_path / "twice.yaml"
    sweep.write_text("name: t\nmodel: {preset: tiny}\naxes: {train.micro_batch: [1, 2]}\n"
                     f"axes: {{train.seq_len: [64]}}\nstore: {tmp_path / 'store'}\n")
    assert cli.main(["run", str(sweep)]) == 2
    assert "axes = 'lines 3 and 4': given twice in one mapping" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()
    sweep.write_text("name: t\nmodel: {preset: tiny}\ntrain: {steps: 4, lr: 1.0e-3, steps: 5}\n")
    with pytest.raises(ConfigError, match="steps = 'lines 3 and 3'"):
        load_sweep(sweep)
    # A merge key's fields may be overridden: that is what it is for.
    sweep.write_text("name: t\nmodel: {preset: tiny}\naxes:\n  setup:\n    - &short {train.steps: 4, train.seq_len: 64}"
                     "\n    - {<<: *short, train.steps: 8}\n")
    assert [a["train.steps"] for a in load_sweep(sweep).axes["setup"]] == [4, 8]


def test_yaml_syntax_and_missing_file(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_sweep(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_sweep(tmp_path / "nope.yaml")
