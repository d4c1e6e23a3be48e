"""The small public API; the CLI is a thin layer over these functions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from raybench.data.prepare import with_prepared_data
from raybench.drivers import sweep
from raybench.planning import calibration
from raybench.planning.plan import PlannedTrial, plan
from raybench.results import compaction, store
from raybench.runtime import cuda_snapshot
from raybench.spec.load import load_sweep
from raybench.spec.sweep_spec import SweepSpec

# A sweep partition holding more result files than this is compacted at the end of a run: one file per trial
# attempt keeps writers independent, but readers pay per file (docs/results/store-scale-2026-11-22.md).
AUTO_COMPACT_FILES = 100


@dataclass(frozen=True)
class SweepRun:
    """What run_sweep did."""

    ran: list[PlannedTrial]  # the trials it started (stored ok trials are skipped unless rerun)
    # The sweep's rows after the run, the latest attempt per trial: what read_results(store, sweep) reads then.
    results: pa.Table


def run_sweep(spec: SweepSpec, *, address: str | None = None, store_path: str | None = None,
              keep_invalid: bool = False, rerun: bool = False, progress=print, verbose: bool = False,
              source: str = "<sweep>") -> SweepRun:
    """Plan and run a sweep, or search it (spec.search); returns the trials that were run (stored ok trials are
    skipped unless rerun; a search answers them from the store) and the sweep's rows after the run. A search keeps
    invalid points as rows.

    Raises ConfigError before anything starts if the sweep cannot be planned.
    """
    store_path = str(Path(store_path or spec.store))
    searching = spec.search.algo != "grid"
    # Every stored attempt, read once: it calibrates the plan and says which trials a grid need not run again.
    # The rows this run adds are then the files added to the listing made just before.
    listed = set(store.result_files(store_path, spec.name))
    attempts = store.read_table(store_path, latest=False)
    trials = plan(spec, keep_invalid=keep_invalid or searching, source=source,
                  evidence=calibration.evidence(store_path, attempts))
    cuda_snapshot.check(trials, source)  # a CUDA snapshot request refuses CPU trials before anything starts
    # The sweep's data tokenized and laid out once, before the first trial and before any row.
    trials = with_prepared_data(trials, store_path, progress, source)
    if searching:
        ran = sweep.run_search(spec, trials, attempts, store_path=store_path, address=address, rerun=rerun,
                               progress=progress, verbose=verbose).ran
    else:
        stored = {} if rerun else store.statuses_by_trial(attempts, spec.name, spec.runs_with)
        ran = _run_grid(spec, trials, stored, store_path, address, progress, verbose)
    results = store.read_table_since(attempts, listed, store_path, spec.name)  # before compaction merges new files
    compact_if_many_files(store_path, spec.name, progress)
    return SweepRun(ran, results)


def compact_if_many_files(store_path: str, sweep_name: str, progress=print) -> None:
    if len(store.result_files(store_path, sweep_name)) > AUTO_COMPACT_FILES:
        done = compaction.compact_sweep(store_path, sweep_name)
        progress(f"compacted {done.files_before} result files of sweep {sweep_name} into {done.files_after}")


def _run_grid(spec: SweepSpec, trials: list[PlannedTrial], stored: dict[str, set[str]], store_path: str,
              address: str | None, progress, verbose: bool) -> list[PlannedTrial]:
    """Run the planned trials not stored as ok; `stored` is trial id -> the statuses of its stored attempts
    (a trial counts as stored only when the executor the sweep asks for measured it: docs/executors.md)."""
    done = {trial_id for trial_id, statuses in stored.items() if "ok" in statuses}
    unrun = [t for t in trials if t.status != "planned"]
    todo = [t for t in trials if t.status == "planned" and t.trial_id not in done]
    skipped = len(trials) - len(unrun) - len(todo)
    if skipped:
        progress(f"{skipped} trial(s) already stored as ok in {store_path}; skipping them (--rerun to repeat)")
    # An invalid point's row says the same on every run: write it once. A trial now estimated not to fit keeps
    # the row it has: a measured row outranks the estimate.
    unrun = [t for t in unrun if not ("invalid" in stored.get(t.trial_id, ())
                                      or (t.status == "skipped" and t.trial_id in stored))]
    sweep.write_unrun(unrun, spec.name, store_path)
    if todo:
        sweep.run_planned(todo, spec.name, store_path, spec.runs_with, address=address, progress=progress,
                          verbose=verbose)
    return todo


def read_results(store_path: str = store.DEFAULT_STORE, sweep: str | None = None, latest: bool = True):
    """Stored result rows as a pandas DataFrame."""
    return store.read_results(store_path, sweep, latest)


__all__ = ["load_sweep", "plan", "run_sweep", "read_results"]
