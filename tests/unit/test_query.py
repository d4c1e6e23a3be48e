"""`raybench query`: DuckDB views over the store give the rows and aggregates read_results gives."""

from __future__ import annotations

import csv
import io
import json
import math
from datetime import timedelta

import pandas as pd
import polars as pl
import pytest
from test_store_scale import OLD_DROPPED, T0, make_rows, write_old_schema_file

from raybench.cli.main import main
from raybench.results import query, store

GPUS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H200")


@pytest.fixture
def results(tmp_path):
    """Three sweeps on three GPU types; re-runs whose latest attempt failed or succeeded; an old-schema file."""
    for k, gpu in enumerate(GPUS):
        rows = [{**r, "trial_id": r["trial_id"].replace("-r0", f"-r{k}"), "repeat": k,
                 "tok_per_s_per_device": r["tok_per_s_per_device"] * (k + 1) + i}
                for i, r in enumerate(make_rows(f"sweep{k}", n=5, gpu=gpu))]
        store.write_rows(tmp_path, rows[:3])
        for row in rows[3:]:
            store.write_row(tmp_path, row)
        # The best trial's re-run failed (latest attempt: no longer ok); a failed one's re-run succeeded.
        store.write_row(tmp_path, {**rows[4], "status": "oom", "message": "oom", "tok_per_s_per_device": None,
                                   "ended_at": T0 + timedelta(days=1)})
        store.write_row(tmp_path, {**rows[0], "status": "error", "ended_at": T0 - timedelta(days=1)})
    write_old_schema_file(tmp_path, {**make_rows("sweep0", n=1)[0], "trial_id": "old-r0",
                                     "tok_per_s_per_device": 1e6}, OLD_DROPPED)
    return tmp_path


def test_query_aggregates_equal_pandas_on_read_results(results):
    sql = ("select gpu_name, count(*) as n, max(tok_per_s_per_device) as best, avg(step_time_p50_s) as step "
           "from trials where status = 'ok' group by gpu_name order by gpu_name")
    got = query.run(results, sql).to_pylist()
    df = store.read_results(results)
    ok = df[df.status == "ok"]
    expected = ok.groupby("gpu_name").agg(n=("trial_id", "size"), best=("tok_per_s_per_device", "max"),
                                          step=("step_time_p50_s", "mean")).reset_index()
    assert len(got) == len(GPUS) == len(expected)
    for row, exp in zip(got, expected.to_dict("records")):
        # 5 trials, the best one's re-run ended oom; the H100 sweep has the old-schema row too
        assert row["gpu_name"] == exp["gpu_name"] and row["n"] == exp["n"] == (5 if "H100" in row["gpu_name"] else 4)
        assert row["best"] == exp["best"] and math.isclose(row["step"], exp["step"])
    attempts = query.run(results, "select count(*) as n from attempts").to_pylist()[0]["n"]
    assert attempts == len(store.read_results(results, latest=False)) == 3 * 7 + 1


def test_trials_view_is_read_table_row_for_row(results):
    got = query.run(results, "select * from trials order by trial_id").to_pandas()
    expected = store.read_table(results).to_pandas().sort_values("trial_id").reset_index(drop=True)
    assert list(got.columns) == list(expected.columns) == store.SCHEMA.names
    for column in ("started_at", "ended_at"):  # DuckDB hands timestamps back in its session time zone
        got[column] = got[column].dt.tz_convert("UTC")
        expected[column] = expected[column].dt.tz_convert("UTC")
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)
    by_id = got.set_index("trial_id")
    assert by_id.loc["old-r0", "tok_per_s_per_device"] == 1e6 and pd.isna(by_id.loc["old-r0", "mfu"])


def test_latest_attempt_wins_and_history_stays_in_attempts(results):
    rows = make_rows("sweep0", n=5)
    best = rows[4]["trial_id"]  # -r0: the H100 sweep
    latest = query.run(results, f"select status from trials where trial_id = '{best}'").to_pylist()
    history = query.run(results, f"select status from attempts where trial_id = '{best}' order by ended_at")
    assert latest == [{"status": "oom"}] and history.column("status").to_pylist() == ["ok", "oom"]


def test_a_column_named_as_the_tables_name_it_gets_its_store_name_offered(results):
    """Tables head a config field by its last name (strategy); its column is the dotted name with _."""
    with pytest.raises(query.QueryError) as err:
        query.run(results, "select strategy from trials")
    assert '"strategy" not found' in str(err.value) and "train_strategy" in str(err.value)
    assert "\n" not in str(err.value)


def test_sweep_filter_and_polars_recipe_from_the_docs(results):
    assert query.run(results, "select distinct sweep from trials", sweep="sweep1").to_pylist() == [{"sweep": "sweep1"}]
    # docs/query.md's polars recipe: lazy scan, hive partition pruning, latest attempt per trial.
    schema = pl.from_arrow(store.SCHEMA.empty_table()).schema
    rows = pl.scan_parquet(f"{results}/sweep=*/*.parquet", schema=schema, hive_partitioning=True,
                           missing_columns="insert", extra_columns="ignore", include_file_paths="file")
    trials = (rows.filter(pl.col("sweep") == "sweep0")
              .with_columns(pl.coalesce("attempt_id", "file").alias("attempt_id"))
              .unique("attempt_id")
              .sort("trial_id", "ended_at", "attempt_id", nulls_last=False)
              .group_by("trial_id", maintain_order=True).last()
              .collect())
    expected = store.read_table(results, "sweep0")
    assert sorted(zip(trials["trial_id"], trials["status"])) == sorted(
        zip(expected.column("trial_id").to_pylist(), expected.column("status").to_pylist()))


def test_cli_formats(results, capsys):
    sql = "select gpu_name, count(*) as n from trials where status = 'ok' group by 1 order by 1"
    assert main(["query", str(results), sql, "--format", "json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    counts = {g: 5 if "H100" in g else 4 for g in sorted(GPUS)}
    assert [json.loads(line) for line in lines] == [{"gpu_name": g, "n": n} for g, n in counts.items()]
    assert main(["query", str(results), sql, "--format", "csv"]) == 0
    assert list(csv.DictReader(io.StringIO(capsys.readouterr().out))) == [
        {"gpu_name": g, "n": str(n)} for g, n in counts.items()]
    assert main(["query", str(results), sql]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[0].split() == ["gpu_name", "n"] and "(3 rows)" in out.err


@pytest.mark.parametrize("args, field", [
    (["query", "{store}", "select nope from trials"], "SQL"),
    (["query", "{store}", "selec 1"], "SQL"),
    (["query", "{store}/missing", "select 1"], "STORE"),
    (["query", "{store}", "select 1", "--sweep", "nosuch"], "--sweep"),
    (["compact", "{store}", "--target-rows", "0"], "--target-rows"),
    (["compact", "{store}/missing"], "STORE"),
])
def test_bad_input_exits_2_naming_the_field(results, capsys, args, field):
    files = sorted(store.result_files(results))
    assert main([a.format(store=results) for a in args]) == 2
    err = capsys.readouterr().err
    assert f"  - {field} = " in err and "nothing was launched or written" in err
    assert sorted(store.result_files(results)) == files


def test_cli_compact_then_query_gives_the_same_answer(results, capsys):
    sql = "select trial_id, status, tok_per_s_per_device from trials order by trial_id"
    before = query.run(results, sql)
    assert main(["compact", str(results), "--sweep", "sweep1"]) == 0
    assert "sweep sweep1: " in capsys.readouterr().out
    assert len(store.result_files(results, "sweep1")) == 1 and len(store.result_files(results, "sweep0")) > 1
    assert main(["compact", str(results)]) == 0
    assert len(store.result_files(results)) == len(GPUS)  # one file per sweep partition
    assert query.run(results, sql).equals(before)


def test_files_of_one_schema_are_read_as_one_group(results):
    # One read_parquet per group: a file per group would make a query over many files slow, not wrong.
    groups = [files for _, files in query._schema_groups(store.result_files(results))]
    old = [g for g in groups if any(p.stem.startswith("old-r0") for p in g)]
    assert len(groups) == 2 and [len(g) for g in old] == [1]


def test_queries_from_threads_each_see_their_own_store(tmp_path):
    # Queries share one DuckDB per process; each connection's views must stay its own.
    from concurrent.futures import ThreadPoolExecutor

    for n, name in ((2, "a"), (5, "b")):
        store.write_rows(tmp_path / name, make_rows(f"sweep-{name}", n=n))
    stores = [tmp_path / "a", tmp_path / "b"] * 8
    with ThreadPoolExecutor(4) as pool:
        counts = list(pool.map(lambda s: query.run(s, "select count(*) as n from trials")["n"][0].as_py(), stores))
    assert counts == [2, 5] * 8
