"""Push many trivially short trials through the warm pool from one sweep: throughput and driver memory.

    .venv/bin/python bench/many_trials.py [--trials 1000] [--small 200]

Three sweeps in one process on one embedded Ray: first --small trials, then --trials trials twice (1 worker
each, 2 steps of 16 tokens on the tiny preset), every row written to a store. Prints a table, then one JSON
line: value = trials per minute of the first large sweep; driver_rss_gib after each sweep shows whether the
driver's memory stays flat as the number of trials grows (the second large sweep must not add what the first
added). Goal: driver peak < 2 GiB, flat.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

import psutil

from raybench.drivers.ray_cluster import ray_cluster
from raybench.drivers.sweep import run_planned
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep

GIB = 2**30


def spec(name: str, trials: int):
    return parse_sweep({
        "name": name, "model": {"preset": "tiny"}, "executor": "pool",
        "train": {"steps": 2, "warmup_steps": 1, "seq_len": 16, "precision": "fp32"},
        "resources": {"workers": 1}, "axes": {"train.seed": list(range(trials))},
    })


def run(store_dir: str, name: str, trials: int) -> dict:
    sweep = spec(name, trials)
    t0 = time.perf_counter()
    run_planned(plan(sweep), name, store_dir, "pool", progress=lambda line: None)
    wall_s = time.perf_counter() - t0
    rows = store.read_results(store_dir, name)
    return {"trials": trials, "ok": int((rows.status == "ok").sum()), "wall_s": wall_s,
            "trials_per_min": trials / wall_s * 60, "driver_rss_gib": psutil.Process().memory_info().rss / GIB}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--small", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="raybench-many-") as store_dir, ray_cluster(None):
        small = run(store_dir, "many-small", args.small)
        large = run(store_dir, "many-large", args.trials)
        again = run(store_dir, "many-large-again", args.trials)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{'sweep':<8}{'trials':>8}{'ok':>6}{'wall s':>9}{'trials/min':>12}{'driver RSS GiB':>16}")
    for name, r in (("small", small), ("large", large), ("again", again)):
        print(f"{name:<8}{r['trials']:>8}{r['ok']:>6}{r['wall_s']:>9.1f}{r['trials_per_min']:>12.0f}"
              f"{r['driver_rss_gib']:>16.2f}")
    print(json.dumps({
        "bench": "many_trials", "metric": "trials per minute through the warm pool (large sweep)",
        "value": round(large["trials_per_min"], 1), "goal": "driver peak < 2 GiB and flat in trial count",
        "driver_peak_gib": round(peak_gib, 3), "driver_rss_small_gib": round(small["driver_rss_gib"], 3),
        "driver_rss_large_gib": round(large["driver_rss_gib"], 3),
        "driver_rss_again_gib": round(again["driver_rss_gib"], 3), "small": small, "large": large, "again": again,
    }))


if __name__ == "__main__":
    main()
