"""Store contract: atomic one-file-per-attempt writes, fixed schema, independent readers, schema evolution."""

from __future__ import annotations

import json
import stat
from datetime import datetime, timezone

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep
from raybench.spec.schema import RankResult


def rows_for(sweep: str = "s", n: int = 3) -> list[dict]:
    spec = parse_sweep({"name": sweep, "model": {"preset": "tiny"},
                        "axes": {"train.micro_batch": list(range(1, n + 1))}})
    rows = []
    for i, t in enumerate(plan(spec)):
        metrics = {"tok_per_s_per_device": 1000.0 + i, "step_time_p50_s": 0.5, "loss_final": 1.25,
                   "hostnames": ["a", "b"], "env": {"NCCL_DEBUG": "WARN"}}
        rows.append(build_row(t.payload, sweep, "ok", "", RankResult.from_columns(metrics), executor="train",
                              started_at=datetime(2026, 1, 1, tzinfo=timezone.utc)))
    return rows


def test_round_trip_through_pyarrow_duckdb_and_polars(tmp_path):
    written = rows_for()
    for row in written:
        store.write_row(tmp_path, row)
    files = store.result_files(tmp_path)
    assert len(files) == 3 and all(f.parent.name == "sweep=s" for f in files)
    table = pq.read_table(files[0])
    assert table.schema.equals(store.SCHEMA, check_metadata=False)

    con = duckdb.connect()
    got = con.execute(f"select trial_id, train_micro_batch, tok_per_s_per_device, ac_blocks, hostnames "
                      f"from read_parquet('{tmp_path}/*/*.parquet') order by train_micro_batch").fetchall()
    assert [(r[1], r[2]) for r in got] == [(1, 1000.0), (2, 1001.0), (3, 1002.0)]
    assert got[0][4] == ["a", "b"]
    assert {r[0] for r in got} == {r["trial_id"] for r in written}

    frame = pl.read_parquet(str(tmp_path / "*" / "*.parquet"))
    assert frame.height == 3 and set(frame["status"]) == {"ok"}
    assert json.loads(frame["env_json"][0]) == {"NCCL_DEBUG": "WARN"}

    df = store.read_results(tmp_path, "s")
    assert sorted(df.train_micro_batch) == [1, 2, 3] and (df.schema_version == store.SCHEMA_VERSION).all()


def test_files_are_atomic_and_not_world_writable(tmp_path):
    path = store.write_row(tmp_path, rows_for(n=1)[0])
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]
    mode = stat.S_IMODE(path.stat().st_mode)
    assert not mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_torn_temp_files_are_invisible(tmp_path):
    store.write_row(tmp_path, rows_for(n=1)[0])
    (tmp_path / "sweep=s" / ".half-written.parquet.tmp").write_bytes(b"PAR1 garbage")
    assert len(store.read_results(tmp_path)) == 1


def test_latest_attempt_wins_and_history_is_kept(tmp_path):
    row = rows_for(n=1)[0]
    failed = {**row, "status": "error", "message": "boom", "ended_at": datetime(2026, 1, 1, tzinfo=timezone.utc)}
    ok = {**row, "ended_at": datetime(2026, 1, 2, tzinfo=timezone.utc)}
    store.write_row(tmp_path, ok)
    store.write_row(tmp_path, failed)
    latest = store.read_results(tmp_path)
    assert list(latest.status) == ["ok"]
    assert len(store.read_results(tmp_path, latest=False)) == 2
    assert store.ok_trial_ids(tmp_path, "s") == {row["trial_id"]}


def test_same_trial_in_two_sweeps_stays_two_rows(tmp_path):
    # One grid run per GPU type under two sweep names: the same configuration, the same trial id.
    a100, h100 = rows_for("grid-a100", n=1)[0], rows_for("grid-h100", n=1)[0]
    assert a100["trial_id"] == h100["trial_id"]
    store.write_row(tmp_path, a100)
    store.write_row(tmp_path, h100)
    assert sorted(store.read_results(tmp_path).sweep) == ["grid-a100", "grid-h100"]
    from raybench.results.query import connect

    assert connect(tmp_path).execute("select count(*) from trials").fetchone()[0] == 2


def test_older_files_without_new_columns_still_read(tmp_path):
    row = rows_for(n=1)[0]
    store.write_row(tmp_path, row)
    old = pa.Table.from_pylist([{"sweep": "s", "trial_id": "old-r0", "status": "ok", "tok_per_s": 5.0}])
    pq.write_table(old, tmp_path / "sweep=s" / "old-r0__1.parquet")
    df = store.read_results(tmp_path)
    assert set(df.trial_id) == {row["trial_id"], "old-r0"}
    assert df.set_index("trial_id").loc["old-r0", "mfu"] is None or df.set_index("trial_id").loc["old-r0"].isna()["mfu"]


def test_rows_outside_the_schema_are_refused(tmp_path):
    with pytest.raises(ValueError, match="outside the schema"):
        store.write_row(tmp_path, {**rows_for(n=1)[0], "made_up_metric": 1})
    assert not tmp_path.joinpath("sweep=s").exists() or not store.result_files(tmp_path)


def test_a_row_from_before_train_loss_is_not_taken_for_todays_chunked_trial(tmp_path):
    """Ids leave train.loss out while it is chunked (or auto), so a row stored before train.loss existed carries
    today's chunked trial's id, but it ran the full loss: a resume must run the chunked trial, and skips the
    full-loss trial the row did measure. Rows that say their loss keep their id."""
    chunked, full = (plan(parse_sweep({"name": "s", "model": {"preset": "tiny"}, "train": {"loss": loss}}))[0]
                     for loss in ("chunked", "full"))
    row = rows_for(n=1)[0]
    old_config = json.loads(row["config_json"])
    assert old_config["train"].pop("loss") == "chunked"  # what a row written before train.loss held: no loss
    old = {**row, "trial_id": chunked.trial_id, "config_json": json.dumps(old_config)}
    assert chunked.trial_id == row["trial_id"] != full.trial_id
    store.write_row(tmp_path, old)
    assert store.ok_trial_ids(tmp_path, "s") == {full.trial_id}
    store.write_row(tmp_path, {**row, "ended_at": datetime(2026, 1, 2, tzinfo=timezone.utc)})  # says chunked
    assert store.ok_trial_ids(tmp_path, "s") == {full.trial_id, chunked.trial_id}
