"""The small public API; the CLI is a thin layer over these functions."""

from __future__ import annotations

from pathlib import Path

from raybench import store
from raybench.config import SweepSpec, load_sweep
from raybench.plan import PlannedTrial, plan


def run_sweep(spec: SweepSpec, *, address: str | None = None, store_path: str | None = None,
              keep_invalid: bool = False, rerun: bool = False, progress=print, verbose: bool = False,
              source: str = "<sweep>") -> list[PlannedTrial]:
    """Plan and run a sweep; returns the trials that were run (stored ok trials are skipped unless rerun).

    Raises ConfigError before anything starts if the sweep cannot be planned.
    """
    from raybench.sweep import run_planned, write_unrun

    trials = plan(spec, keep_invalid=keep_invalid, source=source)
    store_path = str(Path(store_path or spec.store))
    done = set() if rerun else store.ok_trial_ids(store_path, spec.name)
    unrun = [t for t in trials if t.status != "planned"]
    todo = [t for t in trials if t.status == "planned" and t.trial_id not in done]
    skipped = len(trials) - len(unrun) - len(todo)
    if skipped:
        progress(f"{skipped} trial(s) already stored as ok in {store_path}; skipping them (--rerun to repeat)")
    write_unrun(unrun, spec.name, store_path)
    if todo:
        run_planned(todo, spec.name, store_path, spec.executor, address=address, progress=progress, verbose=verbose)
    return todo


def read_results(store_path: str = store.DEFAULT_STORE, sweep: str | None = None, latest: bool = True):
    """Stored result rows as a pandas DataFrame."""
    return store.read_results(store_path, sweep, latest)


__all__ = ["load_sweep", "plan", "run_sweep", "read_results"]
