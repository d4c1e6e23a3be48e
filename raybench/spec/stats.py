"""Small statistics over result rows: mean and 95% confidence interval of repeats, Pareto fronts.

Pure Python and pandas (no scipy): Student's t quantiles come from a table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Two-sided 95% Student t quantiles t(0.975, df). Between table entries the next smaller df is used (a slightly
# wider, conservative interval); beyond 120 degrees of freedom the normal quantile.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
_Z95 = 1.960


def t95(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df > 120:
        return _Z95
    return _T95[max(k for k in _T95 if k <= df)]


def mean_ci95(values: Sequence[float]) -> tuple[float, int, float | None]:
    """(mean, n, half-width of the 95% confidence interval of the mean); the half-width is None for n < 2."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n < 2:
        return mean, n, None
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))  # sample standard deviation
    return mean, n, t95(n - 1) * std / math.sqrt(n)


def format_ci(mean: float, n: int, half: float | None, spec: str = ",.0f") -> str:
    """'1,234 ± 56 (n=3)', or '1,234 (1 run)' when there is no interval."""
    if half is None:
        return f"{format(mean, spec)} ({n} run{'s' if n != 1 else ''})"
    return f"{format(mean, spec)} ± {format(half, spec)} (n={n})"


def repeat_summary(rows, metric: str):
    """One line per configuration (config_id) of the ok rows: mean, n and 95% CI of `metric` over its repeats.

    `rows` is a DataFrame of stored rows (read_results). The result keeps the first row's other columns (axis
    values, model, device ...) and adds `{metric}_mean`, `{metric}_n`, `{metric}_ci95`; sorted by config_id.
    """
    import pandas as pd

    ok = rows[(rows.status == "ok") & rows[metric].notna()]
    if len(ok) == 0:
        return ok.assign(**{f"{metric}_mean": [], f"{metric}_n": [], f"{metric}_ci95": []})
    lines = []
    for _, group in ok.sort_values(["config_id", "repeat"]).groupby("config_id", sort=True):
        mean, n, half = mean_ci95(group[metric].tolist())
        lines.append({**group.iloc[0].to_dict(), f"{metric}_mean": mean, f"{metric}_n": n, f"{metric}_ci95": half})
    return pd.DataFrame(lines)


def dominates(a: Sequence[float], b: Sequence[float], modes: Sequence[str]) -> bool:
    """a is at least as good as b in every objective and better in one (mode 'max' or 'min' per objective)."""
    better = False
    for x, y, mode in zip(a, b, modes):
        if (x < y) if mode == "max" else (x > y):
            return False
        better = better or x != y
    return better


def pareto_mask(points: Sequence[Sequence[float]], modes: Sequence[str]) -> list[bool]:
    """True for each point no other point dominates (equal points are all kept)."""
    return [not any(dominates(q, p, modes) for q in points) for p in points]
