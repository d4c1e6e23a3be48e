"""How far a prediction may be off: one relative error band per predicted quantity and basis, measured on held-out
GPU rows, and the interval a band puts around a predicted figure.

A band `b` is the 90th percentile of |predicted / measured - 1| over the committed GPU rows that fitted no
constant (bench/validation_split.yaml): nine in ten of those predictions erred by at most `b`. The interval
around a prediction `p` is then every measured value such an error allows, [p / (1 + b), p / (1 - b)]. It is
the spread of past errors, not a statistical confidence interval: the rows are few, of few models and GPUs, and
not independent draws, so a new trial's figure may fall outside it (about one held-out row in ten does, by
construction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Band:
    """Relative error bands of one basis of prediction, as fractions (0.06 = 6%)."""

    step_time: float
    tensor_peak: float  # the step's tensor memory (peak_alloc_gib of a GPU row)
    reserved_peak: float  # what the allocator reserves (peak_reserved_gib), the figure that decides a fit


# docs/results/prediction-intervals-2026-11-26.md (bench/prediction_intervals.py on bench/rehearse_validate.py's
# output, 2026-11-26). "traced": the 47 held-out rows the rehearsal traced. "analytic": the analytic estimate
# (what an untraced trial is predicted by: `raybench rehearse`'s fallback, the plan without a rehearsal) on the
# 48 held-out rows, each configuration estimated. The analytic bands are the wider: the estimate adds components
# that do not peak together and guesses step time from one assumed MFU.
BANDS = {
    "traced": Band(step_time=0.093, tensor_peak=0.004, reserved_peak=0.060),
    "analytic": Band(step_time=0.323, tensor_peak=0.258, reserved_peak=0.104),
}


def band(basis: str) -> Band:
    """The bands of "traced" (a traced rehearsal) or of anything else (the analytic estimate)."""
    return BANDS["traced" if basis in ("traced", "rehearsed") else "analytic"]


def interval(predicted: float | None, width: float, fixed: float = 0.0) -> tuple[float, float] | None:
    """The measured values a prediction allows when it errs by at most `width` (error = predicted / measured - 1).

    `fixed` is a part of the prediction the band does not cover (the CUDA context, outside the allocator's
    reserve): it is added to both ends as it is. A width of 1 or more leaves no upper end (inf)."""
    if predicted is None:
        return None
    banded = predicted - fixed
    upper = banded / (1 - width) if width < 1 else math.inf
    return banded / (1 + width) + fixed, upper + fixed


def reciprocal(iv: tuple[float, float] | None, numerator: float) -> tuple[float, float] | None:
    """numerator / x over an interval of positive x: a step-time interval as a throughput interval."""
    return None if iv is None else (numerator / iv[1], numerator / iv[0])


def rehearsal_intervals(rehearsal: dict) -> dict:
    """The intervals of one stored rehearsal's figures (`raybench rehearse`), by its method."""
    widths = band(rehearsal["method"])
    return {"peak_gib": interval(rehearsal.get("peak_gib"), widths.tensor_peak),
            "reserved_gib": interval(rehearsal.get("reserved_gib"), widths.reserved_peak),
            "step_time_s": interval(rehearsal.get("step_time_s"), widths.step_time)}


def with_interval(value: float | None, iv: tuple[float, float] | None, spec: str) -> str:
    """'72.9 [68.8-77.6]' (or '-' without a value)."""
    if value is None:
        return "-"
    if iv is None:
        return format(value, spec)
    return f"{value:{spec}} [{iv[0]:{spec}}-{iv[1]:{spec}}]"
