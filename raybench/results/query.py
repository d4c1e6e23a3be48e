"""SQL over the result store through DuckDB: `raybench query STORE "SQL"`.

Views (columns: docs/schema.md; examples: docs/query.md):
- `trials`: the latest attempt of each measurement (a trial id in a sweep, on a system and GPU type), the same
  rows as `store.read_table` / `read_results`;
- `attempts`: every attempt once (`read_results(latest=False)`).
Both have every column of this raybench's schema in its type (null where a file predates a column), plus any
column written by a newer raybench, after them. DuckDB reads only the columns and files a query needs, straight
from the Parquet files.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from raybench.results import store

# Vanished files (a compaction replaced them between listing and reading) make DuckDB fail: list again.
_RETRIES = 5


class QueryError(ValueError):
    """The SQL could not run (syntax, unknown column or table); the message says why."""


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


_database: duckdb.DuckDBPyConnection | None = None


def _shared_database() -> duckdb.DuckDBPyConnection:
    """One in-memory DuckDB per process. Starting DuckDB costs more than a query over a compacted store, so
    repeated queries (reports, notebooks) share it; each gets its own connection and temporary views."""
    global _database
    if _database is None:
        _database = duckdb.connect()
    return _database


def connect(store_path: str | Path, sweep: str | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the `trials` and `attempts` views over the store's current files (its own
    views: other connections, in other threads too, see theirs). Close it when done."""
    con = _shared_database().cursor()
    # The scan reads the footers its bind already read (every view is bound when created and when queried).
    con.execute("set parquet_metadata_cache = true")
    files = store.result_files(store_path, sweep)
    groups = _schema_groups(files)
    if len(groups) == 1 and groups[0][0].to_arrow_schema().equals(store.SCHEMA):
        # Every file has exactly this version's schema (as runs and compaction write them): read them as they
        # are. This is the common case, and it skips the per-column casts and the union below.
        con.execute(f"create temp view _rows as select * from read_parquet([{_file_list(groups[0][1])}])")
    else:
        # Files line up by column name; the empty `_schema` relation gives every column of this version even
        # when no file has it yet. Each group of files sharing one schema is read without DuckDB's
        # union_by_name, which would unify every file's schema again at each bind of each view.
        con.register("_schema", store.SCHEMA.empty_table())
        sources = [f"read_parquet([{_file_list(group)}], filename = true, file_row_number = true)"
                   for _, group in groups]
        rows = " union all by name ".join(f"select * from {source}" for source in ["_schema", *sources])
        con.execute(f"create temp view _rows as select {_projection(con, bool(files))} from ({rows})")
    # Copies of one attempt (while a compaction deletes the files it merged) are identical rows: keep one.
    con.execute("create temp view attempts as select * from _rows "
                "qualify row_number() over (partition by attempt_id) = 1")
    # Same order as store.latest_per_trial: the greatest ended_at (unknown is oldest), then attempt_id.
    con.execute("create temp view trials as select * from _rows qualify row_number() over "
                f"(partition by {store.MEASUREMENT_SQL} order by ended_at desc nulls last, attempt_id desc) = 1")
    return con


def _file_list(files: list[Path]) -> str:
    return ", ".join(_sql_string(str(f)) for f in files)


def _schema_groups(files: list[Path]) -> list[tuple[pq.ParquetSchema, list[Path]]]:
    """Files grouped by identical Parquet schemas (column names, types, order), from their footers."""
    groups: list[tuple[pq.ParquetSchema, list[Path]]] = []
    for path in files:
        schema = pq.read_metadata(path).schema  # the Parquet schema: no Arrow conversion, a third cheaper
        same = next((g for s, g in groups if s.equals(schema)), None)
        if same is None:
            groups.append((schema, [path]))
        else:
            same.append(path)
    return groups


def _projection(con: duckdb.DuckDBPyConnection, from_files: bool) -> str:
    """Every schema column in this version's type, then any column unknown to this version as it is."""
    types = con.execute("select column_name, column_type from (describe _schema)").fetchall()
    columns = [f"cast({_ident(name)} as {sql_type}) as {_ident(name)}" for name, sql_type in types]
    if not from_files:
        return ", ".join(columns)
    # Rows from before the attempt_id column get STEM#ROW, as store.read_file gives them.
    derived_id = r"regexp_extract(filename, '([^/]+)\.parquet$', 1) || '#' || file_row_number"
    columns[[name for name, _ in types].index("attempt_id")] = f"coalesce(attempt_id, {derived_id}) as attempt_id"
    known = ", ".join(_ident(name) for name, _ in types)
    return ", ".join(columns) + f", * exclude ({known}, filename, file_row_number)"


def run(store_path: str | Path, sql: str, sweep: str | None = None) -> pa.Table:
    """Run one SQL statement over the store's views; the result as an Arrow table."""
    for attempt in range(_RETRIES):
        try:
            with connect(store_path, sweep) as con:
                relation = con.sql(sql)  # None for a statement that returns no rows
                return relation.to_arrow_table() if relation is not None else pa.table({})
        except duckdb.IOException:
            if attempt == _RETRIES - 1:
                raise
        except duckdb.Error as err:
            raise QueryError(_said(err)) from None
    raise AssertionError("unreachable")


def _said(err: duckdb.Error) -> str:
    """DuckDB's error in one line: its first, the columns it offers for one it did not find, and how a config
    field is named here (where every table says `strategy`, the column is `train_strategy`)."""
    lines = str(err).strip().splitlines()
    offered = [line.strip() for line in lines[1:] if line.startswith("Candidate bindings")]
    named = ["(a config field's column is its dotted name with _: train.strategy is train_strategy; docs/query.md)"
             ] if "not found" in lines[0] else []
    return " ".join([lines[0], *offered, *named])

