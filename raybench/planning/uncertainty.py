"""How far a prediction may be off: one relative error band per predicted quantity and basis, derived on one set
of measurements and checked on others, widened for trials unlike the rows it was derived from, and the interval a
band puts around a predicted figure.

A band `b` is a 90th percentile of |predicted / measured - 1|. The interval around a prediction `p` is every
measured value such an error allows, [p / (1 + b), p / (1 - b)]: a measured value lies inside exactly when the
prediction erred by at most `b`. A band has two parts (docs/results/prediction-bands-2026-11-28.md, the rules):

- `rows`: the 90th percentile over the derivation rows, the held-out GPU rows of the H100 (Llama-3.2-1B on one
  GPU); its coverage is checked on the held-out rows of every other GPU (the H200's).
- `at_scale`: added in full to a trial at least ten times the rows' model or world size (`reach`), in part
  nearer: the 90th percentile, over the public corpus's entries (7B-70B, 1-128 GPUs), of the width each entry
  needs beyond `rows` to be covered, divided by its reach. Its coverage is checked source by source: each
  source's entries against the term derived on the other sources.

It is the spread of past errors, not a statistical confidence interval: the rows and entries are few and not
independent draws, so a new trial's figure may fall outside it (one in ten by construction, more where the
checks say so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

QUANTILE = 0.9
# The derivation rows' model (Llama-3.2-1B, parameters as the estimate counts them) and world size (one GPU): a
# trial within both is as the rows were and gets the `rows` band alone.
ROWS_PARAMS = 1_235_814_400
ROWS_WORLD = 1


@dataclass(frozen=True)
class Band:
    """Relative error bands of one basis of prediction, as fractions (0.06 = 6%)."""

    step_time: float
    tensor_peak: float  # the step's tensor memory (peak_alloc_gib of a GPU row)
    reserved_peak: float  # what the allocator reserves (peak_reserved_gib), the figure that decides a fit

    def plus(self, extra: Band, times: float) -> Band:
        return Band(step_time=self.step_time + times * extra.step_time,
                    tensor_peak=self.tensor_peak + times * extra.tensor_peak,
                    reserved_peak=self.reserved_peak + times * extra.reserved_peak)


@dataclass(frozen=True)
class Bands:
    rows: Band  # derived on one GPU's held-out rows of the 1B model on one GPU
    at_scale: Band  # added at reach 1 (tensor peak: the reserved peak's, the corpus publishes no tensor peak)


# docs/results/prediction-bands-2026-12-07-xtuner.md (bench/prediction_intervals.py on bench/rehearse_validate.py's
# and bench/rehearse_public.py's output, 2026-12-07: the corpus with xtuner's entries).
# "traced": a traced rehearsal.
# "analytic": the analytic estimate (what an untraced trial is predicted by: `raybench rehearse`'s fallback, the
# plan without a rehearsal).
BANDS = {
    "traced": Bands(rows=Band(step_time=0.311, tensor_peak=0.029, reserved_peak=0.086),
                    at_scale=Band(step_time=0.361, tensor_peak=0.267, reserved_peak=0.267)),
    "analytic": Bands(rows=Band(step_time=0.632, tensor_peak=0.251, reserved_peak=0.091),
                      at_scale=Band(step_time=0.127, tensor_peak=0.273, reserved_peak=0.273)),
}


def reach(params_total: int, world_size: int) -> float:
    """How far a trial is from the derivation rows, 0 (as they were) to 1: the decades its model's parameters and
    its world size lie beyond the rows', summed, at most 1. The corpus's errors do not keep growing past one
    decade (its 70B entries on 64-128 GPUs err less than its 8B ones on 8), so the widening stops there."""
    decades = max(0.0, math.log10(params_total / ROWS_PARAMS)) + max(0.0, math.log10(world_size / ROWS_WORLD))
    return min(1.0, decades)


def band(basis: str, params_total: int, world_size: int) -> Band:
    """The bands of "traced" (a traced rehearsal) or of anything else (the analytic estimate), for a trial of
    `params_total` parameters over `world_size` ranks."""
    bands = BANDS["traced" if basis in ("traced", "rehearsed") else "analytic"]
    return bands.rows.plus(bands.at_scale, reach(params_total, world_size))


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


def rehearsal_intervals(rehearsal: dict, params_total: int) -> dict:
    """The intervals of one stored rehearsal's figures (`raybench rehearse`), by its method, for a trial of
    `params_total` parameters (the rehearsal holds its world size)."""
    widths = band(rehearsal["method"], params_total, rehearsal["world_size"])
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


# How the bands are derived and checked (bench/prediction_intervals.py; tests/unit/test_prediction_bands.py).

def quantile(values: list[float], q: float = QUANTILE) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def coverage(abs_errors: list[float], widths: list[float]) -> float:
    """The fraction of predictions whose measured value lies in its interval: |error| within the band."""
    return sum(e <= w for e, w in zip(abs_errors, widths, strict=True)) / len(abs_errors)


def at_scale_extra(abs_errors: list[float], reaches: list[float], rows_band: float) -> float:
    """The width to add at reach 1: the quantile, over the points beyond the rows (reach > 0), of what each needs
    beyond `rows_band` to be covered, per unit of reach (0 for one already covered)."""
    needed = [max(0.0, e - rows_band) / r for e, r in zip(abs_errors, reaches, strict=True) if r > 0]
    return quantile(needed) if needed else 0.0
