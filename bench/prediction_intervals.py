"""The relative error bands of raybench/planning/uncertainty.py, from the held-out GPU rows.

    .venv/bin/python bench/rehearse_validate.py > validate.out
    .venv/bin/python bench/prediction_intervals.py validate.out

Traced band: the 90th percentile (numpy's default, linear interpolation) of |predicted / measured - 1| over the
held-out rows the rehearsal traced, read from the per-row tables bench/rehearse_validate.py prints (step time,
tensor peak, reserved peak). Analytic band: the same percentile for the analytic estimate (what an untraced trial
is predicted by), each held-out row's configuration estimated as it was measured, its step-time guess against the
measured step time and its measured part (the peak less the CUDA context) against the tensor and reserved peaks.
Prints each basis and quantity with its row count, median, 90th percentile and maximum, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rehearse_validate  # bench/rehearse_validate.py
import validation_split  # bench/validation_split.py

QUANTILE = 0.9
# Columns of a per-row table of rehearse_validate.py (its `_markdown`): set, config, method, ..., error columns.
ERROR_COLUMNS = {"step_time": 11, "tensor_peak": 5, "reserved_peak": 8}


def traced_errors(validate_output: Path) -> dict[str, list[float]]:
    """|error| per quantity of the held-out traced rows in rehearse_validate.py's printed tables."""
    errors = {name: [] for name in ERROR_COLUMNS}
    for line in validate_output.read_text().splitlines():
        if not line.startswith(f"| {validation_split.HELDOUT}"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[2] != "traced":
            continue
        for name, column in ERROR_COLUMNS.items():
            if re.fullmatch(r"[+-]\d+\.\d%", cells[column]):
                errors[name].append(abs(float(cells[column].rstrip("%")) / 100))
    return errors


def analytic_errors() -> dict[str, list[float]]:
    """|error| per quantity of the analytic estimate on every held-out row (nothing traced: seconds)."""
    from raybench.planning.estimate import estimate
    from raybench.planning.plan import plan
    from raybench.results.store import measured_trial_config

    split = validation_split.load()
    errors = {name: [] for name in ERROR_COLUMNS}
    for rel in validation_split.committed_parquets():
        entry = split.entry(rel)
        measured = rehearse_validate.measured_rows(rehearse_validate.REPO / rel)
        stored_ids = rehearse_validate.stored_ids_by_planned_id(measured)
        for trial in plan(rehearse_validate.sweep_for_gpu(entry.sweep, entry.gpu)):
            stored_id = stored_ids.get(trial.trial_id)
            if stored_id is None or entry.constants_fitted_on(stored_id):
                continue
            row = measured.loc[stored_id]
            est = estimate(measured_trial_config(row.config_json), trial.shape, list(trial.ac_blocks), entry.gpu)
            errors["step_time"].append(abs(est.step_time_s / row.step_time_p50_s - 1))
            errors["tensor_peak"].append(abs(est.measured_part_gib / row.peak_alloc_gib - 1))
            errors["reserved_peak"].append(abs(est.measured_part_gib / row.peak_reserved_gib - 1))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description="Prediction interval bands from the held-out GPU rows.")
    parser.add_argument("validate_output", type=Path, help="the saved output of bench/rehearse_validate.py")
    args = parser.parse_args()
    bands = {}
    print("| basis | quantity | rows | median \\|err\\| | p90 \\|err\\| | max \\|err\\| |")
    print("|---|---|---:|---:|---:|---:|")
    for basis, errors in (("traced", traced_errors(args.validate_output)), ("analytic", analytic_errors())):
        bands[basis] = {}
        for name, values in errors.items():
            v = np.array(values)
            bands[basis][name] = round(float(np.quantile(v, QUANTILE)), 3)
            print(f"| {basis} | {name} | {len(v)} | {np.median(v):.1%} | {bands[basis][name]:.1%} | {v.max():.1%} |")
    print(json.dumps({"bench": "prediction_intervals", "quantile": QUANTILE, "bands": bands}))


if __name__ == "__main__":
    main()
