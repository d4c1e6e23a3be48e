"""The CLI over the store itself: `raybench query STORE "SQL"` and `raybench compact [STORE]` (hooked into
raybench.cli.main). Bad input raises ConfigError naming the argument, the value and the fix (exit 2)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from raybench.spec.errors import ConfigError, Problem

FORMATS = ("table", "csv", "json")  # report.format_table's formats (query imports duckdb: only when it runs)
QUERY_HELP = ("tables: trials (latest attempt of each trial id per sweep, system and GPU type), attempts (every "
              "attempt); columns: docs/schema.md")


def _check_store(command: str, store_path: str, sweep: str | None) -> None:
    from raybench.results.compaction import sweep_names

    if not Path(store_path).is_dir():
        raise ConfigError(f"raybench {command}", [Problem(
            "STORE", store_path, "is not a directory; give the directory a sweep wrote its rows to (the sweep's "
                                 "`store:`, ./raybench-results by default)")])
    held = sweep_names(store_path)
    if sweep is not None and sweep not in held:
        raise ConfigError(f"raybench {command}", [Problem(
            "--sweep", sweep, f"no such sweep in {store_path}; it holds: {', '.join(held) or 'none'}")])


def _query(args) -> int:
    from raybench.reports.report import format_table
    from raybench.results import query

    _check_store("query", args.store, args.sweep)
    try:
        table = query.run(args.store, args.sql, args.sweep)
    except query.QueryError as err:
        raise ConfigError("raybench query", [Problem("SQL", args.sql, f"{err}; {QUERY_HELP}")]) from None
    text = format_table(table, args.format)
    try:
        if text:
            print(text, flush=True)
    except BrokenPipeError:  # `raybench query ... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    if args.format == "table":
        print(f"({table.num_rows} row{'s' if table.num_rows != 1 else ''})", file=sys.stderr)
    return 0


def _compact(args) -> int:
    from raybench.results import compaction

    _check_store("compact", args.store, args.sweep)
    if args.target_rows is not None and args.target_rows < 1:
        raise ConfigError("raybench compact", [Problem("--target-rows", args.target_rows,
                                                       "must be at least 1 (rows per compacted file)")])
    for done in compaction.compact(args.store, args.sweep, args.target_rows or compaction.TARGET_ROWS):
        print(f"sweep {done.sweep}: {done.files_before} file(s) -> {done.files_after}"
              + (f" ({done.rows_merged} rows merged)" if done.rows_merged else " (nothing to merge)"))
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("query", help="SQL over stored results (DuckDB; tables trials and attempts)",
                       description=f"Run one SQL statement over the store. {QUERY_HELP}; examples: docs/query.md.")
    p.add_argument("store", help="result store directory")
    p.add_argument("sql", help="e.g. \"select gpu_name, max(tok_per_s_per_device) from trials group by 1\"")
    p.add_argument("--sweep", help="only this sweep's rows")
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="table (aligned text), csv (with a header), json (one object per line)")
    p.set_defaults(func=_query)

    p = sub.add_parser("compact", help="merge a store's many small result files into few large ones")
    p.add_argument("store", nargs="?", default="./raybench-results", help="result store directory")
    p.add_argument("--sweep", help="only this sweep's partition")
    p.add_argument("--target-rows", type=int,
                   help="rows per compacted file; files this large are left alone (default 100,000)")
    p.set_defaults(func=_compact)
