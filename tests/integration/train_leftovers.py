"""Run by test_faults_ray.py in a process of its own (starting Ray changes its process's environment): on an
embedded Ray started as `raybench run` starts it,
1. one Ray Train trial through the train executor, then the Ray processes that outlived it, one per line;
2. a trial ended (interrupted) while its placement group waits behind an actor holding every CPU: once that
   actor is gone, the dead trial's group takes the CPUs, until release_orphaned_placement_groups removes it.
Last line, JSON: what a timeout's message would have said while the group waited, whether the dead trial's group
took the CPUs, what the reaper removed, the CPUs free after it, and the state of a placement group the driver
holds (which the reaper must not touch)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import psutil

from raybench.drivers.executors import train
from raybench.drivers.ray_cluster import DRIVER_RESOURCE, ray_cluster
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep

GRACE_S = 30  # an actor whose owner let go of it is reaped within seconds
PER_TRIAL = ("ray::TrainController", "ray::DatasetManager")  # actors each Train run starts


def actor_names() -> list[str]:
    names = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("ray::") and p.name() != "ray::IDLE":
                names.append(p.name())
        except psutil.Error:
            continue
    return names


def payload(cache_dir: str):
    spec = parse_sweep({"name": "leftovers", "model": {"preset": "tiny"}, "executor": "train",
                        "train": {"steps": 2, "warmup_steps": 1, "seq_len": 32, "precision": "fp32"},
                        "resources": {"workers": 2, "timeout_s": 150}})
    (trial,) = plan(spec)
    return trial.payload.replace(cache_dir=cache_dir)


def main(cache_dir: str) -> None:
    with ray_cluster(None):  # before `import ray`
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        assert train.execute(payload(cache_dir))
        wait_for(lambda: not set(PER_TRIAL) & set(actor_names()))
        print("\n".join(actor_names()), flush=True)

        driver_group = placement_group([{DRIVER_RESOURCE: 1}])
        ray.get(driver_group.ready())
        total_cpu = ray.cluster_resources()["CPU"]
        holder = ray.remote(num_cpus=total_cpu)(Holder).remote()
        ray.get(holder.ready.remote())
        # End the queued trial once its group waits, as an interrupt (Tune ending a trial) does: the same path
        # as a timeout, which could fall before the controller asked for the group.
        note, caught = [], threading.Event()
        signal.signal(signal.SIGINT, lambda *_: None if caught.is_set() else _raise_interrupt())
        threading.Thread(target=interrupt_when_queued, args=(note, caught), daemon=True).start()
        try:
            train.execute(payload(cache_dir))
            raise AssertionError("the queued trial was not interrupted")
        except KeyboardInterrupt:
            caught.set()
        ray.kill(holder)
        leaked = wait_for(lambda: cpu_groups("CREATED"))  # the dead trial's group takes the freed CPUs
        removed, deadline = 0, time.time() + GRACE_S
        while time.time() < deadline and ray.available_resources().get("CPU", 0) < total_cpu:
            removed += train.release_orphaned_placement_groups()
            time.sleep(0.5)
        print(json.dumps({"note": note[0], "leaked": leaked, "removed": removed, "total_cpu": total_cpu,
                          "free_cpu": ray.available_resources().get("CPU", 0),
                          "driver_group": placement_group_table(driver_group)["state"]}), flush=True)


def cpu_groups(state: str) -> list:
    from ray.util.placement_group import placement_group_table

    return [g for g in placement_group_table().values()
            if g["state"] == state and any("CPU" in bundle for bundle in g["bundles"].values())]


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


def interrupt_when_queued(note: list, caught: threading.Event) -> None:
    """Once a trial's placement group waits for CPUs: note what a timeout would say then, and interrupt, once a
    second until the main thread has caught it. A KeyboardInterrupt raised while the main thread is inside Ray's
    own C++ code (a GCS call that checks for signals) can be dropped there: seen under load as a trial that ran
    to its timeout. Ending a trial this way is the test's; Tune ends trials without signals."""
    assert wait_for(lambda: cpu_groups("PENDING"), limit_s=120), "no trial's group waited for CPUs"
    note.append(train._waiting_for_resources())
    while not caught.is_set():
        os.kill(os.getpid(), signal.SIGINT)
        caught.wait(1.0)


def wait_for(condition, limit_s: float = GRACE_S) -> bool:
    deadline = time.time() + limit_s
    while not condition():
        if time.time() > deadline:
            return False
        time.sleep(0.5)
    return True


class Holder:
    def ready(self) -> bool:
        return True


if __name__ == "__main__":
    main(sys.argv[1])
