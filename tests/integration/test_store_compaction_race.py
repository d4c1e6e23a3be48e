"""Compaction under load, with real processes: trial writers, two compactions racing each other and a reader at
once lose and double no row."""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import datetime, timezone

import pytest

from raybench.results import compaction, store

pytestmark = pytest.mark.integration

SWEEP = "busy"


def _writer(root: str, writer: int, rows: int) -> None:
    for i in range(rows):
        store.write_row(root, {"sweep": SWEEP, "trial_id": f"w{writer}-{i:04d}", "status": "ok",
                               "ended_at": datetime.now(timezone.utc)})


def _compactor(root: str, stop, report) -> None:
    merges = 0
    while not stop.is_set():
        merges += sum(c.rows_merged > 0 for c in compaction.compact(root, SWEEP, target_rows=150))
        time.sleep(0.05)
    report.put(merges)


def _reader(root: str, stop, report) -> None:
    """Read the whole partition again and again: never a doubled row, never fewer rows than a previous read."""
    reads, problems, last = 0, [], 0
    while not stop.is_set():
        ids = store.read_table(root, SWEEP, latest=False).column("attempt_id").to_pylist()
        if len(ids) != len(set(ids)):
            problems.append(f"read {reads}: {len(ids) - len(set(ids))} doubled rows")
        if len(ids) < last:
            problems.append(f"read {reads}: {len(ids)} rows after {last}")
        last, reads = len(ids), reads + 1
    report.put((reads, problems))


def test_writers_compactions_and_a_reader_at_once_lose_and_double_nothing(tmp_path):
    """Two trial writers, two compactions racing each other and a reader, all real processes."""
    ctx = mp.get_context("spawn")
    stop, report, merges = ctx.Event(), ctx.Queue(), ctx.Queue()
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), w, 150)) for w in range(2)]
    others = [ctx.Process(target=_compactor, args=(str(tmp_path), stop, merges)) for _ in range(2)]
    reader = ctx.Process(target=_reader, args=(str(tmp_path), stop, report))
    for p in (*others, reader, *writers):
        p.start()
    for p in writers:
        p.join()
    time.sleep(0.5)
    stop.set()
    reads, problems = report.get(timeout=120)
    merged = [merges.get(timeout=120) for _ in others]
    for p in (*others, reader):
        p.join()
    assert all(p.exitcode == 0 for p in (*writers, *others, reader))
    assert reads > 0 and problems == [] and sum(merged) > 0  # compactions did run while rows arrived
    ids = store.read_table(tmp_path, SWEEP, latest=False).column("trial_id").to_pylist()
    assert sorted(ids) == sorted(f"w{w}-{i:04d}" for w in range(2) for i in range(150))
    compaction.compact(tmp_path, SWEEP, target_rows=1000)
    assert len(store.result_files(tmp_path, SWEEP)) == 1
    assert sorted(store.read_table(tmp_path, SWEEP, latest=False).column("trial_id").to_pylist()) == sorted(ids)
    assert not list(store.sweep_dir(tmp_path, SWEEP).glob(".*"))  # no temp file left behind
