"""Where a Ray Train trial's overhead goes: its steps, timed from Ray Train's own logs, on one embedded Ray.

    .venv/bin/python bench/train_timeline.py [--trials 2] [--steps 4] [--against-ray-defaults]

Runs `executors.train.execute` on one tiny trial (2 gloo workers, `--steps` steps) `--trials` times in a row and reads
each run's Train controller log (`logs/train/ray-train-sys-controller-*.log`, timestamped JSON lines) for the
moments it starts its workers, their context and the training function, and shuts the workers down. Prints
one JSON line per trial: seconds from the `execute` call to each moment, the call's wall time and
`worker_wall_s` (the part the worker measures itself). `--against-ray-defaults` runs every other trial without
raybench's Ray Train settings (`executors.train.TRAIN_ENV`), to compare both in one run; each line also has
the trial's `step_time_p50_s`, to see whether the settings touch what the trial measures.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from raybench.drivers.executors import train
from raybench.drivers.ray_cluster import OWNER_FILE, TEMP_ROOT, ray_cluster
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep

# The controller's log lines that mark each step (the start of the message is enough).
MOMENTS = {
    "controller_up": "Requesting resources",
    "workers_created": "[Worker Group Initialization] 2 worker actors created",
    "context_ready": "[Worker Group Initialization] Train context initialized",
    "train_fn_started": "Started training worker group",
    "workers_shut_down": "Shutting down",
}


def controller_moments(log: Path) -> dict[str, float]:
    """Epoch seconds of each MOMENTS line in one controller log."""
    found = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        for name, start in MOMENTS.items():
            if name not in found and entry["message"].startswith(start):
                stamp = datetime.strptime(entry["asctime"], "%Y-%m-%d %H:%M:%S,%f").astimezone(timezone.utc)
                found[name] = stamp.timestamp()
    return found


def own_ray_dir() -> Path:
    """The temp dir of the embedded Ray this process started (its owner file names this process)."""
    for path in Path(TEMP_ROOT).glob("rb-*"):
        owner = path / OWNER_FILE
        if owner.is_file() and owner.read_text().split()[0] == str(os.getpid()):
            return path
    raise RuntimeError("no embedded Ray of this process found")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--against-ray-defaults", action="store_true")
    args = parser.parse_args()
    settings = [("raybench", dict(train.TRAIN_ENV))]
    if args.against_ray_defaults:
        settings.append(("ray-defaults", {}))
    spec = parse_sweep({"name": "train-timeline", "model": {"preset": "tiny"}, "executor": "train",
                        "train": {"steps": args.steps, "warmup_steps": 1, "seq_len": 32, "precision": "fp32"},
                        "resources": {"workers": 2, "timeout_s": 600}})
    (trial,) = plan(spec)
    with tempfile.TemporaryDirectory() as cache, ray_cluster(None):
        logs = own_ray_dir() / "session_latest" / "logs" / "train"
        for index in range(args.trials):
            seen = set(glob.glob(str(logs / "ray-train-sys-controller-*.log")))
            setting, train.TRAIN_ENV = settings[index % len(settings)]
            start = time.time()
            metrics = train.execute(trial.payload.replace(cache_dir=cache)).metrics
            wall = time.time() - start
            (log,) = set(glob.glob(str(logs / "ray-train-sys-controller-*.log"))) - seen
            moments = {name: round(at - start, 2) for name, at in controller_moments(Path(log)).items()}
            print(json.dumps({"bench": "train_timeline", "trial": index, "settings": setting,
                              "wall_s": round(wall, 2),
                              "worker_wall_s": round(metrics.worker_wall_s, 2),
                              "step_time_p50_s": round(metrics.step_time_p50_s, 4), **moments}), flush=True)


if __name__ == "__main__":
    main()
