"""bench/validation_split.yaml: which committed GPU rows fitted the rehearsal's constants. Every file it names is
committed, every committed GPU Parquet file is covered by its rule (listed, or held out whole with a sweep and a
GPU the bench can rehearse), and no row is both fitting and held out. Reads Parquet files only; rehearses nothing."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from raybench.rehearse import fitted
from raybench.spec import hardware
from tests import bench_script

REPO = Path(__file__).resolve().parents[2]
vs = bench_script.load(bench_script.BENCH / "validation_split.py")


def test_the_split_names_only_committed_files_and_their_rows():
    split, committed = vs.load(), set(vs.committed_parquets())
    assert committed, "no committed GPU Parquet files found"
    assert set(split.files) <= committed, sorted(set(split.files) - committed)
    for rel, entry in split.files.items():
        ids = set(pd.read_parquet(REPO / rel, columns=["trial_id"]).trial_id)
        named = entry.fitting_ids() | set(entry.not_blind)
        assert named <= ids, (rel, sorted(named - ids))
        assert all(ids_ for ids_ in entry.fitting.values()), (rel, "a constant with no rows")


def test_the_constants_named_are_the_fitted_ones():
    split = vs.load()
    names = {name for entry in split.files.values() for name in entry.fitting}
    assert names <= set(split.constants), sorted(names - set(split.constants))
    for name, spec in split.constants.items():
        assert getattr(fitted, name) == spec["value"], name
    # Each constant is fitted on some committed rows.
    assert names == set(split.constants)


def test_every_committed_gpu_parquet_is_covered_by_the_rule():
    split = vs.load()
    for rel in vs.committed_parquets():
        entry = split.entry(rel)
        rows = pd.read_parquet(REPO / rel, columns=["sweep", "trial_id"])
        assert entry.sweep and (REPO / "bench" / "sweeps" / f"{entry.sweep}.yaml").exists(), (rel, entry.sweep)
        assert set(rows.sweep) == {entry.sweep}, (rel, set(rows.sweep))
        assert hardware.find_gpu(entry.gpu) is not None, (rel, entry.gpu)
        for trial_id in rows.trial_id:
            assert entry.set_of(trial_id) in (vs.FITTING, vs.HELDOUT)


def test_no_row_is_in_both_sets_and_new_rows_are_held_out():
    split = vs.load()
    fitting, heldout = set(), set()
    for rel in vs.committed_parquets():
        entry = split.entry(rel)
        for trial_id in pd.read_parquet(REPO / rel, columns=["trial_id"]).trial_id:
            (fitting if entry.set_of(trial_id) == vs.FITTING else heldout).add((rel, trial_id))
    assert fitting and heldout and not fitting & heldout
    # Held-out rows named as not blind are held out, not fitted.
    for rel, entry in split.files.items():
        assert not set(entry.not_blind) & entry.fitting_ids(), rel
    # A row the split does not list, in a listed file or in a file it does not name, is held out.
    assert split.entry(next(iter(split.files))).set_of("0000000000000000-r0") == vs.HELDOUT
    unlisted = vs.FileEntry(path="docs/results/gpu-new/x.parquet", sweep="x", gpu="H100", listed=False)
    assert unlisted.set_of("0000000000000000-r0") == vs.HELDOUT
