"""How long `raybench rehearse` takes on bench/sweeps/grid-1000.yaml, on the whole grid or a slice of it.

    .venv/bin/python bench/rehearse_grid.py                          # all 1,050 points (goal: <= 600 s)
    .venv/bin/python bench/rehearse_grid.py --model qwen2.5-72b --strategy fsdp2 --grad-accum 1 --workers 64 128

One process, as `raybench rehearse` runs (one trace cache for the points rehearsed); a temporary store unless
--store. Prints one line per point (seconds so far, its axis values, its trace seconds and how its depth was
traced), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from raybench.planning.plan import plan
from raybench.rehearse.trials import rehearse_trials
from raybench.spec.load import load_sweep

SWEEP = Path(__file__).resolve().parent / "sweeps" / "grid-1000.yaml"


def selected(trial, args) -> bool:
    values = trial.axis_values
    wanted = {"model.preset": args.model, "train.strategy": args.strategy, "train.grad_accum": args.grad_accum,
              "resources.workers": args.workers, "train.ac_ratio": args.ac_ratio}
    return all(not allowed or values[name] in allowed for name, allowed in wanted.items())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", nargs="*")
    parser.add_argument("--strategy", nargs="*")
    parser.add_argument("--grad-accum", nargs="*", type=int)
    parser.add_argument("--workers", nargs="*", type=int)
    parser.add_argument("--ac-ratio", nargs="*")
    parser.add_argument("--store", help="keep the rehearsals there (then `raybench best SWEEP --predict --store`)")
    args = parser.parse_args()
    spec = load_sweep(SWEEP)
    trials = [t for t in plan(spec) if selected(t, args)]
    store = args.store or tempfile.mkdtemp()
    t0 = time.perf_counter()
    for row in rehearse_trials(spec, trials, store):
        depth = [note for note in row["notes"] if "depth" in note]
        print(f"{time.perf_counter() - t0:8.1f} s  {row['axis_values']}  trace {row['trace_s'] or 0:.1f} s  {depth}",
              flush=True)
    print(json.dumps({"bench": "rehearse_grid", "metric": "seconds to rehearse grid-1000 points",
                      "points": len(trials), "value": round(time.perf_counter() - t0, 1), "goal": "<= 600 s (all)",
                      "cpus": os.cpu_count(), "load_avg": os.getloadavg()}))


if __name__ == "__main__":
    main()
