"""Bad input: a corpus of malformed sweeps and property-based fuzzing of the loader.

Each bad sweep must give a ConfigError whose problems name the field (the corpus file's `# expect:` line),
`raybench validate` and `raybench run` must exit 2 with no traceback, and nothing may be launched or written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raybench.cli import main as cli
from raybench.drivers.ray_cluster import TEMP_ROOT
from raybench.planning.plan import plan
from raybench.spec.errors import ConfigError
from raybench.spec.load import load_sweep, parse_sweep
from raybench.spec.sweep_spec import SweepSpec
from raybench.spec.values import parse_ratio

CORPUS = Path(__file__).resolve().parents[1] / "data" / "bad_sweeps"
BAD = sorted(CORPUS.glob("*.yaml"))
PWNED = Path("/tmp/raybench-pwned")  # what the code-injection cases would create if anything ran them


def _expected_field(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} needs an '# expect: FIELD' first line"
    return first.removeprefix("# expect: ").strip()


def _problems(path: Path) -> list:
    with pytest.raises(ConfigError) as err:
        plan(load_sweep(path), source=str(path))  # load checks fields; plan checks combinations
    return err.value.problems


def test_corpus_is_large_enough():
    assert len(BAD) >= 30


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_sweep_names_its_field(path):
    field = _expected_field(path)
    problems = _problems(path)
    assert any(p.field == field or p.field.startswith(field + ".") or p.field.startswith(field + "[")
               for p in problems), [str(p) for p in problems]
    assert all(p.field and p.message for p in problems)
    assert not PWNED.exists()


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_sweep_exits_2_and_launches_nothing(path, tmp_path, capsys):
    ray_dirs = set(Path(TEMP_ROOT).glob("rb-*"))
    store = tmp_path / "store"
    assert cli.main(["validate", str(path)]) == 2
    assert cli.main(["run", str(path), "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert _expected_field(path) in err and "Traceback" not in err
    assert "nothing was launched or written" in err
    assert not store.exists() and set(Path(TEMP_ROOT).glob("rb-*")) == ray_dirs
    assert not PWNED.exists()


@pytest.mark.parametrize("name", ["ac_ratio_code", "yaml_python_tag", "unknown_train_key"])
def test_bad_sweep_as_a_real_process(name):
    proc = subprocess.run([sys.executable, "-m", "raybench", "validate", str(CORPUS / f"{name}.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert _expected_field(CORPUS / f"{name}.yaml") in proc.stderr


# ---- property-based fuzzing --------------------------------------------------------------------------------

FIELD_NAMES = sorted({*SweepSpec.model_fields, "workers", "steps", "seq_len", "ac_ratio", "strategy", "preset",
                      "micro_batch", "timeout_s", "memory_limit_gib", "path", "source", "lr", "train.seed",
                      "train.ac_ratio", "resources.workers", "model.preset", "model.path", "data.source",
                      "data.path", "data.tokenizer"})
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["1/0", "3/4", "__import__('os')", "-1", "1e9", "tiny",
                                                           "ddp", "fsdp2", "0.5", "nan", "inf"]))
keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(keys, inner, max_size=4)), max_leaves=12)
sections = st.dictionaries(keys, values, max_size=6)


def _loads_or_config_error(raw) -> None:
    try:
        spec = parse_sweep(raw, "<fuzz>", Path("/nonexistent-base"))
        plan(spec)
    except ConfigError as err:
        assert err.problems and all(p.field and p.message for p in err.problems)
        err.report()  # renders without raising, whatever the bad value is


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(top=sections, train=sections, resources=sections, axes=st.dictionaries(keys, values, max_size=3))
def test_fuzz_loader_only_raises_config_error(top, train, resources, axes):
    raw = {"name": "fuzz", "model": {"preset": "tiny"}, **top}
    raw.setdefault("train", train)
    raw.setdefault("resources", resources)
    raw.setdefault("axes", axes)
    _loads_or_config_error(raw)


@settings(max_examples=300, deadline=None)
@given(raw=values)
def test_fuzz_any_yaml_value_is_a_clear_error(raw):
    _loads_or_config_error(raw)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_fuzz_raw_yaml_text(text, tmp_path):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    try:
        plan(load_sweep(path))
    except ConfigError as err:
        assert err.problems


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(scalars, st.from_regex(r"\s*\d{1,25}\s*/\s*\d{1,25}\s*", fullmatch=True)))
def test_fuzz_ac_ratio_is_parsed_never_evaluated(value):
    try:
        ratio = parse_ratio(value)
    except ValueError as err:
        assert str(err)
    else:
        assert isinstance(ratio, Fraction) and 0 <= ratio <= 1
    assert not PWNED.exists()


def test_binary_and_odd_files_are_clear_errors(tmp_path):
    cases = {"binary.yaml": b"\xff\xfe\x00\x01name", "date.yaml": b"name: 2001-13-45\nmodel: {preset: tiny}\n",
             "deep.yaml": b"[" * 5000 + b"]" * 5000}
    for name, body in cases.items():
        path = tmp_path / name
        path.write_bytes(body)
        with pytest.raises(ConfigError):
            load_sweep(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_sweep(tmp_path)  # a directory
    assert os.listdir(tmp_path) == sorted(cases) or set(os.listdir(tmp_path)) == set(cases)


def test_yaml_is_loaded_safely():
    # The loader must never build Python objects from tags; yaml_python_tag in the corpus shows the error.
    assert yaml.safe_load("a: 1") == {"a": 1}


def test_validate_lists_every_mistake_of_a_file_in_one_pass(tmp_path, capsys):
    """A wrong type, a misspelt axis and a rule every grid point breaks: one `validate` names all three, the type
    with what it expects, the base config's mistake once (not once per grid point) with its fix in the base."""
    sweep = tmp_path / "three.yaml"
    sweep.write_text("name: three\nmodel: {preset: tiny}\n"
                     "train: {steps: 4, warmup_steps: 6, micro_batch: four}\nresources: {workers: 2}\n"
                     "axes: {train.stratgy: [ddp, fsdp2], train.ac_ratio: ['0', '1']}\n")
    assert cli.main(["validate", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "3 problem(s)" in err and "Traceback" not in err
    assert "train.micro_batch = 'four'" in err and "expected an integer >= 1 and <= 4096, e.g. 1" in err
    assert "did you mean 'train.strategy'?" in err
    assert err.count("warmup_steps (6) must be below steps (4)") == 1
    assert "at every grid point: fix it in the sweep's train section" in err
    # A rule some grid points break is still named at each of them, with the exclude that drops it.
    sweep.write_text("name: some\nmodel: {preset: tiny}\ntrain: {steps: 4}\nresources: {workers: 2}\n"
                     "axes: {train.warmup_steps: [1, 6, 7]}\n")
    assert cli.main(["validate", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "2 problem(s)" in err and err.count("drop this point with `exclude:`") == 2
