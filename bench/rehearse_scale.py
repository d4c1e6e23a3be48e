"""How long `raybench rehearse` takes at seed-001 scale, and how much host memory it needs.

    .venv/bin/python bench/rehearse_scale.py            # one trial: Qwen2.5-72B, 64 ranks, sAC 1 (goal: <= 120 s,
                                                        # <= 8 GiB peak RSS)
    .venv/bin/python bench/rehearse_scale.py --sweep    # the whole sweeps/seed001-idris-sac.yaml (goal: <= 30 min)
    ... --store DIR   # keep the rehearsals there (then `raybench best SWEEP --predict --store DIR`)

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


def run(extra: list[str], keep: str | None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS GiB, stdout) of one `raybench rehearse` process; `keep`: its store, else a
    temporary one."""
    with tempfile.TemporaryDirectory() as temporary:
        store = keep or temporary
        cmd = [sys.executable, "-m", "raybench", "rehearse", str(SWEEP), "--gpu", GPU, "--store", store, *extra]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        wall_s = time.perf_counter() - t0
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return wall_s, rss_gib, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="the whole seed-001 sweep instead of one 72B trial")
    parser.add_argument("--store", help="keep the rehearsals in this store")
    args = parser.parse_args()
    wall_s, rss_gib, out = run([] if args.sweep else ["--trial", TRIAL_72B], args.store)
    print(out)
    if args.sweep:
        result = {"bench": "rehearse_scale", "metric": "seconds to rehearse sweeps/seed001-idris-sac.yaml",
                  "value": round(wall_s, 1), "goal": "<= 1800 s", "peak_rss_gib": round(rss_gib, 2)}
    else:
        result = {"bench": "rehearse_scale", "metric": "seconds to rehearse one Qwen2.5-72B 64-rank trial",
                  "value": round(wall_s, 1), "goal": "<= 120 s and <= 8 GiB", "peak_rss_gib": round(rss_gib, 2)}
    print(json.dumps({**result, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
