"""The result store at scale: append 100,000 rows, then ask for the best configuration per GPU type.

    .venv/bin/python bench/store_scale.py [--rows 100000] [--batch 1000] [--repeats 7]

Rows are realistic: the trials of bench/sweeps/grid-10k.yaml (every config column, config JSON) over 10 sweeps on
5 GPU types with random metrics and statuses, 10% of them re-run attempts (a failed first attempt, then an ok
one: the latest attempt must win). They arrive in batches of `--batch` rows, each batch standing for one
`raybench run` of that many trials (see `append`): `store` gets them as runs leave them (written, then the
sweep's partition compacted at the end of the run), `appended` gets the batches uncompacted, and the same
batches are written as CSV files (one per batch, every column).

Query: per gpu_name, the trial with the highest tok_per_s_per_device among ok rows, latest attempt per trial.
- store, store_uncompacted: `raybench query`'s code path (`query.run`: list the files, DuckDB views, the SQL);
- csv: what a user does with CSV files: pandas `read_csv` of every file, latest attempt per trial, groupby;
- csv_usecols: the same reading only the five columns the query needs, as a careful user would.
Times are in-process (no interpreter start, imports done; the store's queries share one DuckDB per process,
as `query.run` does, so only the first query of the run pays its start). All four run once per round, rounds repeated;
medians reported; every candidate must give the same answer. Last line JSON: value = median seconds on the
store as runs leave it, csv_over_store = csv median / that; the same for the uncompacted batches. Goals:
< 1 s and >= 10x. Then what a real sweep writes, one file per trial (`--per-trial` rows, one sweep), queried
once before and once after compaction.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pandas as pd

from raybench.drivers.api import AUTO_COMPACT_FILES
from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.results import compaction, query, store
from raybench.spec.load import load_sweep
from raybench.spec.schema import RankResult

GRID = Path(__file__).resolve().parent / "sweeps" / "grid-10k.yaml"
SWEEPS = 10
GPUS = {"NVIDIA H100 80GB HBM3": 9000.0, "NVIDIA A100-SXM4-80GB": 4000.0, "NVIDIA H200": 10000.0,
        "NVIDIA B200": 18000.0, "NVIDIA GH200 480GB": 11000.0}
RERUN_SHARE = 0.1
SQL = ("select gpu_name, arg_max(trial_id, tok_per_s_per_device) as best_trial, "
       "max(tok_per_s_per_device) as tok_per_s_per_device from trials where status = 'ok' "
       "group by gpu_name order by gpu_name")
CSV_COLUMNS = ["trial_id", "ended_at", "status", "gpu_name", "tok_per_s_per_device"]


def synthetic_rows(total: int, seed: int = 0) -> list[dict]:
    """`total` rows over SWEEPS sweeps; each sweep's last RERUN_SHARE rows re-run its first trials."""
    rng = random.Random(seed)
    trials = plan(load_sweep(GRID))
    per_sweep = total // SWEEPS
    reruns = int(per_sweep * RERUN_SHARE)
    t0 = datetime(2026, 11, 1, tzinfo=timezone.utc)
    rows = []
    for s in range(SWEEPS):
        gpu, base = list(GPUS.items())[s % len(GPUS)]
        for i in range(per_sweep):
            rerun = i >= per_sweep - reruns
            t = trials[(i - (per_sweep - reruns)) if rerun else i]
            payload = t.payload.replace(trial_id=f"{t.config_id}-r{s}", repeat=s)
            status = "ok" if rerun else rng.choices(["ok", "oom", "error"], [0.89, 0.08, 0.03])[0]
            if not rerun and i < reruns:
                status = "error"  # the first attempt of every re-run trial failed
            tok = base * rng.lognormvariate(0, 0.3)
            metrics = {} if status != "ok" else {
                "tok_per_s_per_device": tok, "tok_per_s": tok * t.world_size, "step_time_p50_s": 8192 / tok,
                "step_time_p90_s": 8192 / tok * 1.05, "peak_reserved_gib": rng.uniform(20, 79),
                "mfu": rng.uniform(.2, .6), "loss_first": 10.4, "loss_final": rng.uniform(6, 8),
                "tokens_per_step": 8192 * t.world_size}
            metrics.update({"gpu_name": gpu, "device_type": "cuda", "gpu_count": t.world_size,
                            "hostnames": [f"node{n:03d}" for n in range(max(1, t.world_size // 8))],
                            "system": f"site{s % 3}", "env": {"NCCL_DEBUG": "WARN"}})
            ended = t0 + timedelta(hours=s, seconds=i)
            rows.append(build_row(payload, f"sweep-{s:02d}", status, "" if status == "ok" else f"{status} in step 3",
                                  RankResult.from_columns(metrics), started_at=ended - timedelta(seconds=40),
                                  ended_at=ended, wall_s=40.0, executor="pool"))
    return rows


def append(rows: list[dict], root: Path, batch: int) -> tuple[float, float]:
    """Append the rows to the store and to CSV files, batch by batch; seconds spent on each (the store's include
    the end-of-run compaction).

    Each batch stands for one `raybench run` of `batch` trials. Such a run writes one file per trial, and with
    more than AUTO_COMPACT_FILES of them it compacts the sweep's partition at its end; here the batch is written
    as one file (writing 100k single-row files would take minutes) and the same compaction follows, so `store`
    ends with the files real runs leave. `appended` keeps the batches uncompacted, for comparison.
    """
    store_s = csv_s = 0.0
    for n, start in enumerate(range(0, len(rows), batch)):
        chunk = rows[start:start + batch]
        store.write_rows(root / "appended", chunk)
        t0 = time.perf_counter()
        store.write_rows(root / "store", chunk)
        if batch > AUTO_COMPACT_FILES:
            for sweep in dict.fromkeys(r["sweep"] for r in chunk):
                compaction.compact_sweep(root / "store", sweep)
        t1 = time.perf_counter()
        for sweep in dict.fromkeys(r["sweep"] for r in chunk):
            directory = root / "csv" / sweep
            directory.mkdir(parents=True, exist_ok=True)
            frame = pd.DataFrame([r for r in chunk if r["sweep"] == sweep], columns=store.SCHEMA.names)
            frame.to_csv(directory / f"batch-{n:04d}.csv", index=False)
        store_s, csv_s = store_s + t1 - t0, csv_s + time.perf_counter() - t1
    return store_s, csv_s


def best_from_store(store_dir: Path) -> dict:
    table = query.run(store_dir, SQL)
    return {r["gpu_name"]: (r["best_trial"], r["tok_per_s_per_device"]) for r in table.to_pylist()}


def best_from_csv(csv_dir: Path, usecols: list[str] | None = None) -> dict:
    frame = pd.concat([pd.read_csv(f, usecols=usecols) for f in sorted(csv_dir.glob("*/*.csv"))], ignore_index=True)
    latest = frame.sort_values(["trial_id", "ended_at"]).drop_duplicates("trial_id", keep="last")
    ok = latest[latest.status == "ok"]
    best = ok.loc[ok.groupby("gpu_name").tok_per_s_per_device.idxmax()]
    return {r.gpu_name: (r.trial_id, r.tok_per_s_per_device) for r in best.itertuples()}


def per_trial_files(rows: list[dict], root: Path) -> dict:
    """What a real sweep leaves: one file per trial attempt (store.write_row), queried before and after compaction
    (the slow steps once: that slowness is why compaction exists; the compacted query 3 times, median)."""
    write_s, _ = timed(lambda: [store.write_row(root, row) for row in rows])
    query_s, before = timed(best_from_store, root)
    compact_s, _ = timed(compaction.compact, root)
    compacted = [timed(best_from_store, root) for _ in range(3)]  # the first one reads a file just written
    compacted_query_s, after = statistics.median(t for t, _ in compacted), compacted[0][1]
    assert before == after and store.read_table(root, latest=False).num_rows == len(rows)
    return {"per_trial_files": len(rows), "per_trial_write_s": round(write_s, 1),
            "per_trial_query_s": round(query_s, 3), "per_trial_compact_s": round(compact_s, 1),
            "per_trial_compacted_query_s": round(compacted_query_s, 3),
            "per_trial_compacted_query_runs_s": [round(t, 3) for t, _ in compacted]}


def timed(fn, *args) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--per-trial", type=int, default=10_000, help="rows written one file each (0: skip)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    rows = synthetic_rows(args.rows)
    with tempfile.TemporaryDirectory(prefix="store-scale-") as tmp:
        root = Path(tmp)
        append_store_s, append_csv_s = append(rows, root, args.batch)
        total_rows, trial_rows = len(rows), rows[:args.per_trial]
        # 100k row dicts of ~200 keys would make every garbage collection below walk them: a query runs in a
        # fresh `raybench query` process, not next to them.
        del rows
        gc.collect()
        gc.freeze()
        files = {name: len(store.result_files(root / name)) for name in ("store", "appended")}
        csv_files = len(list(root.glob("csv/*/*.csv")))
        candidates = {"store": lambda: best_from_store(root / "store"),
                      "store_uncompacted": lambda: best_from_store(root / "appended"),
                      "csv": lambda: best_from_csv(root / "csv"),
                      "csv_usecols": lambda: best_from_csv(root / "csv", CSV_COLUMNS)}
        times: dict[str, list[float]] = {name: [] for name in candidates}
        answers = {}
        for _ in range(args.repeats):  # interleaved: each candidate once per round
            for name, run in candidates.items():
                seconds, answers[name] = timed(run)
                times[name].append(seconds)
        kept = {name: store.read_table(root / name, latest=False).num_rows for name in ("store", "appended")}
        per_trial = per_trial_files(trial_rows, root / "per-trial") if trial_rows else {}
    gc.unfreeze()  # frozen objects are never freed: native extensions report them as leaks at exit
    load_end = os.getloadavg()[0]
    expected = answers["csv"]
    for name, got in answers.items():  # every candidate must give the same answer
        assert got.keys() == expected.keys(), (name, got, expected)
        for gpu, (trial, tok) in got.items():
            assert trial == expected[gpu][0] and abs(tok - expected[gpu][1]) < 1e-6 * tok, (name, gpu)
    assert kept == {"store": total_rows, "appended": total_rows}, kept  # compaction kept every row exactly once

    median = {name: statistics.median(v) for name, v in times.items()}
    print(f"{total_rows:,} rows in {args.rows // args.batch} runs; store: {files['store']} Parquet files (written "
          f"and compacted at the end of each run in {append_store_s:.1f} s), {files['appended']} without compaction; "
          f"csv: {csv_files} files "
          f"(written in {append_csv_s:.1f} s); load average {load_start:.1f} -> {load_end:.1f}")
    print(f"{'query: best config per GPU':<20}{'median s':>10}{'min s':>10}{'max s':>10}{'csv / this':>12}")
    for name, values in times.items():
        print(f"{name:<20}{median[name]:>10.3f}{min(values):>10.3f}{max(values):>10.3f}"
              f"{median['csv'] / median[name]:>11.1f}x")
    print("answer:", json.dumps({gpu: trial for gpu, (trial, _) in sorted(expected.items())}))
    if per_trial:
        n = per_trial["per_trial_files"]
        print(f"one file per trial ({n:,} rows, {n:,} files, written in {per_trial['per_trial_write_s']} s): "
              f"query {per_trial['per_trial_query_s']} s; compaction {per_trial['per_trial_compact_s']} s; "
              f"then query {per_trial['per_trial_compacted_query_s']} s")
    print(json.dumps({
        "bench": "store_scale",
        "metric": "seconds for the best-config-per-GPU query over 100k rows appended by 100 runs",
        "value": round(median["store"], 3), "unit": "s", "goal": "< 1 s and >= 10x faster than CSV",
        "csv_over_store": round(median["csv"] / median["store"], 1),
        "store_uncompacted_s": round(median["store_uncompacted"], 3),
        "csv_over_store_uncompacted": round(median["csv"] / median["store_uncompacted"], 1),
        "csv_s": round(median["csv"], 3), "csv_usecols_s": round(median["csv_usecols"], 3),
        "rows": total_rows, "store_files": files["store"], "uncompacted_files": files["appended"],
        "csv_files": csv_files, "append_store_s": round(append_store_s, 2),
        "append_csv_s": round(append_csv_s, 2), "repeats": args.repeats, **per_trial,
        "load_avg_1m": [round(load_start, 1), round(load_end, 1)]}))


if __name__ == "__main__":
    main()
