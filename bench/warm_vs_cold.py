"""Per-trial overhead of the three executors, in one run on one embedded Ray: warm pool, Ray Train V2 per
trial, cold torchrun per trial. Each runs the same 8 short trials (tiny preset, 2 workers, 20 steps) as a
raybench sweep through Ray Tune, rows written to a store.

    .venv/bin/python bench/warm_vs_cold.py [--trials 8] [--steps 20] [--executors pool,train,torchrun]

Overhead of a trial = the time between the previous trial's row and its own, minus its training loop
(warm-up + timed steps): launch, rendezvous, model build, teardown, Tune scheduling and the row write all
count. The first trial of each executor is reported apart (it pays for starting Tune, the pool's actors or
the all-reduce probe once). Prints a table, then one JSON line: value = warm-pool overhead per trial (s).
Goals: <= 0.25 s per trial, and >= 50x lower than Ray Train V2 in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from raybench.drivers.ray_cluster import ray_cluster
from raybench.drivers.sweep import run_planned
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep

EXECUTORS = ("pool", "train", "torchrun")


def sweep_spec(executor: str, trials: int, steps: int):
    return parse_sweep({
        "name": f"warm-vs-cold-{executor}", "model": {"preset": "tiny"}, "executor": executor,
        "train": {"steps": steps, "warmup_steps": 2, "seq_len": 64, "precision": "fp32", "strategy": "ddp"},
        "resources": {"workers": 2},
        "axes": {"train.lr": [1e-4 * (i + 1) for i in range(trials)]},
    })


def overheads(rows) -> tuple[float, list[float]]:
    """(first trial's wall minus loop, later trials' row-to-row gap minus loop), in run order."""
    rows = rows.sort_values("ended_at")
    loop_s = (rows.warmup_s + rows.step_time_mean_s * rows.steps_timed).tolist()
    ended = [t.timestamp() for t in rows.ended_at]
    first = rows.trial_wall_s.iloc[0] - loop_s[0]
    return first, [ended[i] - ended[i - 1] - loop_s[i] for i in range(1, len(ended))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--executors", default=",".join(EXECUTORS),
                        help="comma-separated; the ratios to Ray Train and torchrun need all three")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="raybench-bench-") as store_dir, ray_cluster(None):
        for executor in args.executors.split(","):
            spec = sweep_spec(executor, args.trials, args.steps)
            t0 = time.perf_counter()
            run_planned(plan(spec), spec.name, store_dir, executor, progress=lambda line: None)
            wall = time.perf_counter() - t0
            rows = store.read_results(store_dir, spec.name)
            assert (rows.status == "ok").all(), rows[["status", "message"]]
            first, later = overheads(rows)
            results[executor] = {"first_s": first, "median_s": statistics.median(later),
                                 "mean_s": statistics.fmean(later), "sweep_wall_s": wall,
                                 "loop_s": statistics.fmean(rows.warmup_s + rows.step_time_mean_s * rows.steps_timed)}
    print(f"{'executor':<10}{'overhead/trial s':>18}{'mean s':>9}{'first trial s':>15}{'loop s':>8}{'sweep s':>9}")
    for name, r in results.items():
        print(f"{name:<10}{r['median_s']:>18.3f}{r['mean_s']:>9.3f}{r['first_s']:>15.2f}{r['loop_s']:>8.2f}"
              f"{r['sweep_wall_s']:>9.1f}")
    warm = results["pool"]["median_s"]
    ratios = {f"{name}_over_warm": round(results[executor]["median_s"] / warm, 1)
              for name, executor in (("train_v2", "train"), ("torchrun", "torchrun")) if executor in results}
    print(json.dumps({
        "bench": "warm_vs_cold", "metric": "warm-pool overhead per trial (s), median after the first",
        "value": round(warm, 4), "goal": "<= 0.25 s and >= 50x below train", **ratios,
        **{f"{k}_{m}": round(v[m], 3) for k, v in results.items() for m in ("median_s", "first_s", "loop_s")},
        "trials": args.trials, "steps": args.steps,
    }))


if __name__ == "__main__":
    main()
