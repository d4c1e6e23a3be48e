"""The bands of planning/uncertainty.py: widened with model size and world size, derived and checked as
bench/prediction_intervals.py does, and what `raybench best --predict` draws its intervals with. Arithmetic and
planning only: nothing is traced."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from raybench.planning import uncertainty
from raybench.planning.plan import plan
from raybench.rehearse.choice import predicted_best
from raybench.results import rehearsals
from raybench.spec.load import load_sweep, parse_sweep

REPO = Path(__file__).resolve().parents[2]
ROWS = uncertainty.ROWS_PARAMS


def test_reach_is_zero_as_the_rows_were_and_counts_decades_of_model_and_world_up_to_one():
    assert uncertainty.reach(ROWS, 1) == 0.0
    assert uncertainty.reach(ROWS // 10, 1) == 0.0  # a smaller model is not further from the rows
    assert uncertainty.reach(ROWS, 2) == pytest.approx(np.log10(2))
    assert uncertainty.reach(ROWS * 2, 2) == pytest.approx(2 * np.log10(2))
    assert uncertainty.reach(ROWS * 3, 1) < uncertainty.reach(ROWS * 3, 2)
    assert uncertainty.reach(72 * 10**9, 64) == uncertainty.reach(ROWS * 10, 1) == 1.0


def test_a_band_at_scale_is_the_rows_band_plus_the_term_and_never_the_1b_tensor_band():
    traced = uncertainty.BANDS["traced"]
    assert uncertainty.band("traced", ROWS, 1) == traced.rows
    assert uncertainty.band("rehearsed", ROWS, 1) == traced.rows  # an assessment's name for a traced basis
    assert uncertainty.band("analytic", ROWS, 1) == uncertainty.BANDS["analytic"].rows
    at_72b = uncertainty.band("traced", 72 * 10**9, 64)
    assert at_72b.tensor_peak == pytest.approx(traced.rows.tensor_peak + traced.at_scale.tensor_peak)
    assert at_72b.tensor_peak > traced.rows.tensor_peak  # never the 1B rows' band alone
    halfway = uncertainty.band("traced", ROWS, 3)
    assert traced.rows.step_time < halfway.step_time < at_72b.step_time
    assert halfway.step_time == pytest.approx(traced.rows.step_time + np.log10(3) * traced.at_scale.step_time)


def test_a_measured_value_is_in_the_interval_exactly_when_the_error_is_within_the_band():
    predicted, width = 10.0, 0.2
    low, high = uncertainty.interval(predicted, width)
    for measured in (8.0, 8.4, 10.0, 12.4, 12.6, 13.0):
        error = abs(predicted / measured - 1)
        assert (low <= measured <= high) == (error <= width + 1e-12)
    assert uncertainty.coverage([0.1, 0.2, 0.3, 0.05], [0.2, 0.2, 0.2, 0.0]) == 0.5  # the band's own edge is in


def test_the_quantile_is_numpys_default():
    values = [0.3, 0.01, 0.09, 0.4, 0.05, 0.2, 0.12]
    assert uncertainty.quantile(values) == pytest.approx(float(np.quantile(values, 0.9)))
    assert uncertainty.quantile([0.07]) == 0.07


def test_the_term_is_what_nine_in_ten_points_beyond_the_rows_need_per_unit_of_reach():
    # Covered already: no term. Points at reach 0 (as the rows were) say nothing about scale.
    assert uncertainty.at_scale_extra([0.05, 0.08], [1.0, 0.5], rows_band=0.1) == 0.0
    assert uncertainty.at_scale_extra([0.9], [0.0], rows_band=0.1) == 0.0
    errors, reaches = [0.3, 0.1, 0.2, 0.15, 0.5], [1.0, 1.0, 0.5, 1.0, 1.0]
    extra = uncertainty.at_scale_extra(errors, reaches, rows_band=0.1)
    needed = [0.2, 0.0, 0.2, 0.05, 0.4]  # (|err| - band) / reach
    assert extra == pytest.approx(float(np.quantile(needed, 0.9)))
    widths = [0.1 + extra * r for r in reaches]
    assert uncertainty.coverage(errors, widths) == 0.8  # the largest need is left out, as a p90 leaves it


def _sweep(tmp_path, preset: str, workers: int) -> dict:
    return {"name": "scale", "model": {"preset": preset},
            "train": {"steps": 20, "warmup_steps": 2, "seq_len": 64, "micro_batch": 2, "strategy": "fsdp2"},
            "resources": {"workers": workers, "gpus_per_worker": 1},
            "estimate": {"gpu": "H100 SXM", "device_memory_gib": 80, "margin_gib": 0, "prune": False},
            "store": str(tmp_path / "store"), "axes": {"train.ac_ratio": ["0", "1"]}}


def test_the_plans_intervals_widen_with_the_trials_model_and_world_size(tmp_path):
    small = plan(parse_sweep(_sweep(tmp_path, "tiny", 1)))[0].assessment
    large = plan(parse_sweep(_sweep(tmp_path, "llama-3-70b", 64)))[0].assessment
    assert small.band == uncertainty.band("analytic", small.analytic.params_total, 1)
    assert large.world_size == 64 and large.band == uncertainty.band("analytic", large.analytic.params_total, 64)

    def relative_width(iv):
        return iv[1] / iv[0]
    assert relative_width(large.step_time_interval_s) > relative_width(small.step_time_interval_s)
    assert large.as_dict()["world_size"] == 64


def test_best_predict_draws_its_intervals_with_the_bands_of_the_groups_scale(tmp_path):
    spec_path = tmp_path / "sweep.yaml"
    spec_path.write_text(json.dumps(_sweep(tmp_path, "tiny", 8)))
    spec = load_sweep(spec_path)
    for t, step_s in zip(plan(spec), (0.10, 0.20)):
        rehearsals.save_rehearsal(tmp_path / "store", t.config_id, {
            "method": "traced", "world_size": 8, "peak_gib": 10.0, "reserved_gib": 11.6, "step_time_s": step_s,
            "compute_s": step_s})
    (result,) = predicted_best(plan(spec, store_path=spec.store))
    best = result["best"]
    params = plan(spec)[0].assessment.analytic.params_total
    widened = uncertainty.band("traced", params, 8)
    assert widened.step_time > uncertainty.BANDS["traced"].rows.step_time
    assert best["band"]["step_time"] == pytest.approx(widened.step_time)
    tokens = 2 * 64
    assert best["tok_interval"] == pytest.approx((tokens / (0.10 / (1 - widened.step_time)),
                                                  tokens / (0.10 / (1 + widened.step_time))))


def test_the_shipped_bands_are_the_recorded_derivation():
    """BANDS holds the figures docs/results/prediction-bands-2026-12-07-xtuner.md records (its JSON line)."""
    record = (REPO / "docs" / "results" / "prediction-bands-2026-12-07-xtuner.md").read_text()
    line = next(x for x in record.splitlines() if x.startswith('{"bench": "prediction_intervals"'))
    recorded = json.loads(line)["bands"]
    for basis, bands in uncertainty.BANDS.items():
        for part in ("rows", "at_scale"):
            for quantity, value in recorded[basis][part].items():
                assert getattr(getattr(bands, part), quantity) == pytest.approx(value), (basis, part, quantity)
    assert re.search(r"^PYTHONPATH=\$PWD .*bench/prediction_intervals.py", record, re.M)
