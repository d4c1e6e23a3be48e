"""Run by test_faults_ray.py in a process of its own (starting Ray changes its process's environment): one Ray
Train trial through the train executor on an embedded Ray, then print, one per line, the Ray actor processes
that outlived it."""

from __future__ import annotations

import sys
import time

import psutil

from raybench.config import parse_sweep
from raybench.executors import train
from raybench.plan import plan
from raybench.sweep import ray_cluster

GRACE_S = 30  # an actor whose owner let go of it is reaped within seconds


def actor_names() -> list[str]:
    names = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("ray::") and p.name() != "ray::IDLE":
                names.append(p.name())
        except psutil.Error:
            continue
    return names


def main(cache_dir: str) -> None:
    spec = parse_sweep({"name": "leftovers", "model": {"preset": "tiny"}, "executor": "train",
                        "train": {"steps": 2, "warmup_steps": 1, "seq_len": 32, "precision": "fp32"},
                        "resources": {"workers": 2, "timeout_s": 150}})
    (trial,) = plan(spec)
    with ray_cluster(None):
        assert train.execute(trial.as_payload().replace(cache_dir=cache_dir))
        deadline = time.time() + GRACE_S
        while time.time() < deadline and any("Controller" in n for n in actor_names()):
            time.sleep(0.5)
        print("\n".join(actor_names()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
