"""Run a planned sweep on Ray: Ray Tune schedules one lightweight driver per trial; each driver runs its
trial through the executor and writes the row itself, so a row exists even when Tune loses track of a trial.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from raybench import store
from raybench.plan import PlannedTrial
from raybench.trial import build_row, run_trial, summary

# Trial drivers only wait on their trainer; they hold one slot of this custom resource instead of real CPUs
# (a Tune trial cannot ask for zero resources), so drivers never steal cores from the workers.
DRIVER_RESOURCE = "raybench_driver"
DRIVER_SLOTS = 1000


@contextlib.contextmanager
def ray_cluster(address: str | None, verbose: bool = False):
    """Connect to `address`, or start a private local Ray that touches no other Ray on this host."""
    import ray

    if ray.is_initialized():
        yield
        return
    log = dict(log_to_driver=verbose, logging_level="INFO" if verbose else "WARNING")
    if address:
        ray.init(address=address, **log)
        try:
            yield
        finally:
            ray.shutdown()
        return
    # Explicit auth mode: a stray ~/.ray token would otherwise switch token auth on silently.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="rb-", dir="/tmp")  # short: Ray's unix sockets need paths <= 107 bytes
    try:
        ray.init(address="local", _temp_dir=temp_dir, resources={DRIVER_RESOURCE: DRIVER_SLOTS},
                 include_dashboard=False, **log)
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def max_concurrent(trials: list[PlannedTrial], cluster: dict[str, float]) -> int:
    """How many of the largest trial fit on the cluster at once (at least one)."""
    need_cpu = max(t.config.resources.workers * t.config.resources.cpus_per_worker for t in trials)
    need_gpu = max(t.config.resources.workers * t.config.resources.gpus_per_worker for t in trials)
    fits = math.floor(cluster.get("CPU", 0) / need_cpu)
    if need_gpu:
        fits = min(fits, math.floor(cluster.get("GPU", 0) / need_gpu))
    return max(1, fits)


def _driver_resources(cluster: dict[str, float]) -> dict[str, float]:
    if cluster.get(DRIVER_RESOURCE, 0) >= 1:
        return {"cpu": 0, DRIVER_RESOURCE: 1}
    return {"cpu": 0.02}  # a cluster raybench did not start: take a sliver of a CPU


def _trial_driver(config: dict) -> None:
    """Ray Tune function trainable: run one trial, store its row, report the headline metrics to Tune."""
    from ray import tune

    from raybench import executors

    job = config["job"]
    row = run_trial(config["payload"], job["sweep"], job["store"], job["executor"], executors.get(job["executor"]))
    tune.report({"status": row["status"], "tok_per_s_per_device": row.get("tok_per_s_per_device") or 0.0,
                 "trial_id": row["trial_id"], "summary": summary(row)})


def run_planned(trials: list[PlannedTrial], sweep: str, store_path: str, executor: str,
                address: str | None = None, progress: Callable[[str], None] = print, verbose: bool = False) -> None:
    """Run every planned trial through Ray Tune (grid order); rows land in the store as trials finish."""
    import ray
    from ray import tune

    store_path = str(Path(store_path).resolve())  # drivers run with another working directory
    # Tune's own console tables and result loggers duplicate what raybench prints and stores.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    job = {"sweep": sweep, "store": store_path, "executor": executor}
    total = len(trials)
    done = 0

    class Progress(tune.Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):
            nonlocal done
            done += 1
            progress(f"[{done}/{total}] {result['summary']}")

    with ray_cluster(address, verbose), tempfile.TemporaryDirectory(prefix="raybench-tune-") as tune_dir:
        cluster = ray.cluster_resources()
        tuner = tune.Tuner(
            tune.with_resources(_trial_driver, _driver_resources(cluster)),
            param_space={"job": job, "payload": tune.grid_search([t.as_payload() for t in trials])},
            tune_config=tune.TuneConfig(max_concurrent_trials=max_concurrent(trials, cluster), reuse_actors=False),
            run_config=tune.RunConfig(name=sweep, storage_path=tune_dir, verbose=0, callbacks=[Progress()]),
        )
        tuner.fit()

    # A driver killed from outside (node loss, OOM killer) wrote nothing: give its trial an error row.
    stored = set(store.read_table(store_path, sweep, latest=False).column("trial_id").to_pylist())
    for t in trials:
        if t.trial_id not in stored:
            payload = t.as_payload()
            store.write_row(store_path, build_row(payload, sweep, "error", "trial driver died before storing a row",
                                                  executor=executor))


def write_unrun(trials: list[PlannedTrial], sweep: str, store_path: str) -> None:
    """Rows for planned points that are not run (invalid combinations kept with --keep-invalid)."""
    for t in trials:
        store.write_row(store_path, build_row(t.as_payload(), sweep, t.status, "; ".join(t.reasons)))
