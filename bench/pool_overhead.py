"""Where a warm pool trial's time beyond its training loop goes, without Ray Tune: the executor called directly.

    .venv/bin/python bench/pool_overhead.py [--trials 12]

Calls `executors.pool.execute` on one embedded Ray, alternating a DDP and an FSDP2 trial of the tiny preset
(2 gloo workers, 20 steps) on the same warm group. Per trial it splits the call's wall time into the loop
(warm-up step + timed window), the rest of the workers' own time (build, wrap, metrics; for DDP also the 3+3
steps after the timed window that measure exposed communication, docs/metrics.md) and the driver's side
(lease, actor calls, health check, release). Prints one JSON line per trial, then the medians per strategy
after the first two trials. `bench/warm_vs_cold.py` adds Ray Tune and the row write on top.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from raybench.drivers.ray_cluster import ray_cluster
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep

PARTS = ("wall_s", "loop_s", "worker_beyond_loop_s", "driver_side_s", "step_time_p50_s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=12)
    args = parser.parse_args()
    spec = parse_sweep({"name": "pool-overhead", "model": {"preset": "tiny"}, "executor": "pool",
                        "train": {"steps": 20, "warmup_steps": 1, "seq_len": 32, "precision": "fp32"},
                        "resources": {"workers": 2}, "axes": {"train.strategy": ["ddp", "fsdp2"]}})
    trials = plan(spec)
    by_strategy: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as cache, ray_cluster(None):
        from raybench.drivers.executors import pool  # imports Ray, which must follow ray_cluster's token set-up

        for index in range(args.trials):
            trial = trials[index % len(trials)]
            start = time.perf_counter()
            metrics = pool.execute(trial.payload.replace(cache_dir=cache)).metrics
            wall = time.perf_counter() - start
            loop = metrics.warmup_s + metrics.timed_window_s
            parts = {"wall_s": wall, "loop_s": loop, "worker_beyond_loop_s": metrics.worker_wall_s - loop,
                     "driver_side_s": wall - metrics.worker_wall_s, "step_time_p50_s": metrics.step_time_p50_s}
            strategy = trial.config.train.strategy
            print(json.dumps({"bench": "pool_overhead", "trial": index, "strategy": strategy,
                              **{k: round(v, 3) for k, v in parts.items()}}), flush=True)
            if index >= len(trials):  # each strategy's first trial starts the group or builds its first model
                by_strategy.setdefault(strategy, []).append(parts)
    for strategy, rows in by_strategy.items():
        medians = {k: round(statistics.median(r[k] for r in rows), 3) for k in PARTS}
        print(json.dumps({"bench": "pool_overhead", "strategy": strategy, "median_after_first": medians}))


if __name__ == "__main__":
    main()
