"""How long validating and planning a large grid takes (bench/sweeps/grid-10k.yaml, 10,000 points).

    .venv/bin/python bench/plan_scale.py [--repeats 5]

Prints a table, then one JSON line: value = median seconds for load_sweep + plan of the 10k grid. Goal < 5 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from raybench.planning.plan import plan
from raybench.spec.load import load_sweep

SWEEP = Path(__file__).resolve().parent / "sweeps" / "grid-10k.yaml"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_s, plan_s, count = [], [], 0
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        spec = load_sweep(SWEEP)
        t1 = time.perf_counter()
        count = len(plan(spec))
        t2 = time.perf_counter()
        load_s.append(t1 - t0)
        plan_s.append(t2 - t1)
    total = [a + b for a, b in zip(load_s, plan_s)]
    print(f"{'phase':<16}{'median s':>10}{'max s':>10}")
    for name, values in (("load+validate", load_s), ("plan", plan_s), ("total", total)):
        print(f"{name:<16}{statistics.median(values):>10.3f}{max(values):>10.3f}")
    print(json.dumps({"bench": "plan_scale", "metric": "seconds to validate and plan a 10,000-point grid",
                      "value": round(statistics.median(total), 3), "goal": "< 5 s", "trials": count,
                      "max_s": round(max(total), 3), "repeats": args.repeats}))


if __name__ == "__main__":
    main()
