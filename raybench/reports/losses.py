"""Loss trajectories side by side: does a faster configuration still train the same?

A speed-up that breaks the step (FP8 casts that overflow, a fused kernel with a wrong gradient) shows in the loss
before it shows anywhere else. Rows of one sweep that differ only in one axis (train.fp8: off vs tensorwise; liger:
false vs true) ran the same steps on the same data (the same seed draws the same synthetic tokens; real data is
the same tokenized cache), so their per-step losses (`loss_by_step`) must agree within a tolerance. Each point is
compared with the baseline point of its group, step by step: the largest relative difference, and where. A
configuration whose loss jumps from one step to the next (a full fine-tune at a high learning rate, on few tokens
a step) differs from its own repeat by more than a technique does; `window` compares the means of that many
consecutive steps instead, as loss curves are read smoothed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pandas as pd

from raybench.reports import frames
from raybench.spec.errors import ConfigError, Problem

# A run in a lower precision may differ from its baseline by its rounding, not by a trend: 2% of the loss at any
# step, stated in every report and overridable (--tolerance).
DEFAULT_TOLERANCE = 0.02


@dataclass(frozen=True)
class LossComparison:
    group: str  # the other axis values, shared by the point and its baseline
    value: str  # the point's value of the axis
    trial_id: str
    baseline_trial_id: str
    steps: int  # steps compared: those both rows have a loss for
    max_rel_diff: float  # max over steps (or windows) of |loss - baseline| / |baseline|
    step_of_max: int  # 0-based, warm-up steps included; with a window, its last step
    final_rel_diff: float
    within: bool  # max_rel_diff <= the tolerance
    window: int = 1  # steps averaged on both sides before comparing (the pair's steps, where it has fewer)
    # How far the baseline's own loss (or window mean) sits off the mean of its two neighbours, at most, relative:
    # a trend does not count, a jump does. Where it passes the tolerance, the configuration is noisier from step to
    # step than the tolerance, and a wider window reads it.
    baseline_noise: float = 0.0


def axis_text(value) -> str:
    """An axis value as the command line names it: strings as they are, others as JSON (true, 0.5, null)."""
    return value if isinstance(value, str) else json.dumps(value)


def compare_losses(df: pd.DataFrame, axis: str, baseline: str, tolerance: float = DEFAULT_TOLERANCE,
                   window: int = 1) -> list[LossComparison]:
    """Every ok row whose `axis` value is not `baseline`, against the ok row of the same other axis values
    whose value is, step by step or by the means of `window` consecutive compared steps. Raises ConfigError
    (exit 2) when the rows have no such axis or no baseline point."""
    rows = frames.ok_rows(df)
    # .loc and bool: with no ok row, an empty object mask would select columns (none) instead of rows.
    rows = rows.loc[rows["loss_by_step"].map(_has_losses).astype(bool)] if "loss_by_step" in rows else rows.iloc[0:0]
    axes = rows["axis_values_json"].map(lambda text: json.loads(text) if isinstance(text, str) else {})
    names = sorted({name for values in axes for name in values})
    if axis not in names:
        raise ConfigError("raybench losses", [Problem("--axis", axis, (
            f"is not an axis of these rows' sweep; use one of {names}" if names else
            "no ok row with per-step losses is there: run the sweep first (rows before loss_by_step have none)"))])
    values = axes.map(lambda v: axis_text(v.get(axis)))
    if baseline not in set(values):
        raise ConfigError("raybench losses", [Problem("--baseline", baseline, (
            f"no ok row has {axis}={baseline}; its values here are {sorted(set(values))}"))])
    groups = axes.map(lambda v: " ".join(f"{k.split('.')[-1]}={axis_text(x)}" for k, x in v.items() if k != axis))
    table = pd.DataFrame({"group": groups, "value": values, "trial_id": rows["trial_id"],
                          "losses": rows["loss_by_step"]}, index=rows.index)
    out = []
    for group, members in table.groupby("group", sort=True):
        reference = members[members["value"] == baseline]
        if reference.empty:
            continue
        base = reference.iloc[0]
        for _, point in members[members["value"] != baseline].iterrows():
            compared = _compare(group or "base", point, base, tolerance, window)
            if compared is not None:
                out.append(compared)
    return out


def _has_losses(losses) -> bool:
    return losses is not None and len(losses) > 0 and any(_known(x) for x in losses)


def _known(x) -> bool:
    return x is not None and not math.isnan(x)


def _compare(group: str, point, base, tolerance: float, window: int) -> LossComparison | None:
    """The point against its baseline over the steps both have a loss for; None when they share none."""
    pairs = [(i, a, b) for i, (a, b) in enumerate(zip(point["losses"], base["losses"])) if _known(a) and _known(b)]
    if not pairs:
        return None
    window = min(window, len(pairs))
    diffs, base_means = [], []
    for end in range(window, len(pairs) + 1):
        steps = pairs[end - window:end]
        a, b = (sum(pair[side] for pair in steps) / window for side in (1, 2))
        diffs.append((_relative(a, b), steps[-1][0]))
        base_means.append(b)
    worst, step = max(diffs)
    noise = max((_relative(b, (before + after) / 2) for before, b, after in
                 zip(base_means, base_means[1:], base_means[2:])), default=0.0)
    return LossComparison(group, point["value"], str(point["trial_id"]), str(base["trial_id"]), len(pairs), worst,
                          step, diffs[-1][0], bool(worst <= tolerance), window, noise)


def _relative(value: float, reference: float) -> float:
    return float(abs(value - reference) / abs(reference) if reference else abs(value - reference))


def comparison_text(comparisons: list[LossComparison], axis: str, baseline: str, tolerance: float,
                    window: int = 1) -> str:
    where = "at any step" if window == 1 else f"in the mean of any {window} consecutive steps"
    lines = [f"loss by step against {axis}={baseline} (tolerance {tolerance:.1%} of the baseline's loss {where})"]
    for c in comparisons:
        verdict = "within" if c.within else "BEYOND"
        lines.append(f"  {c.group}: {axis}={c.value} vs {baseline}: max {c.max_rel_diff:.2%} at step {c.step_of_max} "
                     f"of {c.steps}, final {c.final_rel_diff:.2%}: {verdict} ({c.trial_id} vs {c.baseline_trial_id})")
        if not c.within and c.baseline_noise > tolerance:
            lines.append(f"    the baseline's own loss sits up to {c.baseline_noise:.2%} off the mean of its neighbouring "
                         f"steps, more than the tolerance: --window {max(2 * c.window, 5)} compares means of consecutive "
                         "steps")
    if not comparisons:
        lines.append("  no point has a baseline of the same other axis values")
    return "\n".join(lines)
