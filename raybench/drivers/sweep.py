"""Run a planned sweep on Ray: Ray Tune schedules one lightweight driver per trial; each driver runs its
trial through the executor and writes the row itself, so a row exists even when Tune loses track of a trial.
A search (`raybench.drivers.search`) is a strategy this driver hands to Tune: it picks the points, Tune runs them.
The cluster it runs on (embedded or remote, token auth, SIGTERM) is `raybench.drivers.ray_cluster`'s.

This module, `ray_cluster`, `trial` and the executors are the only ones that import Ray, always inside
functions: Ray fixes its auth mode when it is first imported (`use_token_auth` must run before), and
`raybench plan`, `validate` and `estimate` never need it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from raybench.drivers import executors
from raybench.drivers.executors import train
from raybench.drivers.progress import SweepProgress, as_progress, peak_gib
from raybench.drivers.ray_cluster import DRIVER_RESOURCE, Terminated, ray_cluster, terminate_on_sigterm, use_token_auth
from raybench.drivers.search import ANSWERED, FINISHED, PlannedSearch, SearchSpace, make_sampler, stored_rows
from raybench.drivers.trial import build_row, run_trial, summary
from raybench.planning.plan import PlannedTrial
from raybench.results import store
from raybench.spec.payload import TrialPayload
from raybench.spec.sweep_spec import SweepSpec

GRID_CHUNK_TRIALS = 200  # planned trials per Ray Tune experiment (see run_planned)


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


def pickled_payloads(trials: list[PlannedTrial]) -> dict[str, bytes]:
    """Each trial's payload pickled once, by trial id: what every trial driver of one Tune experiment gets.

    Tune hands the mapping to its trial drivers through the object store (tune.with_parameters), and each driver
    unpickles only its own payloads (unpickling is no validation). Payload objects, not bytes, would be unpickled
    whole by every driver: 0.7 s per trial for a chunk of 4096 trials, against 6 ms for the bytes."""
    return {t.trial_id: pickle.dumps(t.payload) for t in trials}


def trial_payloads(config: dict, payloads: dict[str, bytes]) -> list[TrialPayload]:
    """The payloads of the trials a Tune trial's config names, from the experiment's pickled_payloads()."""
    return [pickle.loads(payloads[trial_id]) for trial_id in trial_ids(config)]


def _trial_driver(config: dict, payloads: dict[str, bytes]) -> None:
    """Ray Tune function trainable: run one trial, store its row, report the headline metrics to Tune.
    `config` names the trial ids to run; `payloads` is pickled_payloads() of the experiment's trials."""
    from ray import tune

    job = config["job"]
    rows = []
    # A grid trial is one payload; a searched point is one payload per repeat.
    for payload in trial_payloads(config, payloads):
        try:
            rows.append(run_trial(payload, job["sweep"], job["store"], job["executor"],
                                  executors.get(job["executor"])))
        except store.StoreWriteError as err:  # the sweep driver stops the sweep: every later row would be lost too
            tune.report({"status": "error", "store_error": str(err), "trial_id": payload.trial_id,
                         "tok_per_s_per_device": 0.0, "summary": f"{payload.trial_id} not stored: {err}"})
            return
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
    listed = set(store.result_files(store_path, sweep))  # the rows this run writes are the files added to these
    job = {"sweep": sweep, "store": store_path, "executor": executor}
    total = len(trials) if search is None else search.budget
    axis_values = {t.trial_id: t.axis_values for t in trials}
    reporter = as_progress(progress)  # a plain function gets one line per finished trial

    # ray.init installs its own SIGTERM handler (a stack dump, then death with no cleanup): ours goes on after it.
    # A stop records the trials it cuts as `interrupted` before Ray's teardown, and again after it (see
    # record_interrupted).
    with record_interrupted(reporter, trials, sweep, store_path, executor, listed) as on_stop, \
            ray_cluster(address, verbose) as dashboard, terminate_on_sigterm(on_stop), \
            tempfile.TemporaryDirectory(prefix="raybench-tune-") as tune_dir:
        if executor != "pool":
            from raybench.drivers.executors import pool  # imports Ray, which must follow use_token_auth

            pool.release_idle()
        cluster = ray.cluster_resources()
        reporter.start(total, dashboard, "GPU" if all(t.config.resources.gpus_per_worker > 0 for t in trials)
                       else "worker")
        in_flight = min(max_concurrent(trials, cluster), max_in_flight or math.inf)

        stopper = store_error_stopper()

        def fit(name: str, space: dict, payloads: dict[str, bytes], **sampling) -> None:
            callbacks = [tune_callback(reporter, axis_values)]
            if executor == "train":  # Ray Train can leave an ended trial's placement group reserved
                callbacks.append(train.orphan_reaper())
            # The payloads go to the object store once per experiment; Tune's trial configs hold trial ids only.
            driver = tune.with_parameters(_trial_driver, payloads=payloads)
            tune.Tuner(
                tune.with_resources(driver, _driver_resources(cluster)),
                param_space={"job": job, **space},
                # A warm pool's trial drivers are as reusable as its workers.
                tune_config=tune.TuneConfig(max_concurrent_trials=in_flight, reuse_actors=executor == "pool",
                                            **sampling),
                run_config=tune.RunConfig(name=name, storage_path=tune_dir, verbose=0, callbacks=callbacks,
                                          stop=stopper),
            ).fit()
            if stopper.error:  # the trials in flight were stopped; the store holds every row written before
                raise store.StoreWriteError(stopper.error)

        if search is None:
            # One Tuner per chunk of the grid: Tune keeps every trial of an experiment in the driver and rescans
            # them at each step, so one Tuner over thousands of trials grows the driver and slows every trial.
            chunk = max(GRID_CHUNK_TRIALS, 8 * in_flight)  # large enough that draining between chunks is rare
            for start in range(0, len(trials), chunk):
                part = trials[start:start + chunk]
                fit(f"{sweep}-{start}", {"trial_id": tune.grid_search([t.trial_id for t in part])},
                    pickled_payloads(part))
        else:  # the searcher names each trial's trial ids and says when it is done
            job["metrics"] = search.metrics
            fit(sweep, {}, pickled_payloads(trials), search_alg=tune_searcher(search), num_samples=-1)

    write_died_rows(trials if search is None else search.dispatched, sweep, store_path, executor, listed)


def write_died_rows(trials: list[PlannedTrial], sweep: str, store_path: str, executor: str,
                    listed: set[Path]) -> None:
    """An error row for each trial that stored no row since the sweep's files were `listed`: its driver was killed
    from outside (node loss, OOM killer). A listing, not a read: a trial's row file is named by its trial id."""
    stored = {store.trial_id_of(path) for path in store.result_files(store_path, sweep) if path not in listed}
    for t in trials:
        if t.trial_id not in stored:
            store.write_row(store_path, build_row(t.payload, sweep, "error",
                                                  "trial driver died before storing a row",
                                                  executor=executor))


INTERRUPTED_MESSAGE = ("the sweep was stopped while this trial ran ({why}); nothing of it is kept, and the next run "
                       "of the sweep runs it again")
# After SIGTERM, how long Ray's and Tune's teardown may take before the sweep driver exits without it. The signal
# that ends an allocation reaches the Ray head's processes too, and Tune's cleanup then waits for good on a GCS
# that is gone (seen on SLURM: the driver hung until SLURM's SIGKILL, KillWait = 30 s by default, and wrote no
# row). The `interrupted` rows are written before the teardown starts and checked again before this exit.
STOP_GRACE_S = 15.0
EXIT_INTERRUPTED = 130  # the CLI's exit status for a sweep stopped by SIGTERM or Ctrl-C


@contextlib.contextmanager
def record_interrupted(progress: SweepProgress, trials: list[PlannedTrial], sweep: str, store_path: str,
                       executor: str, listed: set[Path]):
    """Record the trials a stop interrupts (SIGTERM: end of allocation, scancel, preemption; or Ctrl-C) as
    `interrupted`; yields the function that SIGTERM's handler calls before it raises (`terminate_on_sigterm`).

    On SIGTERM the rows are written at once, before any teardown, and the driver exits within STOP_GRACE_S even if
    Ray's teardown hangs. Once Ray is down (entered first, this exits last), the rows are checked again: a
    trial's partial measurement is never a row, and a failure row that the stop itself caused (its ranks killed
    with the job), stored after the `interrupted` one, is superseded by a new `interrupted` row."""
    stopping = threading.Event()

    def interrupted(why: str) -> None:
        running = {trial_id for trial_id, state in list(progress.states.items())
                   if state.status in ("running", "interrupted")}
        cut = write_interrupted_rows([t for t in trials if t.trial_id in running], sweep, store_path, executor,
                                     listed, why)
        progress.trials_interrupted(cut, finished_ok=running - cut)

    def on_stop(why: str, grace_s: float | None = None) -> None:
        if not stopping.is_set():  # first, so that even a row that cannot be written leaves no hang
            stopping.set()
            threading.Thread(target=_exit_unless_stopped, name="raybench-stop-grace", daemon=True,
                             args=(stopping, interrupted, why, store_path, progress,
                                   STOP_GRACE_S if grace_s is None else grace_s)).start()
        interrupted(why)

    try:
        yield on_stop
    except (Terminated, KeyboardInterrupt, SystemError) as raised:
        why = _stop_behind(raised)
        if why is None:
            raise
        interrupted(str(why) or "Ctrl-C")
        raise why from None
    finally:
        stopping.clear()  # stopped in time: the grace thread does nothing


def _exit_unless_stopped(stopping: threading.Event, interrupted: Callable[[str], None], why: str,
                         store_path: str, progress: SweepProgress, grace_s: float) -> None:
    """The grace thread of a stop: if the sweep has not finished stopping after `grace_s` (STOP_GRACE_S unless the
    stop says otherwise), record what the stop interrupted once more (late failure rows superseded) and exit."""
    time.sleep(grace_s)
    if not stopping.is_set():
        return
    code = EXIT_INTERRUPTED
    message = (f"interrupted ({why}); Ray did not shut down within {grace_s:g} s, exiting without it; "
               f"{progress.tally()}; finished trials are stored in {store_path}; run the same command again to "
               "resume")
    try:
        interrupted(why)
    except Exception as err:  # a row that cannot be written (a full store): say so, and exit all the same
        code, message = 1, f"{message}\nraybench: {type(err).__name__}: {err}"
    print(message, file=sys.stderr, flush=True)
    os._exit(code)  # the main thread is blocked inside Ray: no exception can reach it


def _stop_behind(raised: BaseException) -> Terminated | KeyboardInterrupt | None:
    """The stop an exception stands for, or None. A signal that lands while Ray waits in its own code (ray.wait
    checks signals there) comes out as a SystemError whose cause is the handler's exception."""
    if isinstance(raised, SystemError):
        raised = raised.__cause__
    return raised if isinstance(raised, (Terminated, KeyboardInterrupt)) else None


def write_interrupted_rows(trials: list[PlannedTrial], sweep: str, store_path: str, executor: str,
                           listed: set[Path], why: str) -> set[str]:
    """An `interrupted` row for each of `trials` whose attempts since the sweep's files were `listed` hold no ok row
    and do not end with an `interrupted` one (called at the stop, then again once Ray is down); returns the ids of
    the trials the stop cut. A trial that stored ok since (its driver finished just as the stop came, after the
    first call looked) was not cut: the `interrupted` row this run stored for it, which says nothing of it is
    kept, is removed."""
    cut = set()
    for t in trials:
        new = [path for path in store.trial_row_files(store_path, sweep, t.trial_id) if path not in listed]
        attempts = sorted(((store.row_status(path), path) for path in new),
                          key=lambda attempt: attempt[0]["ended_at"])
        statuses = [row["status"] for row, _ in attempts]
        if "ok" in statuses:
            for path in (path for row, path in attempts if row["status"] == "interrupted"):
                path.unlink(missing_ok=True)
            continue
        cut.add(t.trial_id)
        if statuses[-1:] != ["interrupted"]:
            stop = build_row(t.payload, sweep, "interrupted", INTERRUPTED_MESSAGE.format(why=why), executor=executor)
            store.write_row(store_path, stop)
            _drop_failures_built_after(store_path, sweep, t.trial_id, listed, stop["ended_at"])
    return cut


def _drop_failures_built_after(store_path: str, sweep: str, trial_id: str, listed: set[Path], stop_at) -> None:
    """Remove a failure row the trial built after the stop's row and stored while that one was written (a write
    takes its time: an fsync): the stop caused it, and the trial drops its own only once it sees the stop's row
    (trial.run_trial), which it can miss. Each side looks again after its own write, so one of them sees the other."""
    for path in store.trial_row_files(store_path, sweep, trial_id):
        if path in listed:
            continue
        row = store.row_status(path)
        if row["status"] not in ("ok", "interrupted") and row["ended_at"] > stop_at:
            path.unlink(missing_ok=True)


def write_unrun(trials: list[PlannedTrial], sweep: str, store_path: str) -> None:
    """Rows for planned points that are not run (invalid combinations kept with --keep-invalid)."""
    for t in trials:
        store.write_row(store_path, build_row(t.payload, sweep, t.status, "; ".join(t.reasons)))


def store_error_stopper():
    """A Ray Tune stopper that ends the whole experiment once a trial driver could not write its row (a full disk,
    a lost mount): every later row would be lost the same way. Its `error` is the first such message."""
    from ray import tune

    class StoreErrorStopper(tune.Stopper):
        def __init__(self):
            self.error: str | None = None

        def __call__(self, trial_id: str, result: dict) -> bool:
            if result.get("store_error") and self.error is None:
                self.error = result["store_error"]
            return bool(result.get("store_error"))

        def stop_all(self) -> bool:
            return self.error is not None

    return StoreErrorStopper()


def tune_searcher(search: PlannedSearch):
    """Ray Tune's view of a PlannedSearch (which speaks Tune's searcher protocol but does not import Ray)."""
    from ray.tune.search import Searcher

    class TuneSearcher(Searcher):
        def __init__(self, inner: PlannedSearch):
            super().__init__()
            self.inner = inner

        def suggest(self, trial_id: str):
            return self.inner.suggest(trial_id)

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            self.inner.on_trial_complete(trial_id, result, error)

        def save(self, checkpoint_path: str) -> None:
            """Nothing to save: the result store is a search's checkpoint (a re-run replays from it)."""

        def restore(self, checkpoint_path: str) -> None:
            """See save()."""

    return TuneSearcher(search)


@dataclass
class SearchResult:
    ran: list[PlannedTrial]  # trials this run started
    searcher: PlannedSearch = field(repr=False)


def run_search(spec: SweepSpec, trials: list[PlannedTrial], attempts: pa.Table, *, store_path: str,
               address: str | None = None, rerun: bool = False, progress: Callable[[str], None] = print,
               verbose: bool = False) -> SearchResult:
    """Search the sweep's grid with spec.search; rows land in the store like a grid sweep's. `trials` is
    plan(spec, keep_invalid=True): invalid points included; `attempts` every stored attempt, already read."""
    objectives = spec.search.objectives()
    stored = {} if rerun else stored_rows(attempts, spec.name, [m for m, _ in objectives], spec.runs_with)
    space = SearchSpace(spec, trials)
    searcher = PlannedSearch(
        space, objectives, make_sampler(spec.search.algo, spec.search.seed, len(space.points)),
        num_samples=spec.search.num_samples, early_stop=spec.search.early_stop, stored=stored,
        record_unrun=lambda unrun: write_unrun(unrun, spec.name, store_path), log=progress)
    runnable = [t for t in trials if t.status == "planned"]
    if all(stored.get(t.trial_id, {}).get("status") in ANSWERED for t in runnable):
        # Everything the searcher could ask for is stored: replay it here, without starting Ray.
        if searcher.suggest("stored") != FINISHED:
            raise AssertionError("a search whose every runnable trial is stored proposed a trial to run")
    else:
        run_planned(runnable, spec.name, store_path, spec.runs_with, address=address, progress=progress,
                    verbose=verbose, search=searcher, max_in_flight=spec.search.max_concurrent)
    progress(searcher.summary())
    return SearchResult(searcher.dispatched, searcher)


def trial_ids(config: dict) -> list[str]:
    """The raybench trial ids a Tune trial runs: a grid point's one, or a searched point's repeats."""
    return config.get("trial_ids") or [config["trial_id"]]


def tune_callback(progress: SweepProgress, axis_values: dict[str, dict]):
    """The Ray Tune callback that feeds `progress`. A Tune trial runs one payload (a grid point), or one payload
    per repeat of a searched point, one after the other, reporting a result after each. `axis_values`: trial id ->
    its axis values, for the view."""
    from ray import tune

    class Progress(tune.Callback):
        def __init__(self, progress: SweepProgress, axis_values: dict[str, dict]):
            self.progress = progress
            self.axis_values = axis_values
            self.results: dict[str, int] = {}  # results seen per Tune trial: the k-th is its k-th payload's

        def __getstate__(self) -> dict:
            # Tune pickles its callbacks into the experiment state; the view (a lock, a thread, the terminal)
            # belongs to this process only.
            return {"progress": None, "axis_values": {}, "results": {}}

        def on_trial_start(self, iteration, trials, trial, **info):
            first = trial_ids(trial.config)[0]
            self.progress.trial_started(first, self.axis_values[first])

        def on_trial_result(self, iteration, trials, trial, result, **info):
            # (result["trial_id"] is Tune's own trial id, not raybench's)
            k = self.results[trial.trial_id] = self.results.get(trial.trial_id, -1) + 1
            ids = trial_ids(trial.config)
            self.progress.trial_finished(ids[k], result)
            if k + 1 < len(ids):
                self.progress.trial_started(ids[k + 1], self.axis_values[ids[k + 1]])

        def on_trial_error(self, iteration, trials, trial, **info):
            for trial_id in trial_ids(trial.config):
                state = self.progress.states.get(trial_id)
                if state is not None and state.status == "running":
                    self.progress.trial_failed(trial_id, "trial driver died before reporting")

    return Progress(progress, axis_values)
