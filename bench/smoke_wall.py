"""A first-time user's wall time for the smoke sweep: `raybench run sweeps/smoke-cpu.yaml` as the README's quick
start runs it (a new process, an embedded Ray started and stopped, a new store), once with the default executor
and once with `executor: train` (the default before it was auto), interleaved A B B A.

    .venv/bin/python bench/smoke_wall.py [--rounds 1] [--sweep sweeps/smoke-cpu.yaml]

Prints one JSON line per run (executor, wall seconds, exit code), then the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(sweep: Path, executor: str | None) -> dict:
    """One `raybench run` in a new process on a new store; executor None leaves the sweep's own (the default)."""
    with tempfile.TemporaryDirectory() as tmp:
        text = sweep.read_text() + (f"\nexecutor: {executor}\n" if executor else "")
        copy = Path(tmp) / sweep.name
        copy.write_text(text)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "raybench", "run", str(copy), "--store", str(Path(tmp) / "store")],
                              cwd=tmp, capture_output=True, text=True)
        wall_s = time.perf_counter() - start
    return {"executor": executor or "default", "wall_s": round(wall_s, 1), "exit": done.returncode}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1, help="A B B A rounds")
    parser.add_argument("--sweep", default=str(REPO / "sweeps" / "smoke-cpu.yaml"))
    args = parser.parse_args()
    walls: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for executor in (None, "train", "train", None):
            found = run_once(Path(args.sweep), executor)
            print(json.dumps(found), flush=True)
            if found["exit"] != 0:
                sys.exit(f"raybench run exited {found['exit']}")
            walls.setdefault(found["executor"], []).append(found["wall_s"])
    medians = {name: statistics.median(values) for name, values in walls.items()}
    print(json.dumps({"median_wall_s": medians, "default_over_train": round(medians["default"] / medians["train"], 3)}))


if __name__ == "__main__":
    main()
