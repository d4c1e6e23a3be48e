"""Run a planned sweep on Ray: Ray Tune schedules one lightweight driver per trial; each driver runs its
trial through the executor and writes the row itself, so a row exists even when Tune loses track of a trial.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from raybench import store
from raybench.plan import PlannedTrial
from raybench.trial import build_row, run_trial, summary

if TYPE_CHECKING:
    from raybench.search import PlannedSearch

# Trial drivers only wait on their trainer; they hold one slot of this custom resource instead of real CPUs
# (a Tune trial cannot ask for zero resources), so drivers never steal cores from the workers.
DRIVER_RESOURCE = "raybench_driver"
DRIVER_SLOTS = 1000
GRID_CHUNK_TRIALS = 200  # planned trials per Ray Tune experiment (see run_planned)
# Embedded Ray clusters live in TEMP_ROOT/rb-*; OWNER_FILE there names the raybench process that owns one.
TEMP_ROOT = "/tmp"
OWNER_FILE = "raybench-owner"


class Terminated(BaseException):
    """SIGTERM (end of allocation, scancel) reached the sweep: stop now, keep what is stored."""


@contextlib.contextmanager
def terminate_on_sigterm():
    """Turn SIGTERM into `Terminated` in the main thread so that every `finally` (Ray shutdown) runs."""
    def handler(signum, frame):
        raise Terminated(f"received signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _process_id(pid: int) -> str:
    """pid plus start time: a pid alone may be reused by an unrelated process."""
    import psutil

    return f"{pid} {psutil.Process(pid).create_time()}"


def _owner_alive(temp_dir: Path) -> bool:
    import psutil

    try:
        recorded = (temp_dir / OWNER_FILE).read_text().strip()
        return _process_id(int(recorded.split()[0])) == recorded
    except (OSError, ValueError, psutil.Error):
        return False


def _processes_using(directory: Path) -> list:
    """This user's processes with an open file or working directory inside `directory`."""
    import psutil

    prefix, found = str(directory) + "/", []
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"].real != os.getuid() or proc.pid == os.getpid():
                continue
            paths = [f.path for f in proc.open_files()] + [proc.cwd()]
            if any(p.startswith(prefix) for p in paths):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def reap_stale_clusters(root: str = TEMP_ROOT) -> list[Path]:
    """Kill what is left of embedded Rays whose raybench process died (kill -9, OOM killer) and delete their
    temp dirs. Only dirs with an owner file whose process is gone are touched; other Rays are never seen."""
    reaped = []
    for temp_dir in Path(root).glob("rb-*"):
        owned = (temp_dir / OWNER_FILE).is_file() and temp_dir.stat().st_uid == os.getuid()
        if not owned or _owner_alive(temp_dir):
            continue
        remove_cluster_dir(temp_dir)
        reaped.append(temp_dir)
    return reaped


def remove_cluster_dir(temp_dir: Path) -> None:
    """Stop the processes that still use an embedded Ray's temp dir (SIGTERM, then SIGKILL), then delete it."""
    import psutil

    procs = _processes_using(temp_dir)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def ray_cluster(address: str | None, verbose: bool = False):
    """Connect to `address`, or start a private local Ray that touches no other Ray on this host."""
    if not address:
        use_token_auth()  # before `import ray`
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
    reap_stale_clusters()
    temp_dir = tempfile.mkdtemp(prefix="rb-", dir=TEMP_ROOT)  # short: Ray's unix sockets need paths <= 107 bytes
    Path(temp_dir, OWNER_FILE).write_text(_process_id(os.getpid()))
    try:
        # Ray's gRPC servers listen on every interface whatever the node IP: token auth is what keeps other
        # hosts out. The dashboard listens on localhost only. It must run: Train V2's placement-group cleaner
        # asks it whether a Train controller is alive, and without it a controller killed at a trial's timeout
        # leaves its placement group (the trial's CPUs/GPUs) reserved for good.
        ray.init(address="local", _temp_dir=temp_dir, resources={DRIVER_RESOURCE: DRIVER_SLOTS},
                 include_dashboard=_dashboard_installed(), dashboard_host="127.0.0.1", **log)
        yield
    finally:
        ray.shutdown()
        remove_cluster_dir(Path(temp_dir))  # Ray's agents can outlive shutdown and keep writing logs there


def _dashboard_installed() -> bool:
    """Whether Ray's dashboard can start (ray[default]). Without it (a minimal Ray) runs still work, but the
    train executor cannot reclaim a timed-out trial's placement group: say so instead of failing ray.init."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401  (Ray's own test of a dashboard-capable install)
    except ImportError as err:
        import warnings

        warnings.warn(f"Ray dashboard dependencies are missing ({err}); running without the dashboard. Install "
                      "ray[default] for it: the train executor needs it to free a timed-out trial's resources.",
                      stacklevel=2)
        return False
    return True


def use_token_auth() -> None:
    """Embedded Ray runs with token auth and a fresh random token unless the user chose a mode explicitly
    (an implicit mode is a trap: a stray ~/.ray token switches token auth on silently).

    Ray fixes its auth mode when `ray` is first imported, so this must run before that import. If Ray was
    imported earlier without a mode, the mode it runs with (disabled) is made explicit and said out loud.
    """
    import secrets
    import sys
    import warnings

    if "RAY_AUTH_MODE" in os.environ:
        return
    if "ray" in sys.modules:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        warnings.warn("ray was imported before raybench could enable token auth; the embedded Ray runs without "
                      "it. Set RAY_AUTH_MODE (and RAY_AUTH_TOKEN) before importing ray to choose.", stacklevel=2)
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


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
    from raybench.progress import peak_gib

    job = config["job"]
    rows = []
    # A grid trial is one payload; a searched point is one payload per repeat.
    for payload in config.get("payloads") or [config["payload"]]:
        rows.append(run_trial(payload, job["sweep"], job["store"], job["executor"], executors.get(job["executor"])))
        row = rows[-1]
        # A searcher learns the point's outcome from the rows it reported (JSON: Tune results stay flat).
        fields = ("trial_id", "status", "message", "trial_wall_s", *job.get("metrics", ()))
        tune.report({"status": row["status"], "tok_per_s_per_device": row.get("tok_per_s_per_device") or 0.0,
                     "trial_id": row["trial_id"], "summary": summary(row), "peak_gib": peak_gib(row),
                     "rows_json": json.dumps([{k: r.get(k) for k in fields} for r in rows])})


def run_planned(trials: list[PlannedTrial], sweep: str, store_path: str, executor: str,
                address: str | None = None, progress: Callable[[str], None] = print, verbose: bool = False,
                search: PlannedSearch | None = None, max_in_flight: int | None = None) -> None:
    """Run every planned trial through Ray Tune (grid order), or with `search` the points that searcher picks
    among them (at most `max_in_flight` at once); rows land in the store as trials finish."""
    if not address:
        use_token_auth()  # before `import ray`
    import ray
    from ray import tune

    store_path = str(Path(store_path).resolve())  # drivers run with another working directory
    # Tune's own console tables duplicate what raybench prints (its result files go to a temp dir).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Ctrl-C must stop the sweep like SIGTERM does, not make Tune end its trials and return as if it had run
    # them (the trials would then get "driver died" error rows).
    os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")
    job = {"sweep": sweep, "store": store_path, "executor": executor}
    total = len(trials) if search is None else search.budget
    from raybench.progress import as_progress, dashboard_url, tune_callback

    reporter = as_progress(progress)  # a plain function gets one line per finished trial

    # ray.init installs its own SIGTERM handler (a stack dump, then death with no cleanup): ours goes on after it.
    with ray_cluster(address, verbose), terminate_on_sigterm(), \
            tempfile.TemporaryDirectory(prefix="raybench-tune-") as tune_dir:
        if executor != "pool":
            from raybench.executors import pool

            pool.release_idle()
        cluster = ray.cluster_resources()
        reporter.start(total, dashboard_url())
        in_flight = min(max_concurrent(trials, cluster), max_in_flight or math.inf)

        def fit(name: str, space: dict, **sampling) -> None:
            tune.Tuner(
                tune.with_resources(_trial_driver, _driver_resources(cluster)),
                param_space={"job": job, **space},
                # A warm pool's trial drivers are as reusable as its workers.
                tune_config=tune.TuneConfig(max_concurrent_trials=in_flight, reuse_actors=executor == "pool",
                                            **sampling),
                run_config=tune.RunConfig(name=name, storage_path=tune_dir, verbose=0,
                                          callbacks=[tune_callback(reporter)]),
            ).fit()

        if search is None:
            # One Tuner per chunk of the grid: Tune keeps every trial of an experiment in the driver and rescans
            # them at each step, so one Tuner over thousands of trials grows the driver and slows every trial.
            chunk = max(GRID_CHUNK_TRIALS, 8 * in_flight)  # large enough that draining between chunks is rare
            for start in range(0, len(trials), chunk):
                fit(f"{sweep}-{start}", {"payload": tune.grid_search([t.as_payload() for t in
                                                                      trials[start:start + chunk]])})
        else:  # the searcher hands each trial its payloads and says when it is done
            job["metrics"] = search.metrics
            fit(sweep, {}, search_alg=search, num_samples=-1)

    # A driver killed from outside (node loss, OOM killer) wrote nothing: give its trial an error row.
    stored = set(store.read_table(store_path, sweep, latest=False).column("trial_id").to_pylist())
    for t in trials if search is None else search.dispatched:
        if t.trial_id not in stored:
            payload = t.as_payload()
            store.write_row(store_path, build_row(payload, sweep, "error", "trial driver died before storing a row",
                                                  executor=executor))


def write_unrun(trials: list[PlannedTrial], sweep: str, store_path: str) -> None:
    """Rows for planned points that are not run (invalid combinations kept with --keep-invalid)."""
    for t in trials:
        store.write_row(store_path, build_row(t.as_payload(), sweep, t.status, "; ".join(t.reasons)))
