"""The small public API; the CLI is a thin layer over these functions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from raybench.drivers import sweep
from raybench.planning import calibration, tokenized
from raybench.planning.plan import PlannedTrial, plan
from raybench.results import compaction, store
from raybench.runtime import cuda_snapshot, packing
from raybench.spec import stacks, tokenized_data
from raybench.spec.errors import ConfigError, Problem
from raybench.spec.load import load_sweep
from raybench.spec.sweep_spec import SweepSpec
from raybench.spec.tokenized_data import TokenizedData

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
    trials = tokenize_once(trials, store_path, progress, source)  # before the first trial, and before any row
    if searching:
        ran = sweep.run_search(spec, trials, attempts, store_path=store_path, address=address, rerun=rerun,
                               progress=progress, verbose=verbose).ran
    else:
        stored = {} if rerun else store.statuses_by_trial(attempts, spec.name, spec.runs_with)
        ran = _run_grid(spec, trials, stored, store_path, address, progress, verbose)
    results = store.read_table_since(attempts, listed, store_path, spec.name)  # before compaction merges new files
    compact_if_many_files(store_path, spec.name, progress)
    return SweepRun(ran, results)


def tokenize_once(trials: list[PlannedTrial], store_path: str, progress=print,
                  source: str = "<sweep>") -> list[PlannedTrial]:
    """The trials, each runnable hf or json trial's payload carrying its tokenized data: every distinct data spec
    (json: every layout) is tokenized once into the store's cache (or found there from an earlier sweep), before
    any trial starts, and every trial and rank reads it from there. A build that fails is bad input: nothing has
    been launched or written."""
    cache_root = Path(store_path).resolve() / "_cache" / "data"
    prepared: dict[str, tuple] = {}  # data spec and tokenizer -> (TokenizedData, tokens per sample)
    laid_out: dict[tuple, TokenizedData] = {}  # and the trial's layout -> its TokenizedData
    out = []
    for t in trials:
        data = t.config.data
        # The hf and lightning stacks take the same tokens as raybench's loop through their context; the other
        # stacks read their own data, which raybench's tokenization would not describe (the registry's
        # tokenized_data).
        if (data.source not in ("hf", "json") or t.status != "planned"
                or not stacks.kind(t.config.stack.kind).tokenized_data):
            out.append(t)
            continue
        if data.source == "json":
            out.append(_with_json_data(t, laid_out, cache_root.parent, progress, source))
            continue
        key, tokenizer = tokenized.spec_key(data, t.config.model.path)
        if key not in prepared:
            try:
                ref = tokenized.prepare(data, tokenizer, cache_root)
            except Exception as err:  # a record past the first that cannot be rendered, an unreadable file
                raise ConfigError(source, [Problem("data.path", data.path, f"cannot be tokenized: "
                                                   f"{type(err).__name__}: {err}")]) from None
            took = f" in {ref.build_s:.1f} s" if ref.build_s is not None else ""
            progress(f"data {ref.name}: {ref.samples} samples, cache {ref.cache}{took} ({ref.key})")
            cached = tokenized_data.load(ref.path)
            masks = cached.data.column("assistant_masks") if "assistant_masks" in cached.column_names else None
            prepared[key] = ref, tokenized_data.lengths(cached), masks
        # A sweep's trials share a few layouts: each one's rows are laid out once (best fit over 10^6 samples: ~1 s).
        layout = (key, t.config.train.seq_len, data.packing, data.overflow, data.pack_order)
        if layout not in laid_out:
            ref, counts, masks = prepared[key]
            laid_out[layout] = packing.for_trial(ref, t.config.train.seq_len, data, counts, masks)
            _say_cut(laid_out[layout], t.config.train.seq_len, f"{data.overflow}; data.overflow split or drop, or a "
                     "longer train.seq_len, keeps more", progress)
        out.append(dataclasses.replace(t, payload=t.payload.replace(tokenized=laid_out[layout])))
    return out


def _with_json_data(t: PlannedTrial, laid_out: dict[tuple, TokenizedData], cache_dir: Path, progress,
                    source: str) -> PlannedTrial:
    """A json trial, its payload carrying its data's rows in the store's cache and what its overflow cuts (the
    ranks tokenize nothing). Each layout is prepared once per sweep; a failure is bad input, as for hf data."""
    from raybench.runtime import data as json_data  # torch: only a sweep of JSON data loads it here

    data, seq_len = t.config.data, t.config.train.seq_len
    layout = ("json", data.path, data.tokenizer or t.config.model.path, seq_len, data.packing, data.overflow)
    if layout not in laid_out:
        try:
            ref = json_data.prepare_json(data, t.config.model.path, seq_len, cache_dir, tokenized.data_hash(data.path))
        except Exception as err:  # a record that cannot be rendered, too little data for one row
            raise ConfigError(source, [Problem("data.path", data.path, f"cannot be tokenized: "
                                               f"{type(err).__name__}: {err}")]) from None
        laid_out[layout] = ref
        took = f" in {ref.build_s:.1f} s" if ref.build_s is not None else ""
        progress(f"data {ref.name} at seq_len {seq_len}: {ref.samples} samples, cache {ref.cache}{took} ({ref.key})")
        _say_cut(ref, seq_len, f"{data.overflow}; data.packing true with overflow truncate, where samples run on "
                 "across rows, or a longer train.seq_len keeps them", progress)
    return dataclasses.replace(t, payload=t.payload.replace(tokenized=laid_out[layout]))


def _say_cut(ref: TokenizedData, seq_len: int, fix: str, progress) -> None:
    note = ref.cut_note()
    if note:  # never silent: the trial trains on less than the data holds
        progress(f"data {ref.name} at seq_len {seq_len}: {note} ({fix})")


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
