"""Where `raybench best --predict`'s choice could flip inside the prediction intervals (planning/uncertainty.py):
which values of a group are in doubt and why, and the short sweep whose measurements settle them."""

from __future__ import annotations

from raybench.spec.sweep_spec import SweepSpec

# A settling run measures a peak and a median step time, not a training curve: the warm-up steps cover compile and
# the allocator's first growth, the timed ones give the median.
SETTLE_WARMUP_STEPS = 3
SETTLE_STEPS = SETTLE_WARMUP_STEPS + 5
SETTLE_BUNDLE = "in_doubt"


def in_doubt(values: list[dict], limit_gib: float | None) -> list[dict]:
    """The values of one group the choice may flip between, each {"value", "axis_values", "why"}; [] when the
    predicted choice stands however each figure errs within its interval.

    `values` are predicted_best's, with "peak_interval_gib" and "tok_interval". A value contends when it may fit
    (its peak interval starts within the limit) and may be the fastest (its throughput interval reaches the
    throughput the best value that surely fits is sure of). One contender that surely fits is a sure choice."""
    if limit_gib is None:  # nothing is judged to fit without a memory limit: no choice to doubt
        return []
    rated = [v for v in values if v["tok_interval"]]
    may_fit = [v for v in rated if v["peak_interval_gib"][0] <= limit_gib]
    floor = max((v["tok_interval"][0] for v in may_fit if _surely_fits(v, limit_gib)), default=0.0)
    contenders = [v for v in may_fit if v["tok_interval"][1] >= floor]
    if len(contenders) <= 1 and all(_surely_fits(v, limit_gib) for v in contenders):
        return []
    return [{"value": v["value"], "axis_values": v["axis_values"], "why": _why(v, contenders, limit_gib)}
            for v in contenders]


def _surely_fits(value: dict, limit_gib: float) -> bool:
    return value["peak_interval_gib"][1] <= limit_gib


def _why(value: dict, contenders: list[dict], limit_gib: float) -> str:
    reasons = []
    low, high = value["peak_interval_gib"]
    if not _surely_fits(value, limit_gib):
        reasons.append(f"may {'not ' if value['fits'] else ''}fit: peak {value['peak_gib']:.1f} "
                       f"[{low:.1f}-{high:.1f}] GiB against the {limit_gib:.1f} GiB limit")
    others = [o for o in contenders if o is not value]
    slow, fast = value["tok_interval"]
    overlapping = [str(o["value"]) for o in others if o["tok_interval"][0] <= fast and slow <= o["tok_interval"][1]]
    if overlapping:
        reasons.append(f"tok/s/GPU {value['tok_per_s_per_device']:.0f} [{slow:.0f}-{fast:.0f}] overlaps "
                       f"{', '.join(overlapping)}")
    if not reasons:  # surely fits, surely slower than the others: it wins if none of them fits
        reasons.append(f"the choice if {', '.join(str(o['value']) for o in others)} does not fit")
    return "; ".join(reasons)


def settle_line(doubts: list[dict]) -> str:
    """What one short measurement settles a group's doubt with."""
    which = "it" if len(doubts) == 1 else f"these {len(doubts)}"
    return (f"settle: run {which} for {SETTLE_STEPS} steps ({SETTLE_WARMUP_STEPS} warm-up) each, at full world "
            "size (--emit-sweep PATH writes that sweep)")


def settle_sweep(spec: SweepSpec, points: list[dict]) -> dict:
    """The sweep that measures `points` (the axis values of trials in doubt) briefly: the spec's own fields, a
    grid of exactly those points (one bundle axis), few steps, one repeat, every point run (a point in doubt may
    be predicted not to fit, which pruning would skip). Plain data, for YAML."""
    raw = spec.model_dump(mode="json", exclude_defaults=True)  # paths are absolute already (load_sweep)
    for key in ("axes", "exclude", "repeats", "search"):
        raw.pop(key, None)
    raw["name"] = f"{spec.name[:93]}-settle"  # a name is at most 100 characters
    raw["train"] = {**raw.get("train", {}), "steps": SETTLE_STEPS, "warmup_steps": SETTLE_WARMUP_STEPS}
    raw["estimate"] = {**raw.get("estimate", {}), "prune": False}
    bundle = []
    for point in points:  # the steps are the settling run's own; points differing only in them are one
        mapping = {k: v for k, v in point.items() if k not in ("train.steps", "train.warmup_steps")}
        if mapping not in bundle:
            bundle.append(mapping)
    if any(bundle):
        raw["axes"] = {SETTLE_BUNDLE: bundle}
    return raw
