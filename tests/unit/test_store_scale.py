"""The store at scale: schema evolution, compaction (exact, crash-safe, concurrent), attempt keys, batch writes."""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.results import compaction, query, store
from raybench.spec.load import parse_sweep
from raybench.spec.schema import RankResult

T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)


def make_rows(sweep: str = "s", n: int = 6, gpu: str = "NVIDIA H100 80GB HBM3") -> list[dict]:
    spec = parse_sweep({"name": sweep, "model": {"preset": "tiny"},
                        "axes": {"train.micro_batch": list(range(1, n + 1))}})
    return [build_row(t.payload, sweep, "ok", "", RankResult.from_columns({
                          "tok_per_s_per_device": 100.0 * (i + 1), "gpu_name": gpu, "hostnames": ["n1"],
                          "step_time_p50_s": 0.1 * (i + 1)}),
                      ended_at=T0 + timedelta(minutes=i), executor="pool")
            for i, t in enumerate(plan(spec))]


def write_old_schema_file(root, row: dict, dropped: tuple[str, ...]) -> str:
    """A file as an older raybench wrote it: fewer columns, schema version 0 in data and metadata."""
    fields = [f for f in store.SCHEMA if f.name not in dropped]
    schema = pa.schema(fields, metadata={"raybench_schema_version": "0"})
    old = {k: v for k, v in row.items() if k in schema.names}
    table = pa.Table.from_pylist([{**old, "schema_version": 0}], schema=schema)
    path = store.sweep_dir(root, row["sweep"]) / f"{row['trial_id']}__1700000000000000000_1.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path.stem


def snapshot(root, latest: bool = False) -> list[dict]:
    """Every row of the store as plain data, in attempt_id order (comparable before and after compaction)."""
    return store.read_table(root, latest=latest).sort_by("attempt_id").to_pylist()


OLD_DROPPED = ("attempt_id", "mfu", "tflops_per_device", "system", "phase_sum_over_step", "projected_hours")


def test_old_schema_file_reads_with_nulls_through_read_table_and_query(tmp_path):
    new, old = make_rows(n=2)
    store.write_row(tmp_path, new)
    stem = write_old_schema_file(tmp_path, {**old, "mfu": 0.5}, OLD_DROPPED)
    table = store.read_table(tmp_path)
    assert table.schema.equals(store.SCHEMA, check_metadata=False) and table.num_rows == 2
    got = {r["trial_id"]: r for r in table.to_pylist()}[old["trial_id"]]
    assert got["mfu"] is None and got["system"] is None  # columns the old file lacks are null, not invented
    assert got["schema_version"] == 0 and got["tok_per_s_per_device"] == old["tok_per_s_per_device"]
    assert got["attempt_id"] == f"{stem}#0"  # a stable key for a row from before attempt ids
    sql = (f"select attempt_id, mfu, schema_version, tok_per_s_per_device from trials "
           f"where trial_id = '{old['trial_id']}'")
    assert query.run(tmp_path, sql).to_pylist() == [{"attempt_id": f"{stem}#0", "mfu": None, "schema_version": 0,
                                                     "tok_per_s_per_device": old["tok_per_s_per_device"]}]


def test_batch_write_gives_every_row_its_own_attempt_id(tmp_path):
    rows = make_rows(n=4) + make_rows("other", n=2)
    paths = store.write_rows(tmp_path, rows)
    assert sorted(p.parent.name for p in paths) == ["sweep=other", "sweep=s"]  # one file per sweep partition
    table = store.read_table(tmp_path, latest=False)
    ids = table.column("attempt_id").to_pylist()
    assert len(ids) == len(set(ids)) == 6
    assert all(i.startswith(t) for i, t in zip(ids, table.column("trial_id").to_pylist()))
    with pytest.raises(ValueError, match="outside the schema"):
        store.write_rows(tmp_path, [{**rows[0], "made_up": 1}])
    assert len(store.result_files(tmp_path)) == 2  # nothing written for the refused batch


def store_with_history(root) -> None:
    """Per-trial files, re-run attempts, a batch file, an old-schema file and a file from a newer raybench."""
    rows = make_rows(n=6)
    for row in rows:
        store.write_row(root, row)
    store.write_row(root, {**rows[0], "status": "error", "message": "rerun failed",
                           "ended_at": T0 + timedelta(hours=1)})
    store.write_rows(root, [{**r, "trial_id": r["trial_id"].replace("-r0", "-r7")}
                            for r in make_rows("s", n=3, gpu="NVIDIA A100-SXM4-80GB")])
    write_old_schema_file(root, {**rows[1], "trial_id": "oldtrial-r0"}, OLD_DROPPED)
    newer = pa.Table.from_pylist([{**{k: v for k, v in rows[2].items() if k in store.SCHEMA.names},
                                   "trial_id": "newtrial-r0", "attempt_id": "newtrial-r0__9", "future_metric": 42.0}])
    pq.write_table(newer, store.sweep_dir(root, "s") / "newtrial-r0__9.parquet")


def test_compaction_keeps_every_row_exactly_and_unknown_columns(tmp_path):
    store_with_history(tmp_path)
    before, before_latest = snapshot(tmp_path), snapshot(tmp_path, latest=True)
    files_before = len(store.result_files(tmp_path))
    [result] = compaction.compact(tmp_path)
    assert (result.files_before, result.files_after, result.rows_merged) == (files_before, 1, len(before))
    assert [p.name.startswith("compacted-") for p in store.result_files(tmp_path)] == [True]
    assert snapshot(tmp_path) == before and snapshot(tmp_path, latest=True) == before_latest
    # The column only a newer raybench knows survives compaction and stays queryable.
    assert query.run(tmp_path, "select future_metric from attempts where trial_id = 'newtrial-r0'").to_pylist() == [
        {"future_metric": 42.0}]
    assert "future_metric" not in store.read_table(tmp_path).column_names
    assert compaction.compact(tmp_path)[0].rows_merged == 0  # one file: nothing to do


def test_crash_between_commit_and_delete_doubles_nothing(tmp_path):
    store_with_history(tmp_path)
    before, before_latest = snapshot(tmp_path), snapshot(tmp_path, latest=True)
    originals = tmp_path.parent / f"{tmp_path.name}-originals"
    shutil.copytree(tmp_path, originals)
    compaction.compact(tmp_path)
    # The state a crash after the merged file's commit and before the deletions leaves: every row twice.
    for path in store.result_files(originals):
        shutil.copy2(path, store.sweep_dir(tmp_path, "s") / path.name)
    assert len(store.result_files(tmp_path)) == len(store.result_files(originals)) + 1
    assert snapshot(tmp_path) == before and snapshot(tmp_path, latest=True) == before_latest
    count = "select count(*) as n from attempts"
    assert query.run(tmp_path, count).to_pylist() == [{"n": len(before)}]
    assert query.run(tmp_path, "select count(*) as n from trials").to_pylist() == [{"n": len(before_latest)}]
    compaction.compact(tmp_path)  # the next compaction merges both copies into one
    assert len(store.result_files(tmp_path)) == 1 and snapshot(tmp_path) == before


def test_reader_relists_when_a_compaction_removed_listed_files(tmp_path, monkeypatch):
    store_with_history(tmp_path)
    before = snapshot(tmp_path)
    stale = store.result_files(tmp_path)
    compaction.compact(tmp_path)
    listings = iter([stale])  # the reader listed just before the compaction deleted those files
    real = store.result_files
    monkeypatch.setattr(store, "result_files", lambda *a, **k: next(listings, None) or real(*a, **k))
    assert snapshot(tmp_path) == before


def test_target_rows_bounds_compacted_files(tmp_path):
    for row in make_rows(n=7):
        store.write_row(tmp_path, row)
    compaction.compact(tmp_path, target_rows=3)
    sizes = sorted(pq.read_metadata(p).num_rows for p in store.result_files(tmp_path))
    assert sizes == [1, 3, 3]
    compaction.compact(tmp_path, target_rows=3)  # full files are left alone; a single small one too
    assert sorted(pq.read_metadata(p).num_rows for p in store.result_files(tmp_path)) == [1, 3, 3]


def test_a_run_compacts_a_partition_of_many_files(tmp_path, monkeypatch):
    from raybench.drivers import api

    monkeypatch.setattr(api, "AUTO_COMPACT_FILES", 10)
    for row in make_rows(n=11):
        store.write_row(tmp_path, row)
    before = snapshot(tmp_path)
    api.compact_if_many_files(str(tmp_path), "s", progress=lambda line: None)
    assert len(store.result_files(tmp_path, "s")) == 1 and snapshot(tmp_path) == before
    store.write_row(tmp_path, make_rows(n=1)[0])
    api.compact_if_many_files(str(tmp_path), "s", progress=lambda line: None)  # below the threshold: left alone
    assert len(store.result_files(tmp_path, "s")) == 2
