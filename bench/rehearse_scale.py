"""How long `raybench rehearse` takes at seed-001 scale, and how much host memory it needs.

    .venv/bin/python bench/rehearse_scale.py            # one trial: Qwen2.5-72B, 64 ranks, sAC 1 (goal: <= 30 s,
                                                        # <= 8 GiB peak RSS)
    .venv/bin/python bench/rehearse_scale.py --sweep    # the whole sweeps/seed001-idris-sac.yaml (goal: <= 120 s)
    ... --full-depth  # trace every block (`raybench rehearse --full-depth`) instead of extrapolating depth
    ... --store DIR   # keep the rehearsals there (then `raybench best SWEEP --predict --store DIR`)
    ... --jobs N      # `raybench rehearse --jobs N` (default: as it, one worker process per CPU this process may use)
    .venv/bin/python bench/rehearse_scale.py --check-depth  # the sweep both ways: how far the extrapolated
                                                            # rehearsals are from the full traces

Each run is a fresh `raybench rehearse` process (as a user would start it); its wall time and peak RSS (the
child's ru_maxrss) are measured from outside. Prints the rehearsal table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SWEEP = REPO / "sweeps" / "seed001-idris-sac.yaml"
GPU = "H100 SXM"
# The plan index of Qwen2.5-72B at sAC 1 without compile (axes: model, ac_ratio, compile; first varies slowest).
TRIAL_72B = "28"


def run(extra: list[str], keep: str | None) -> tuple[float, float, float, str]:
    """(wall seconds, peak RSS GiB, CPU seconds, stdout) of one `raybench rehearse` process (CPU seconds: its
    workers' too, what it cost whatever other processes' load left of the wall time); `keep`: its store, else a
    temporary one."""
    with tempfile.TemporaryDirectory() as temporary:
        store = keep or temporary
        cmd = [sys.executable, "-m", "raybench", "rehearse", str(SWEEP), "--gpu", GPU, "--store", store, *extra]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        wall_s = time.perf_counter() - t0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # its worker processes' included
    rss_gib = children.ru_maxrss / 2**20  # the largest process's: with --jobs, one of N that each hold this much
    return wall_s, rss_gib, children.ru_utime + children.ru_stime, done.stdout


def rehearsals(store: str) -> dict[str, dict]:
    """The stored rehearsals of a store, by file name (config id)."""
    return {path.name: json.loads(path.read_text()) for path in sorted(Path(store, "rehearsals").glob("*.json"))}


def depth_differences(extrapolated: dict[str, dict], full: dict[str, dict]) -> dict[str, float]:
    """The largest relative difference over the trials, per predicted quantity, and the largest absolute one
    per memory category (GiB)."""
    worst: dict[str, float] = {}
    for name, whole in full.items():
        line = extrapolated[name]
        for field in ("peak_gib", "reserved_gib", "step_time_s", "flops", "compute_s", "comm_s", "roofline_s"):
            if whole[field]:
                worst[field] = max(worst.get(field, 0.0), abs(line[field] / whole[field] - 1))
        for category, gib in whole["memory_gib"].items():
            key = f"{category}_abs_gib"
            worst[key] = max(worst.get(key, 0.0), abs(line["memory_gib"][category] - gib))
        differ = int(line["comm_bytes"] != whole["comm_bytes"])
        worst["comm_bytes_differ"] = max(worst.get("comm_bytes_differ", 0), differ)
    return worst


def check_depth() -> dict:
    with tempfile.TemporaryDirectory() as line_store, tempfile.TemporaryDirectory() as full_store:
        line_s, _, _, _ = run([], line_store)
        full_s, _, _, _ = run(["--full-depth"], full_store)
        line, full = rehearsals(line_store), rehearsals(full_store)
        notes = sum(any("extrapolated to" in note for note in r["notes"]) for r in line.values())
        return {"bench": "rehearse_scale", "metric": "extrapolated depth against full traces, seed 001's sweep",
                "trials": len(full), "extrapolated": notes, "extrapolated_s": round(line_s, 1),
                "full_depth_s": round(full_s, 1), "max_differences": depth_differences(line, full)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="the whole seed-001 sweep instead of one 72B trial")
    parser.add_argument("--full-depth", action="store_true", help="trace every block (raybench rehearse --full-depth)")
    parser.add_argument("--check-depth", action="store_true", help="the sweep extrapolated and traced whole, compared")
    parser.add_argument("--store", help="keep the rehearsals in this store")
    parser.add_argument("--jobs", type=int, help="raybench rehearse --jobs (default: its own)")
    args = parser.parse_args()
    if args.check_depth:
        print(json.dumps({**check_depth(), "cpus": os.cpu_count()}))
        return
    extra = (["--full-depth"] if args.full_depth else []) + (["--jobs", str(args.jobs)] if args.jobs else [])
    wall_s, rss_gib, cpu_s, out = run(extra + ([] if args.sweep else ["--trial", TRIAL_72B]), args.store)
    print(out)
    if args.sweep:
        result = {"bench": "rehearse_scale", "metric": "seconds to rehearse sweeps/seed001-idris-sac.yaml",
                  "value": round(wall_s, 1), "goal": "<= 120 s", "peak_rss_gib": round(rss_gib, 2)}
    else:
        result = {"bench": "rehearse_scale", "metric": "seconds to rehearse one Qwen2.5-72B 64-rank trial",
                  "value": round(wall_s, 1), "goal": "<= 30 s and <= 8 GiB", "peak_rss_gib": round(rss_gib, 2)}
    print(json.dumps({**result, "cpu_s": round(cpu_s, 1), "full_depth": args.full_depth, "jobs": args.jobs,
                      "cpus": os.cpu_count(), "load_avg": os.getloadavg()}))


if __name__ == "__main__":
    main()
