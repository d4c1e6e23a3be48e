"""What an embedded Ray costs a test process that starts its own: `drivers.ray_cluster.ray_cluster(None)`'s start,
its first task, its shutdown: what a test file that runs sweeps on Ray pays once.

    .venv/bin/python bench/ray_start.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def one_cycle() -> tuple[float, float, float]:
    from raybench.drivers.ray_cluster import ray_cluster

    t0 = time.perf_counter()
    with ray_cluster(None):
        import ray

        t1 = time.perf_counter()
        ray.get(ray.remote(lambda: 1).remote())
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cycles = [one_cycle() for _ in range(args.repeats)]
    start, task, stop = (statistics.median(c[i] for c in cycles) for i in range(3))
    print(f"{'cycle':>5} {'start_s':>8} {'first_task_s':>13} {'shutdown_s':>11}")
    for i, (a, b, c) in enumerate(cycles):
        print(f"{i:>5} {a:8.2f} {b:13.2f} {c:11.2f}")
    print(json.dumps({"bench": "ray_start", "metric": "start + first task + shutdown, median (s)",
                      "value": round(start + task + stop, 2), "goal": "paid once per test process",
                      "start_s": round(start, 2), "first_task_s": round(task, 2), "shutdown_s": round(stop, 2),
                      "repeats": args.repeats}))


if __name__ == "__main__":
    main()
