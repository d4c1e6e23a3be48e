"""Every command of the README's table, each documented flag once, through the real command line on tiny sweeps
and planted stores; each test reads what the command printed or wrote back.

`trial`, `slurm submit` and `cluster up|status|down` start torchrun, SLURM or Ray: the integration tests run
them (test_torchrun_trial.py, test_estimate_trial.py; test_slurm.py with `submit --store --wait`,
`status --json` and `run --cluster --store --quiet`). `run` is run here on a store that already holds every
trial, which starts nothing.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest
from planted_rows import SWEEP, plant_cpu_store, plant_gpu_store

from raybench.cli.main import main
from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.results import rehearsals, store
from raybench.spec.load import load_sweep
from raybench.spec.payload import TrialPayload
from raybench.spec.schema import RankResult

TINY_TRAIN = {"steps": 4, "warmup_steps": 1, "seq_len": 64, "micro_batch": 1, "precision": "fp32"}


def write_sweep(path: Path, **sections) -> str:
    sweep = {"name": "cli", "model": {"preset": "tiny"}, "train": TINY_TRAIN, "resources": {"workers": 2},
             "store": str(path.parent / "sweep-store"), "axes": {"train.strategy": ["ddp", "fsdp2"]}, **sections}
    path.write_text(json.dumps(sweep))  # JSON is YAML
    return str(path)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def gpu_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("planted")
    plant_gpu_store(path)
    return path


@pytest.fixture()
def cpu_store(tmp_path) -> Path:
    path = tmp_path / "cpu-store"
    plant_cpu_store(path)
    return path


def test_validate(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s.yaml")
    assert main(["validate", sweep]) == 0
    assert capsys.readouterr().out.strip() == f"{sweep}: ok (2 trials)"


def test_plan_table_and_json(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s.yaml")
    trials = plan(load_sweep(sweep))
    assert main(["plan", sweep]) == 0
    table = capsys.readouterr().out
    assert all(t.trial_id in table for t in trials) and "2 trials, sweep 'cli'" in table

    assert main(["plan", sweep, "--json"]) == 0
    lines = json_lines(capsys.readouterr().out)
    assert [line["trial_id"] for line in lines] == [t.trial_id for t in trials]
    assert [line["axis_values"] for line in lines] == [{"train.strategy": "ddp"}, {"train.strategy": "fsdp2"}]
    assert [(line["status"], line["reasons"]) for line in lines] == [("planned", [])] * 2
    assert lines[1]["config"]["train"]["strategy"] == "fsdp2" and lines[1]["estimate"]["peak_gib"] > 0
    # Each line is the trial's payload as executors get it, plus its plan status: it reads back unchanged.
    payloads = [TrialPayload.from_dict({k: v for k, v in line.items() if k not in ("status", "reasons")})
                for line in lines]
    assert payloads == [t.payload for t in trials]


def test_estimate_calibrated_by_the_given_store(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s.yaml")
    first = plan(load_sweep(sweep))[0]
    measured = tmp_path / "measured"  # one ok CPU row that measured twice the estimate's peak
    part_gib = first.payload.to_dict()["estimate"]["measured_part_gib"]
    store.write_row(measured, build_row(first.payload, "cli", "ok", "", RankResult.from_columns({
        "peak_rss_gib": 2 * part_gib, "device_type": "cpu"})))
    assert main(["estimate", sweep, "--json"]) == 0  # the sweep's own store holds nothing
    assert [line["estimate"]["calibration"] for line in json_lines(capsys.readouterr().out)] == [None, None]

    assert main(["estimate", sweep, "--store", str(measured), "--json"]) == 0
    lines = json_lines(capsys.readouterr().out)
    assert [line["trial_id"] for line in lines] == [first.trial_id, plan(load_sweep(sweep))[1].trial_id]
    ddp = lines[0]["estimate"]  # the row calibrates its own model x strategy x device only
    assert ddp["calibration"] == pytest.approx(2.0) and ddp["calibration_rows"] == 1
    assert ddp["peak_calibrated_gib"] == pytest.approx(ddp["peak_gib"] + ddp["measured_part_gib"])
    assert lines[1]["estimate"]["calibration"] is None

    assert main(["estimate", sweep, "--store", str(measured)]) == 0
    assert f"1 calibrated by measured rows in {measured}" in capsys.readouterr().out


def test_rehearse_one_trial_then_best_predict(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s.yaml", train={**TINY_TRAIN, "strategy": "fsdp2", "precision": "bf16"},
                        resources={"workers": 2, "gpus_per_worker": 1}, estimate={"gpu": "H100 SXM"},
                        axes={"train.ac_ratio": ["0", "1"]})
    trials = plan(load_sweep(sweep))
    assert main(["rehearse", sweep, "--trial", trials[1].trial_id, "--gpu", "H200", "--busbw", "45",
                 "--json"]) == 0
    (row,) = json_lines(capsys.readouterr().out)
    assert (row["trial_id"], row["config_id"], row["gpu"]) == (trials[1].trial_id, trials[1].config_id, "H200")
    assert (row["method"], row["busbw_gbps"], row["busbw_source"]) == ("traced", 45.0, "set")
    store_path = tmp_path / "sweep-store"
    assert set(rehearsals.rehearsals(store_path)) == {trials[1].config_id}
    # Trial 0 has no rehearsal: left out, trial 1 would be called best without a word; it is named instead.
    assert main(["best", sweep, "--predict", "--gpu", "H200"]) == 2
    err = capsys.readouterr().err
    assert "not rehearsed for H200 (1 trial(s) with none: " + trials[0].trial_id in err and "first" in err

    assert main(["rehearse", sweep, "--trial", "0"]) == 0  # by plan index; a table
    assert trials[0].config_id in capsys.readouterr().out
    assert set(rehearsals.rehearsals(store_path)) == {t.config_id for t in trials}

    # Trial 1 was priced for an H200: the H100's prediction would answer with its figures, so it is refused.
    assert main(["best", sweep, "--predict", "--gpu", "H100 SXM"]) == 2
    err = capsys.readouterr().err
    assert "not rehearsed for H100 SXM (1 rehearsal(s) priced for H200)" in err and "--gpu 'H100 SXM'` first" in err
    # Rehearsed for the GPU asked, each prediction fits the rehearsals in its memory: 10% of it kept as the margin.
    for gpu, memory_gib in (("H100 SXM", 79.6474609375), ("A100 40GB", 39.5859375)):
        assert main(["rehearse", sweep, "--gpu", gpu]) == 0
        capsys.readouterr()
        assert main(["best", sweep, "--predict", "--gpu", gpu]) == 0
        out = capsys.readouterr().out
        assert "best ac_ratio" in out and f" {0.9 * memory_gib:.1f} " in out
    assert main(["best", sweep, "--predict", "--gpu", "H100 SXM"]) == 2  # the store's rehearsals are the A100's now
    assert "2 rehearsal(s) priced for A100 40GB" in capsys.readouterr().err
    for command in (["best", sweep, "--predict"], ["rehearse", sweep]):
        assert main([*command, "--gpu", "Foo 9000"]) == 2
        err = capsys.readouterr().err
        assert "--gpu" in err and "Foo 9000" in err and "unknown GPU; use one of" in err and "H100 SXM" in err


def test_report_of_no_store_is_bad_input_and_an_empty_one_has_no_results(tmp_path, capsys):
    """A missing directory or a sweep file given as the store exits 2 saying so, not "No results" and 0."""
    sweep = write_sweep(tmp_path / "s.yaml")
    for store, words in ((str(tmp_path / "nope"), "no such directory"), (sweep, "a file, not a store")):
        assert main(["report", store]) == 2
        err = capsys.readouterr().err
        assert store in err and words in err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 0


def test_report_table_and_files(gpu_store, tmp_path, capsys):
    """The Markdown report (with its PNG figures); test_report_plots.py writes the HTML and PNG-only reports."""
    assert main(["report", str(gpu_store), "--sweep", SWEEP]) == 0
    table = capsys.readouterr().out
    assert "broken-r0" in table and "error" in table
    out = tmp_path / "r.md"
    assert main(["report", str(gpu_store), "--sweep", SWEEP, "--format", "md", "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    text = out.read_text()
    figures = re.findall(r"\]\(([^)]+\.png)\)", text)
    assert f"sweep {SWEEP}" in text and figures and all((tmp_path / link).is_file() for link in figures)


def test_compare_systems(gpu_store, capsys):
    assert main(["compare", str(gpu_store), "--systems", "della,snellius"]) == 0
    out = capsys.readouterr().out
    assert "snellius/della tok/s/device" in out and "NVLink" in out and "PCIe" in out


def test_export_to_mlflow_and_wandb(cpu_store, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["export", str(cpu_store), "--to", "mlflow", "--tracking-uri", uri, "--experiment", "cli"]) == 0
    assert "2 run(s) exported, 0 already there" in capsys.readouterr().out
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    assert sorted(r.data.params["train_micro_batch"] for r in runs) == ["1", "2"]

    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    runs_dir = tmp_path / "wandb-runs"
    assert main(["export", str(cpu_store), "--to", "wandb", "--dir", str(runs_dir)]) == 0
    assert "2 run(s) exported" in capsys.readouterr().out
    assert len(list((runs_dir / "wandb").glob("offline-run-*"))) == 2


def test_query_formats(gpu_store, capsys):
    sql = "select system, count(*) as n from trials where status = 'ok' group by 1 order by 1"
    expected = [{"system": "della", "n": 18}, {"system": "snellius", "n": 16}]
    assert main(["query", str(gpu_store), sql, "--format", "json"]) == 0
    assert json_lines(capsys.readouterr().out) == expected
    assert main(["query", str(gpu_store), sql, "--format", "csv"]) == 0
    assert list(csv.DictReader(io.StringIO(capsys.readouterr().out))) == [
        {k: str(v) for k, v in row.items()} for row in expected]
    assert main(["query", str(gpu_store), sql, "--format", "table"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["system", "n"] and [line.split() for line in lines[-2:]] == [
        ["della", "18"], ["snellius", "16"]]


def test_compact_one_sweep(cpu_store, capsys):
    before = store.read_results(cpu_store).sort_values("trial_id").reset_index(drop=True)
    assert len(store.result_files(cpu_store, "cpu")) == 2
    assert main(["compact", str(cpu_store), "--sweep", "cpu"]) == 0
    assert "sweep cpu: " in capsys.readouterr().out
    assert len(store.result_files(cpu_store, "cpu")) == 1
    assert store.read_results(cpu_store).sort_values("trial_id").reset_index(drop=True).equals(before)


def test_best_by_axis_under_a_memory_cap(gpu_store, capsys):
    # Planted peaks: 60 GiB at ac_ratio 0, 45 at 1/2, 30 at 1; less recomputation is faster.
    assert main(["best", str(gpu_store), "--by", "system", "--axis", "train.ac_ratio", "--max-mem-gib", "50"]) == 0
    out = capsys.readouterr().out
    assert "best ac_ratio for della / tiny: 1/2" in out and "best ac_ratio for snellius / tiny: 1/2" in out
    assert main(["best", str(gpu_store), "--by", "system", "--axis", "train.ac_ratio"]) == 0
    assert "best ac_ratio for della / tiny: 0" in capsys.readouterr().out


def test_run_quiet_on_a_stored_sweep_starts_nothing(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s.yaml")
    elsewhere = tmp_path / "elsewhere"
    for t in plan(load_sweep(sweep)):
        store.write_row(elsewhere, build_row(t.payload, "cli", "ok", "",
                                             RankResult.from_columns({"tok_per_s_per_device": 100.0})))
    files = store.result_files(elsewhere)
    assert main(["run", sweep, "--store", str(elsewhere)]) == 0
    assert "2 trial(s) already stored as ok" in capsys.readouterr().out
    assert main(["run", sweep, "--store", str(elsewhere), "--quiet"]) == 0
    out = capsys.readouterr().out
    # --quiet: no progress lines and no table, the closing line alone (the trials all ok)
    assert out.strip() == (f"0 trial(s) run, 0 not ok; results in {elsewhere} (`raybench report {elsewhere}` for "
                           "the table)")
    assert store.result_files(elsewhere) == files and not (tmp_path / "sweep-store").exists()


def test_torchaos_optional_kernel_warnings_are_dropped_and_its_others_kept(caplog):
    """transformers imports torchao when it builds a model; the kernels torchao built for another Python or GPU
    failing to load is noise on every rehearsal (raybench.runtime.build drops it), any other torchao warning is
    not."""
    import logging

    import raybench.runtime.build  # noqa: F401 - installs the filter

    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torchao").warning("something torchao means")
    assert [r.getMessage() for r in caplog.records] == ["something torchao means"]


def test_best_predict_on_a_cpu_sweep_says_why_in_a_sentence(tmp_path, capsys):
    """--predict picks by predicted GPU memory and step time: a CPU sweep gets the reason and what to do, exit 2,
    not a table of 'none fits' rows."""
    sweep = tmp_path / "cpu.yaml"
    sweep.write_text(json.dumps({"name": "cpu", "model": {"preset": "tiny"}, "train": TINY_TRAIN,
                                 "store": str(tmp_path / "store"), "axes": {"train.ac_ratio": ["0", "1"]}}))
    assert main(["best", str(sweep), "--predict"]) == 2
    captured = capsys.readouterr()
    assert "resources.gpus_per_worker = 0: this sweep's trials run on CPU" in captured.err
    assert "none fits" not in captured.out
