"""The CLI over stored results: `report --format md|html|png`, `compare`, `losses` and `export` (hooked into
raybench.cli.main).

Handlers import pandas, matplotlib and the trackers only when they run, so `raybench plan` stays fast. Bad
input raises ConfigError naming the argument, the value and the fix (exit 2, nothing written).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from raybench.spec.errors import ConfigError, Problem

REPORT_FORMATS = ("text", "md", "html", "png")
_TRACKER_OPTIONS = {"tracking_uri": "mlflow", "experiment": "mlflow", "dir": "wandb", "project": "wandb"}


def _read(store: str, sweep: str | None, all_attempts: bool):
    """Stored rows: every attempt, or the store's measurements (the latest attempt of each: store.MEASUREMENT_SQL)."""
    from raybench.drivers.api import read_results

    return read_results(store, sweep, latest=not all_attempts)


def _rows(command: str, store: str, sweep: str | None, all_attempts: bool = False):
    df = _read(store, sweep, all_attempts)
    if len(df) == 0:
        where = f"{store} (sweep {sweep})" if sweep else store
        raise ConfigError(f"raybench {command}", [Problem(
            "STORE", where, "no result rows there; give the directory a sweep wrote its rows to (the sweep's "
                            "`store:`, ./raybench-results by default) and a sweep name it holds")])
    return df


def report(args) -> int:
    """`raybench report`: a text table on stdout, or report files (--format md|html|png)."""
    if args.format != "text":
        return write_report(args)
    from raybench.reports.report import results_table, terminal_width

    if not Path(args.store).is_dir():  # "No results" would say a store was read and held none
        what = "a file, not a store" if Path(args.store).exists() else "no such directory"
        raise ConfigError("raybench report", [Problem("STORE", args.store, f"{what}; give the directory a sweep wrote "
                                                      "its rows to (a sweep file's `store:`, ./raybench-results by "
                                                      "default)")])
    from raybench.results import store

    attempts = store.read_table(args.store, args.sweep, latest=False)
    rows = attempts if args.all_attempts else store.latest_per_trial(attempts)
    print(results_table(rows.to_pandas(), replaced=len(attempts) - len(rows), width=terminal_width()))
    health = _health(args.store)
    if health:
        from raybench.reports.cluster_health import CAPTION, HEADERS
        from raybench.reports.report import render

        print(f"\n{CAPTION}:\n{render(HEADERS, health, width=terminal_width())}")
    return 0


def _health(store_path: str) -> list[list[str]]:
    """The cluster-health section's rows: the store's latest pre-flight per cluster (none: no section)."""
    from raybench.reports.cluster_health import health_rows
    from raybench.results import health

    return health_rows(health.read_checks(store_path))


def write_report(args) -> int:
    """`raybench report --format md|html|png [--out PATH]`: write the report files and say where they are."""
    from raybench.reports import report_files

    out = Path(args.out or report_files.DEFAULT_OUT[args.format])
    if args.format == "png" and out.is_file():
        raise ConfigError("raybench report", [Problem("--out", str(out), "is a file; --format png writes a "
                                                                         "directory of PNGs: give a directory")])
    if args.format != "png" and out.is_dir():
        raise ConfigError("raybench report", [Problem("--out", str(out), f"is a directory; --format {args.format} "
                                                                         f"writes one file: give a file name")])
    df = _rows("report", args.store, args.sweep, args.all_attempts)
    title = f"raybench report: {args.store}" + (f", sweep {args.sweep}" if args.sweep else "")
    paths = report_files.write(df, args.format, out, title, health=_health(args.store))
    print(f"wrote {paths[0] if args.format != 'png' else out} ({len(paths)} file(s))")
    return 0


def _compare(args) -> int:
    from raybench.reports import compare

    df = _rows("compare", args.store, args.sweep)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    result = compare.compare(df, systems, args.match, source=f"raybench compare {args.store}")
    print(json.dumps(compare.comparison_json(result), indent=1) if args.json else compare.comparison_text(result))
    return 0


def _losses(args) -> int:
    """`raybench losses`: each point's loss by step against the baseline value of one axis; exit 1 when a point
    is beyond the tolerance."""
    from raybench.reports import losses

    tolerance = losses.DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    if not 0 <= tolerance < 1:
        raise ConfigError("raybench losses", [Problem("--tolerance", tolerance, "a fraction of the baseline's loss "
                                                                                "in [0, 1), e.g. 0.02")])
    if args.window < 1:
        raise ConfigError("raybench losses", [Problem("--window", args.window, "a number of consecutive steps to "
                                                                              "average, 1 or more (1: step by step)")])
    df = _rows("losses", args.store, args.sweep)
    found = losses.compare_losses(df, args.axis, args.baseline, tolerance, args.window)
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in found], indent=1))
    else:
        print(losses.comparison_text(found, args.axis, args.baseline, tolerance, args.window))
    return 0 if all(c.within for c in found) else 1


def _export(args) -> int:
    from raybench.reports import export

    wrong = [Problem(f"--{name.replace('_', '-')}", getattr(args, name), f"is a {tracker} option, not one for "
                                                                          f"--to {args.to}; leave it out")
             for name, tracker in _TRACKER_OPTIONS.items() if getattr(args, name) is not None and tracker != args.to]
    if wrong:
        raise ConfigError("raybench export", wrong)
    df = _rows("export", args.store, args.sweep, args.all_attempts)
    if args.to == "mlflow":
        result = export.to_mlflow(df, args.tracking_uri, args.experiment or "raybench")
    else:
        result = export.to_wandb(df, args.dir or "wandb-offline", args.project or "raybench")
    print(f"{result.exported} run(s) exported, {result.skipped} already there; {result.where}")
    return 0


def add_report_options(p) -> None:
    p.add_argument("--format", choices=REPORT_FORMATS, default="text",
                   help="text (a table on stdout), md (Markdown + PNGs next to it), html (one self-contained "
                        "file), png (a directory of figures)")
    p.add_argument("--out", help="output file (md, html) or directory (png); default raybench-report.{md,html} "
                                 "or raybench-report/")


def add_parsers(sub) -> None:
    """The `compare` and `export` subcommands."""
    p = sub.add_parser("compare", help="matching configurations of two or more systems side by side, with the "
                                       "fingerprint differences that may explain the gap")
    p.add_argument("store", nargs="?", default="./raybench-results")
    p.add_argument("--systems", help="comma-separated system labels, hostnames or cluster names (default: all)")
    p.add_argument("--sweep", help="only this sweep")
    p.add_argument("--match", choices=("config", "axes"), default="config",
                   help="pair rows by config id (default), or by sweep name and axis values when the sites' "
                        "sweep files differ only in paths")
    p.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    p.set_defaults(func=_compare)

    p = sub.add_parser("losses", help="loss by step of each point against the baseline value of one axis (same other "
                                      "axes, same steps and data): does a faster point still train the same?")
    p.add_argument("store", nargs="?", default="./raybench-results")
    p.add_argument("--sweep", help="only this sweep")
    p.add_argument("--axis", required=True, help="the axis that differs, e.g. train.fp8 or train.liger")
    p.add_argument("--baseline", required=True, help="its baseline value, e.g. off or false")
    p.add_argument("--tolerance", type=float,
                   help="largest relative difference from the baseline's loss at any step (default 0.02)")
    p.add_argument("--window", type=int, default=1,
                   help="compare the means of this many consecutive steps (default 1: step by step); for a "
                        "configuration whose loss jumps from step to step more than the tolerance")
    p.add_argument("--json", action="store_true", help="one JSON list instead of text")
    p.set_defaults(func=_losses)

    p = sub.add_parser("export", help="one MLflow or W&B (offline) run per stored trial row; re-export skips "
                                      "rows already there")
    p.add_argument("store", nargs="?", default="./raybench-results")
    p.add_argument("--to", choices=("mlflow", "wandb"), required=True, help="the tracker")
    p.add_argument("--sweep", help="only this sweep")
    p.add_argument("--all-attempts", action="store_true", help="every attempt, not only the latest per trial")
    p.add_argument("--tracking-uri", help="mlflow: sqlite:///mlflow.db, a directory, or http://server:5000 "
                                          "(default: MLflow's own, MLFLOW_TRACKING_URI)")
    p.add_argument("--experiment", help="mlflow: experiment name (default raybench)")
    p.add_argument("--dir", help="wandb: directory for the offline runs (default ./wandb-offline)")
    p.add_argument("--project", help="wandb: project the runs are synced to later (default raybench)")
    p.set_defaults(func=_export)
