"""Run by test_faults_ray.py in a process of its own (starting Ray changes its process's environment): one Ray
Train trial through the train executor on an embedded Ray, then print, one per line, the Ray processes that
outlived it; last, the executor's timeout note while a placement group larger than the machine waits."""

from __future__ import annotations

import os
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
    with ray_cluster(None):  # before `import ray`: the embedded Ray starts as `raybench run` starts it
        import ray

        assert train.execute(trial.as_payload().replace(cache_dir=cache_dir))
        deadline = time.time() + GRACE_S
        while time.time() < deadline and any("Controller" in n for n in actor_names()):
            time.sleep(0.5)
        print("\n".join(actor_names()), flush=True)
        pending = ray.util.placement_group([{"CPU": 1}] * (os.cpu_count() + 1))
        print(train._waiting_for_resources(), flush=True)
        ray.util.remove_placement_group(pending)


if __name__ == "__main__":
    main(sys.argv[1])
