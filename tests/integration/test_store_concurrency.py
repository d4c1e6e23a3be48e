"""The store under concurrent writers, a concurrent reader, and writers killed mid-write (real processes)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pyarrow.parquet as pq
import pytest

from raybench.results import store

WRITERS, ROWS = 8, 1000
SWEEP = "concurrent"
pytestmark = pytest.mark.integration


def _writer(root: str, writer: int, rows: int) -> None:
    for i in range(rows):
        store.write_row(root, {"sweep": SWEEP, "trial_id": f"w{writer}-{i:05d}", "status": "ok",
                               "message": f"writer {writer} row {i}", "tok_per_s": float(i)})


def _reader(root: str, stop, report) -> None:
    """Open every committed file as soon as it is listed; count any that is not a whole one-row table."""
    seen, bad = set(), 0
    while not stop.is_set():
        for path in store.result_files(root, SWEEP):
            if path in seen:
                continue
            seen.add(path)
            try:
                bad += pq.read_table(path).num_rows != 1
            except Exception:
                bad += 1
        time.sleep(0.05)  # between directory scans; a scan already takes longer than this
    report.put((len(seen), bad))


@pytest.mark.parametrize("rows", [pytest.param(100, id="8x100"),
                                  pytest.param(ROWS, id="8x1000", marks=pytest.mark.slow)])
def test_concurrent_writers_lose_and_tear_nothing(tmp_path, rows):
    # 8 x 1,000 (the figure) takes 1.5-4 minutes on 2 cores, so the default suite runs 8 x 100.
    ctx = mp.get_context("spawn")
    stop, report = ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_reader, args=(str(tmp_path), stop, report))
    reader.start()
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), w, rows)) for w in range(WRITERS)]
    t0 = time.perf_counter()
    for p in writers:
        p.start()
    for p in writers:
        p.join()
    write_s = time.perf_counter() - t0
    stop.set()
    seen, bad = report.get(timeout=120)
    reader.join()
    assert all(p.exitcode == 0 for p in writers)
    assert bad == 0 and seen > 0  # the reader never opened a partial file

    t0 = time.perf_counter()
    table = store.read_table(tmp_path, SWEEP, latest=False)
    read_s = time.perf_counter() - t0
    ids = table.column("trial_id").to_pylist()
    assert len(ids) == len(set(ids)) == WRITERS * rows  # nothing lost, nothing doubled
    assert set(table.column("status").to_pylist()) == {"ok"}
    assert not list((tmp_path / f"sweep={SWEEP}").glob(".*"))  # no temp file left behind
    print(f"\n{WRITERS}x{rows} rows: write {write_s:.1f} s, read_table of {len(ids)} files {read_s:.1f} s")


def test_writer_killed_mid_write_leaves_nothing_torn(tmp_path):
    ctx = mp.get_context("spawn")
    for attempt in range(3):
        writer = ctx.Process(target=_writer, args=(str(tmp_path), attempt, 10_000))
        writer.start()
        time.sleep(1.5 + 0.3 * attempt)  # SIGKILL lands at varying points of a write
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        assert writer.exitcode == -signal.SIGKILL
    # Every committed file reads whole; whatever a killed writer left is a dot-file that readers skip.
    table = store.read_table(tmp_path, SWEEP, latest=False)
    committed = store.result_files(tmp_path, SWEEP)
    assert len(table) == len(committed) > 0
    for path in committed:
        assert pq.read_table(path).num_rows == 1
