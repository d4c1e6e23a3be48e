"""`raybench best` over a real store (rows written by store.write_row, read back from Parquet)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from fractions import Fraction

import pytest

from raybench.cli import main as cli
from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.results import store
from raybench.reports.best import best_configs, best_per_axis_value, front_report, read_rows
from raybench.spec.load import parse_sweep
from raybench.spec.schema import RankResult
from raybench.spec.stats import format_ci, mean_ci95

# One sweep per system (a trial id names a configuration, not the machine it ran on).
GPUS = {"sac-h100": ("NVIDIA H100 80GB HBM3", 1000.0), "sac-a100": ("NVIDIA A100-SXM4-40GB", 400.0)}
SWEEP = {"name": "sac", "model": {"preset": "tiny"}, "repeats": 2,
         "axes": {"train.ac_ratio": ["0", "1/2", "1"], "train.micro_batch": [1, 2]}}


def gpu_metrics(speed: float, train: dict, repeat: int) -> dict:
    ac = float(Fraction(train["ac_ratio"]))
    mb = train["micro_batch"]
    return {"tok_per_s_per_device": speed * mb * (1 - 0.2 * ac) * (0.99 if repeat == 0 else 1.01),
            "peak_reserved_gib": 10.0 * mb * (1 - 0.5 * ac) + 5.0, "peak_rss_gib": 3.0}


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("best-store")
    for t in plan(parse_sweep(SWEEP)):
        payload, train = t.payload, t.payload.config.train.model_dump()
        for sweep, (gpu, speed) in GPUS.items():
            metrics = {**gpu_metrics(speed, train, t.repeat), "gpu_name": gpu, "device_type": "cuda"}
            store.write_row(path, build_row(payload, sweep, "ok", "", RankResult.from_columns(metrics)))
        cpu = {"tok_per_s_per_device": 50.0 * train["micro_batch"], "peak_rss_gib": 1.0, "device_type": "cpu"}
        store.write_row(path, build_row(payload, "sac-cpu", "ok", "", RankResult.from_columns(cpu)))
    # A failed attempt is never a candidate.
    store.write_row(path, build_row(t.payload, "other", "oom", "CUDA out of memory",
                                    RankResult.from_columns({"gpu_name": "X"})))
    return path


def test_best_config_per_gpu_type_with_repeats_ci(store_dir):
    best = best_configs(read_rows(str(store_dir))).set_index("group")
    assert set(best.index) == {"H100 80GB HBM3", "A100-SXM4-40GB", "cpu"}  # CPU rows: no GPU name, grouped "cpu"
    h100 = best.loc["H100 80GB HBM3"]
    assert h100.config == "ac_ratio=0 micro_batch=2" and h100.n == 2
    assert h100["mean"] == pytest.approx(2000.0)
    # Repeats 1980 and 2020: sd 28.28, half-width t(0.975, 1) * sd / sqrt(2) = 12.706 * 20 = 254.1.
    assert h100.ci95 == pytest.approx(12.706 * math.sqrt(2 * 20.0**2) / math.sqrt(2))
    assert h100.peak_gib == 25.0


def test_one_sweep_run_on_two_gpu_types_keeps_both(tmp_path):
    """The same sweep file run on an H100 and then an H200 gives the same trial ids, from machines that may
    share a host name: each GPU type keeps its rows (the store's latest-per-trial would keep the H200's only),
    while a re-run on the same GPU type still replaces its earlier try."""
    (trial,) = plan(parse_sweep({"name": "one", "model": {"preset": "tiny"}}))
    payload, train = trial.payload, trial.payload.config.train.model_dump()
    for gpu, speed in (("NVIDIA H100 80GB HBM3", 1000.0), ("NVIDIA H200", 1100.0), ("NVIDIA H200", 1200.0)):
        metrics = {**gpu_metrics(speed, train, 1), "gpu_name": gpu, "device_type": "cuda", "hostname": "vm"}
        store.write_row(tmp_path, build_row(payload, "one", "ok", "", RankResult.from_columns(metrics)))
    best = best_configs(read_rows(str(tmp_path))).set_index("group")
    assert best["mean"].to_dict() == pytest.approx({"H100 80GB HBM3": 1010.0, "H200": 1212.0})
    assert set(best.n) == {1}


def test_best_sac_ratio_per_gpu_under_a_memory_cap(store_dir):
    rows = read_rows(str(store_dir))
    free = best_per_axis_value(rows, "train_ac_ratio")
    capped = best_per_axis_value(rows, "train_ac_ratio", max_mem_gib=20.0)
    winner = lambda t, g: t[(t.group == g) & t.is_best].axis_value.item()  # noqa: E731
    assert winner(free, "H100 80GB HBM3") == "0"
    # Under 20 GiB micro-batch 2 needs ac_ratio >= 1/2 (15 GiB); 1/2 keeps more speed than 1 or micro-batch 1.
    assert winner(capped, "H100 80GB HBM3") == "1/2" and winner(capped, "A100-SXM4-40GB") == "1/2"
    # All equal on the planted CPU rows: the tie still yields exactly one best value.
    assert capped[capped.group == "cpu"].is_best.sum() == 1


def test_cli_best_axis_from_store_and_from_sweep_file(store_dir, tmp_path, capsys):
    assert cli.main(["best", str(store_dir), "--axis", "ac_ratio", "--max-mem-gib", "20"]) == 0
    out = capsys.readouterr().out
    assert "best ac_ratio for H100 80GB HBM3 / tiny: 1/2" in out
    assert "peak memory <= 20 GiB" in out and "1/2 *" in out

    sweep_file = tmp_path / "sac.yaml"
    sweep_file.write_text(f"name: sac-h100\nmodel: {{preset: tiny}}\nstore: {store_dir}\n")
    assert cli.main(["best", str(sweep_file)]) == 0
    out = capsys.readouterr().out
    assert "2,000 ± 254 (n=2)" in out and "ac_ratio=0 micro_batch=2" in out
    assert "A100" not in out and "cpu" not in out  # only the sweep file's own sweep is read


@pytest.mark.parametrize("argv, words", [
    (["--metric", "tok_s"], "--metric = 'tok_s'"),
    (["--by", "gpu"], "--by = 'gpu'"),
    (["--axis", "nope"], "--axis = 'nope'"),
    (["--max-mem-gib", "-1"], "--max-mem-gib = -1.0"),
])
def test_cli_best_bad_options_exit_2(store_dir, capsys, argv, words):
    assert cli.main(["best", str(store_dir), *argv]) == 2
    assert words in capsys.readouterr().err


def test_cli_best_reads_the_store_a_sweep_ran_into_and_refuses_options_it_would_ignore(store_dir, tmp_path, capsys):
    """`run SWEEP --store DIR` writes the rows to DIR: `best SWEEP --store DIR` reads them there (it read the
    sweep's own store and said "no ok rows"); options of --predict alone are refused, not ignored."""
    sweep_file = tmp_path / "sac.yaml"
    sweep_file.write_text("name: sac-h100\nmodel: {preset: tiny}\n")  # its own store: ./raybench-results
    assert cli.main(["best", str(sweep_file), "--store", str(store_dir)]) == 0
    assert "ac_ratio=0 micro_batch=2" in capsys.readouterr().out
    for argv, words in ((["--store", str(tmp_path / "nowhere")], "not a directory"),
                        (["--gpu", "H100 SXM"], "--gpu: only with --predict"),
                        (["--json"], "--json: only with --predict")):
        assert cli.main(["best", str(sweep_file), *argv]) == 2
        assert words in capsys.readouterr().err
    assert cli.main(["best", str(store_dir), "--store", str(store_dir)]) == 2
    assert "is a store already" in capsys.readouterr().err


def test_cli_best_missing_source_exits_2(tmp_path, capsys):
    assert cli.main(["best", str(tmp_path / "nowhere")]) == 2
    assert "neither a result store directory nor a sweep file" in capsys.readouterr().err


def test_front_report_lists_non_dominated_configs(store_dir):
    h100 = store.read_results(store_dir, "sac-h100")
    text = front_report(h100, [("tok_per_s_per_device", "max"), ("peak_reserved_gib", "min")])
    assert text.startswith("Pareto front of 6 configuration(s)")
    # (tok/s, GiB): micro-batch 2 at ac 0, 1/2, 1 is (2000, 25), (1800, 20), (1600, 15); micro-batch 1 is
    # (1000, 15), (900, 12.5), (800, 10). Only (1000, 15) is dominated, by (1600, 15).
    assert "ac_ratio=1 micro_batch=1" in text and "ac_ratio=0 micro_batch=1" not in text
    assert len(text.splitlines()) == 3 + 5  # title, header, rule, 5 configurations


def test_the_closing_report_names_trials_whose_overflow_cut_labels():
    import pandas as pd

    from raybench.reports.best import cut_report

    rows = pd.DataFrame({"trial_id": ["a", "b", "c"], "data_overflow": [None, "drop", None],
                         "train_seq_len": [256, 256, 512], "samples_cut": [27, 27, 1], "tokens_cut": [9000, 20000, 10],
                         "label_tokens_cut_frac": [0.166, 0.3, 0.005]})
    text = cut_report(rows)
    assert "a: data.overflow truncate at seq_len 256 cut 27 samples, 9000 tokens, 16.6% of the label tokens" in text
    assert "b: data.overflow drop" in text and "c:" not in text
    assert cut_report(rows.iloc[2:]) is None and cut_report(rows.drop(columns="label_tokens_cut_frac")) is None


def test_two_sweeps_of_one_configuration_count_alike_in_query_report_and_best(tmp_path, capsys):
    """One rule for every view (store.MEASUREMENT_SQL): the same configuration stored by two sweeps is two
    measurements, repeats of one configuration, in `query`'s trials view, `report` and `best` alike; a retry in one
    sweep replaces its failed attempt, and `report` says that it left that attempt out."""
    (trial,) = plan(parse_sweep({"name": "first", "model": {"preset": "tiny"}}))
    payload, train = trial.payload, trial.payload.config.train.model_dump()
    start = datetime(2026, 12, 1, tzinfo=timezone.utc)
    gpu = {"gpu_name": "NVIDIA H100 80GB HBM3", "device_type": "cuda"}
    store.write_row(tmp_path, build_row(payload, "first", "error", "killed", RankResult.from_columns(gpu),
                                        started_at=start, ended_at=start))
    for minutes, (sweep, speed) in enumerate((("first", 2063.0), ("second", 2648.0)), start=1):
        metrics = {**gpu_metrics(speed, train, 1), **gpu}
        ended = start + timedelta(minutes=minutes)
        store.write_row(tmp_path, build_row(payload, sweep, "ok", "", RankResult.from_columns(metrics),
                                            started_at=ended, ended_at=ended))
    assert cli.main(["query", str(tmp_path), "select count(*) as n from trials", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "2"
    assert cli.main(["report", str(tmp_path)]) == 0
    report = capsys.readouterr().out
    assert sum(line.startswith(("first ", "second ")) for line in report.splitlines()) == 2
    assert "1 earlier attempt(s) not shown" in report
    speeds = [gpu_metrics(speed, train, 1)["tok_per_s_per_device"] for speed in (2063.0, 2648.0)]
    assert f"tok/s {format_ci(*mean_ci95(speeds))}, sweeps first, second" in report
    best = best_configs(read_rows(str(tmp_path))).set_index("group").loc["H100 80GB HBM3"]
    assert best.n == 2 and best["mean"] == pytest.approx(sum(speeds) / 2)


def test_one_run_is_shown_as_one_run_and_an_unsettled_ranking_says_so(store_dir, tmp_path, capsys):
    """n = 1 is one run, not a mean with a missing interval; where the best and the runner-up ran once or their
    intervals overlap, `best` says the ranking is not settled and how to settle it."""
    assert cli.main(["best", str(store_dir), "--sweep", "sac-h100"]) == 0
    repeated = capsys.readouterr().out
    assert "mean ± 95% CI over repeats" in repeated.splitlines()[0]
    # 2,000 ± 254 against ac_ratio 1/2's 1,800 ± 229 (repeats 1% apart, two each): the intervals overlap.
    assert "H100 80GB HBM3 / tiny: not settled" in repeated and "their 95% intervals overlap" in repeated
    (trial, other) = plan(parse_sweep({"name": "once", "model": {"preset": "tiny"},
                                       "axes": {"train.micro_batch": [1, 2]}}))
    for t, speed in ((trial, 1006.0), (other, 1280.0)):
        metrics = {"tok_per_s_per_device": speed, "peak_rss_gib": 1.0, "device_type": "cpu"}
        store.write_row(tmp_path, build_row(t.payload, "once", "ok", "", RankResult.from_columns(metrics)))
    assert cli.main(["best", str(tmp_path)]) == 0
    once = capsys.readouterr().out
    assert "one run per configuration (no interval)" in once.splitlines()[0]
    assert "1,280 (1 run)" in once and "one of the two ran once; run the sweep again with `repeats: 3`" in once
