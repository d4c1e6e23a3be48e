"""The clusters' pre-flight checks in the store: `STORE/cluster-health/check-STAMP.parquet`, one file per check,
one row per device measured and one per link (`link` set: inside a node, or a node pair with `peer_node`);
drivers/preflight.py writes them, `raybench report` reads them beside the trials."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raybench.results.store import file_stamp, write_file_atomic

HEALTH_DIR = "cluster-health"
COLUMNS = pa.schema([
    ("cluster", pa.string()), ("job_id", pa.string()), ("checked_at", pa.string()), ("node", pa.string()),
    ("ray_node_id", pa.string()), ("hostname", pa.string()), ("device", pa.string()), ("device_index", pa.int64()),
    ("torch_threads", pa.int64()), ("matmul_tflops", pa.float64()), ("memory_gb_per_s", pa.float64()),
    ("host_to_device_gb_per_s", pa.float64()), ("matmul_tflops_of_fastest", pa.float64()),
    ("memory_gb_per_s_of_fastest", pa.float64()), ("host_to_device_gb_per_s_of_fastest", pa.float64()),
    ("matmul_tflops_of_table", pa.float64()), ("memory_gb_per_s_of_table", pa.float64()),
    ("host_to_device_gb_per_s_of_table", pa.float64()), ("link", pa.string()), ("peer_node", pa.string()),
    ("link_ranks", pa.int64()), ("busbw_gb_per_s", pa.float64()), ("busbw_gb_per_s_of_fastest", pa.float64()),
    ("busbw_gb_per_s_of_table", pa.float64()), ("link_error", pa.string()), ("tolerance", pa.float64()),
    ("slow", pa.bool_()), ("why", pa.string()),
])


def save_check(store_path: str | Path, rows: list[dict]) -> Path:
    """One check's rows, written whole or not at all."""
    path = Path(store_path) / HEALTH_DIR / f"check-{file_stamp()}.parquet"
    write_file_atomic(path, pa.Table.from_pylist(rows, schema=COLUMNS))
    return path


def read_checks(store_path: str | Path, latest: bool = True) -> pa.Table:
    """Every stored check's rows (`latest`: only each cluster's newest check), oldest first."""
    files = sorted((Path(store_path) / HEALTH_DIR).glob("check-*.parquet"))
    tables = [pq.read_table(f, schema=COLUMNS) for f in files]
    table = pa.concat_tables(tables) if tables else COLUMNS.empty_table()
    if not latest or not table.num_rows:
        return table
    rows = table.to_pylist()
    newest = {}
    for row in rows:
        newest[row["cluster"]] = max(newest.get(row["cluster"], ""), row["checked_at"])
    return pa.Table.from_pylist([r for r in rows if r["checked_at"] == newest[r["cluster"]]], schema=COLUMNS)
