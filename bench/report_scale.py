"""How long the report, compare and export take on stores of 100 to 10,000 trial rows.

    .venv/bin/python bench/report_scale.py [--rows 100 1000 10000] [--export-rows 200]

Rows are the trials of bench/sweeps/grid-10k.yaml (every config column) measured on two systems that differ in GPU
memory clock, with deterministic made-up metrics and phases, 5% of them oom; they are written with
`store.write_rows`. For each size: reading the store as the CLI does (every attempt, then the latest per trial
and system), rendering the self-contained HTML report (all five figures, which keep the fastest configurations
of a large grid), and `compare` of the two systems. MLflow export (a local sqlite store, created beforehand) is
timed once on `--export-rows` rows, and a second export of the same rows (all skipped) after it.
Last line JSON: value = seconds for the HTML report of the largest store. Goal: < 60 s for 10,000 rows.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.reports import compare, export, frames, report_files
from raybench.results import store
from raybench.spec.load import load_sweep
from raybench.spec.schema import RankResult

GRID = Path(__file__).resolve().parent / "sweeps" / "grid-10k.yaml"
SYSTEMS = {"site-a": 2619.0, "site-b": 1593.0}  # GPU memory clock, MHz


def make_rows(count: int) -> list[dict]:
    """`count` rows: the first count/2 grid trials, once per system."""
    trials = plan(load_sweep(GRID))[: count // len(SYSTEMS)]
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    rows = []
    for system, mem_clock in SYSTEMS.items():
        speed = mem_clock / 2619.0
        for i, t in enumerate(trials):
            values = t.axis_values
            ac_ratio = frames.ratio_value(values["train.ac_ratio"])
            tok = 9000.0 * speed * values["train.micro_batch"] ** 0.3 * (1 - 0.2 * ac_ratio)
            step_s = values["train.micro_batch"] * values["train.seq_len"] / tok
            metrics = {"system": system, "hostname": f"{system}-n1", "device_type": "cuda",
                       "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_mem_clock_max_mhz": mem_clock,
                       "tok_per_s_per_device": tok, "step_time_p50_s": step_s, "mfu": 0.4 * speed,
                       "peak_reserved_gib": 10.0 + values["train.micro_batch"] * values["train.seq_len"] / 2048,
                       **{f"phase_{p}_mean_s": step_s * share for p, share in zip(frames.PHASES,
                                                                                  (0.02, 0.3, 0.6, 0.08))}}
            status = "oom" if i % 20 == 19 else "ok"
            rows.append(build_row(t.payload, "grid", status, "" if status == "ok" else "CUDA out of memory",
                                  RankResult.from_columns(metrics if status == "ok" else {"system": system}),
                                  executor="pool",
                                  started_at=start, ended_at=start + timedelta(seconds=len(rows))))
    return rows


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def read_rows(path: Path):
    return store.read_results(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--export-rows", type=int, default=200)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in args.rows:
            path = Path(tmp) / f"store-{count}"
            store.write_rows(path, make_rows(count))
            df, read_s = timed(lambda: read_rows(path))
            _, html_s = timed(lambda: report_files.write(df, "html", path / "report.html", "bench"))
            result, compare_s = timed(lambda: compare.compare(df, ["site-a", "site-b"]))
            assert {d.column for d in result.differences} == {"gpu_mem_clock_max_mhz"}
            results.append({"rows": len(df), "read_s": read_s, "html_s": html_s, "compare_s": compare_s,
                             "html_kib": (path / "report.html").stat().st_size / 1024})
        path = Path(tmp) / "export"
        store.write_rows(path, make_rows(args.export_rows))
        df = read_rows(path)
        uri = f"sqlite:///{tmp}/mlflow.db"
        _, db_init_s = timed(lambda: export.to_mlflow(df.head(0), uri, "bench"))
        first, export_s = timed(lambda: export.to_mlflow(df, uri, "bench"))
        again, reexport_s = timed(lambda: export.to_mlflow(df, uri, "bench"))
        assert (first.exported, again.skipped) == (len(df), len(df))
    print(f"{'rows':>7}{'read s':>9}{'html s':>9}{'compare s':>11}{'html KiB':>10}")
    for r in results:
        print(f"{r['rows']:>7}{r['read_s']:>9.2f}{r['html_s']:>9.2f}{r['compare_s']:>11.2f}{r['html_kib']:>10.0f}")
    print(f"\nMLflow export of {len(df)} rows: {export_s:.2f} s ({1000 * export_s / len(df):.0f} ms/row); "
          f"re-export (all skipped): {reexport_s:.2f} s; database creation before it: {db_init_s:.2f} s")
    largest = results[-1]
    print(json.dumps({"bench": "report_scale", "metric": f"seconds for the HTML report of {largest['rows']} rows",
                      "value": round(largest["html_s"], 2), "unit": "s", "goal": "< 60 s for 10,000 rows",
                      "sizes": [{k: round(v, 3) for k, v in r.items()} for r in results],
                      "mlflow_export_ms_per_row": round(1000 * export_s / len(df), 1),
                      "mlflow_reexport_s": round(reexport_s, 2)}))


if __name__ == "__main__":
    main()
