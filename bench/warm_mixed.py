"""How often the warm pool starts fresh actors in sweeps that mix trial kinds, on one embedded Ray.

    .venv/bin/python bench/warm_mixed.py [--trials 6] [--steps 10]

Two pool sweeps of the tiny preset on 2 gloo workers: "compile" alternates eager and compiled trials; "deepspeed"
runs DeepSpeed ZeRO-2 trials one after another. A trial whose `process_trial_index` is 0 ran in actors started
for it (a group start: ~11 s here before its first step). Prints one JSON line per sweep: fresh-group trials,
trials, and the sweep's wall time. Goal: one fresh group per sweep (nothing a trial changes that a fresh
process would not also have should end a group).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from raybench.drivers.ray_cluster import ray_cluster
from raybench.drivers.sweep import run_planned
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep


def sweep_spec(name: str, setups: list[dict], steps: int):
    return parse_sweep({
        "name": f"warm-mixed-{name}", "model": {"preset": "tiny"}, "executor": "pool",
        "train": {"steps": steps, "warmup_steps": 2, "seq_len": 64, "precision": "fp32", "strategy": "fsdp2"},
        "resources": {"workers": 2}, "axes": {"setup": setups},
    })


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    # Distinct learning rates keep the trials distinct; the kinds alternate in plan (run) order.
    lrs = [1e-4 * (i + 1) for i in range(args.trials)]
    sweeps = {
        "compile": [{"train.lr": lr, "train.compile": i % 2 == 1} for i, lr in enumerate(lrs)],
        "deepspeed": [{"train.lr": lr, "train.strategy": "deepspeed", "train.zero_stage": 2} for lr in lrs],
    }
    with tempfile.TemporaryDirectory(prefix="raybench-bench-") as store_dir, ray_cluster(None):
        for name, setups in sweeps.items():
            spec = sweep_spec(name, setups, args.steps)
            t0 = time.perf_counter()
            run_planned(plan(spec), spec.name, store_dir, "pool", progress=lambda line: None)
            wall = time.perf_counter() - t0
            rows = store.read_results(store_dir, spec.name).sort_values("ended_at")
            print(json.dumps({"bench": "warm_mixed", "sweep": name, "trials": len(rows),
                              "ok": int((rows.status == "ok").sum()),
                              "fresh_group_trials": int((rows.process_trial_index == 0).sum()),
                              "process_trial_index": rows.process_trial_index.tolist(),
                              "sweep_wall_s": round(wall, 1), "goal": "fresh_group_trials == 1"}), flush=True)


if __name__ == "__main__":
    main()
