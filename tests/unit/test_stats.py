"""Repeat statistics (mean and 95% CI, checked against hand computation) and Pareto fronts."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from raybench.spec.stats import dominates, format_ci, mean_ci95, pareto_mask, repeat_summary, t95


def test_t_quantiles_from_the_table_and_beyond():
    assert t95(1) == 12.706 and t95(2) == 4.303 and t95(30) == 2.042
    assert t95(35) == 2.042  # between entries: the smaller df's (wider, conservative) quantile
    assert t95(500) == 1.960
    with pytest.raises(ValueError):
        t95(0)


def test_mean_ci95_by_hand():
    # mean 12, sample sd sqrt(((-2)^2 + 0 + 2^2) / 2) = 2, half-width t(0.975, 2) * 2 / sqrt(3).
    mean, n, half = mean_ci95([10.0, 12.0, 14.0])
    assert (mean, n) == (12.0, 3)
    assert half == pytest.approx(4.303 * 2 / math.sqrt(3))
    assert half == pytest.approx(4.9687, abs=1e-4)
    assert mean_ci95([5.0]) == (5.0, 1, None)
    assert mean_ci95([3.0, 3.0]) == (3.0, 2, 0.0)
    assert format_ci(12.0, 3, half, ".1f") == "12.0 ± 5.0 (n=3)"
    assert format_ci(1234.0, 1, None) == "1,234 (1 run)"


def test_repeat_summary_groups_ok_rows_per_config():
    rows = pd.DataFrame([
        {"config_id": "a", "repeat": 0, "status": "ok", "tok": 100.0, "note": "first"},
        {"config_id": "a", "repeat": 1, "status": "ok", "tok": 110.0, "note": "second"},
        {"config_id": "a", "repeat": 2, "status": "oom", "tok": None, "note": "failed"},
        {"config_id": "b", "repeat": 0, "status": "ok", "tok": 50.0, "note": "only"},
    ])
    summary = repeat_summary(rows, "tok").set_index("config_id")
    assert summary.loc["a", "tok_mean"] == 105.0 and summary.loc["a", "tok_n"] == 2
    # sd of (100, 110) = 7.071; t(0.975, 1) = 12.706; half = 12.706 * 7.071 / sqrt(2) = 63.53
    assert summary.loc["a", "tok_ci95"] == pytest.approx(63.53, abs=0.01)
    assert summary.loc["a", "note"] == "first"  # other columns come from the first repeat
    assert summary.loc["b", "tok_n"] == 1 and pd.isna(summary.loc["b", "tok_ci95"])


def test_pareto_front_max_throughput_min_memory():
    # (tok/s, GiB): c is dominated by a (slower and bigger); d ties b exactly and stays.
    points = [(100.0, 10.0), (80.0, 5.0), (90.0, 12.0), (80.0, 5.0), (120.0, 20.0)]
    assert pareto_mask(points, ["max", "min"]) == [True, True, False, True, True]
    assert dominates((100.0, 10.0), (90.0, 12.0), ["max", "min"])
    assert not dominates((80.0, 5.0), (80.0, 5.0), ["max", "min"])
    assert pareto_mask([(3.0,), (1.0,), (2.0,)], ["min"]) == [False, True, False]
