"""Merge a sweep partition's many small result files into a few large ones, without losing or doubling a row.

A sweep writes one file per trial attempt (atomic, no coordination between trial drivers); ten thousand trials
make ten thousand files, and every reader then pays one file open per row. Compaction rewrites the small files
of a `sweep=NAME/` partition as `compacted-STAMP.parquet` files of up to `target_rows` rows.

Crash and concurrency safety, without locks (locks are unreliable on the shared filesystems sweeps write to):
- the merged file is written atomically (dot-temp file, fsync, rename), read back and checked, and the
  directory is fsynced before any original is deleted: a row is only ever deleted from a file after it is
  durably in another one;
- a crash between commit and deletion leaves some rows in two files: readers keep one row per `attempt_id`, and
  the next compaction merges both copies into one;
- trial drivers keep writing new files while a compaction runs: it only touches the files it listed;
- two compactions at once each delete only files whose rows they committed; a file the other one deleted
  first is skipped (its rows are in the other's merged file).
Every attempt is kept (history); columns unknown to this raybench version are kept too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raybench.results import store

TARGET_ROWS = 100_000


@dataclass(frozen=True)
class Compacted:
    sweep: str
    files_before: int
    files_after: int
    rows_merged: int


class CompactionError(RuntimeError):
    """The merged file did not read back with exactly the rows merged; no original was deleted."""


def sweep_names(store_path: str | Path) -> list[str]:
    return sorted(p.name.split("=", 1)[1] for p in Path(store_path).glob("sweep=*") if p.is_dir())


def compact(store_path: str | Path, sweep: str | None = None, target_rows: int = TARGET_ROWS) -> list[Compacted]:
    """Compact one sweep's partition, or every partition of the store."""
    return [compact_sweep(store_path, name, target_rows) for name in ([sweep] if sweep else sweep_names(store_path))]


def compact_sweep(store_path: str | Path, sweep: str, target_rows: int = TARGET_ROWS) -> Compacted:
    files = store.result_files(store_path, sweep)
    small = [path for path in files if _num_rows(path) < target_rows]
    if len(small) < 2:
        return Compacted(sweep, len(files), len(files), 0)
    tables, merged_from = [], []
    for path in small:
        try:
            tables.append(store.read_file(path))
        except FileNotFoundError:  # another compaction merged it: its rows are in that one's committed file
            continue
        merged_from.append(path)
    merged = store.unique_attempts(store.conform_all(tables, keep_unknown=True))
    directory = store.sweep_dir(store_path, sweep)
    written = []
    for offset in range(0, len(merged), target_rows):
        path = directory / f"compacted-{store.file_stamp()}.parquet"
        store.write_file_atomic(path, merged.slice(offset, target_rows))
        written.append(path)
    _fsync_dir(directory)  # the renames are durable before anything is deleted
    _check_written(written, merged)
    for path in merged_from:
        path.unlink(missing_ok=True)
    _fsync_dir(directory)
    return Compacted(sweep, len(files), len(files) - len(merged_from) + len(written), len(merged))


def _num_rows(path: Path) -> int:
    try:
        return pq.read_metadata(path).num_rows
    except FileNotFoundError:
        return 0  # gone already; the read below skips it


def _check_written(written: list[Path], merged: pa.Table) -> None:
    """Read the merged files back from disk: every attempt_id exactly once, nothing else."""
    ids = [i for path in written for i in pq.read_table(path, columns=["attempt_id"]).column(0).to_pylist()]
    expected = merged.column("attempt_id").to_pylist()
    if len(ids) != len(expected) or set(ids) != set(expected):
        raise CompactionError(f"merged files {[p.name for p in written]} hold {len(ids)} rows, expected "
                              f"{len(expected)}; the originals were kept (readers ignore the duplicates)")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
