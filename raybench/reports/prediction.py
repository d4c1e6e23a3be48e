"""`raybench best SWEEP --predict` as it prints: the predicted best value of an axis per group, where that choice
could flip, the op-level policy, the calibrations that priced the rehearsals, and the short sweep that settles
the values in doubt (raybench.rehearse.choice and flips decide them; this module reads and shows)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from raybench.planning import uncertainty
from raybench.planning.plan import plan
from raybench.rehearse import choice, flips
from raybench.rehearse.fitted import Calibration
from raybench.rehearse.trials import device_calibration
from raybench.reports.report import PEAKS_LEGEND, render
from raybench.results import rehearsals
from raybench.spec.errors import ConfigError, Problem
from raybench.spec.hardware import find_gpu


@dataclass(frozen=True)
class Prediction:
    results: list[dict]  # choice.predicted_best's, one per group
    priced_with: list[str]  # the calibrations that priced the stored rehearsals
    stale: str | None  # a warning when the store's calibration of the GPU changed since, else None
    # Rehearsed GPU trials priced for another GPU than the sweep's (`--gpu`): config id -> the GPU they were priced
    # for (None: stored before rehearsals kept their GPU). Their figures would answer for the wrong GPU.
    priced_for_other_gpu: dict[str, str | None]
    # GPU trials with no stored rehearsal while others of the sweep have one (trial id -> its axis values): left
    # out, another value would be called best. A configuration can change with the GPU (train.loss auto).
    unrehearsed: dict[str, dict]


def predict(spec, source: str, store_path: str, axis: str) -> Prediction:
    """The predicted best `axis` value per group from the sweep's stored rehearsals (`raybench rehearse`)."""
    trials = plan(spec, source=source, store_path=store_path)
    if not any(t.config.resources.gpus_per_worker > 0 for t in trials):
        raise ConfigError(f"raybench best {source} --predict", [Problem(
            "resources.gpus_per_worker", 0, "this sweep's trials run on CPU, and --predict picks by predicted GPU "
            "memory and step time: run the sweep and rank its measured rows (`raybench best STORE`), or set "
            "resources.gpus_per_worker: 1 and estimate.gpu to predict for that GPU")])
    stored = rehearsals.rehearsals(store_path)
    results = choice.predicted_best(trials, axis, stored)
    # The rehearsals were priced when `rehearse` ran, with the profile the store held for their GPU then.
    used = sorted({Calibration.of(stored[t.config_id]).source for t in trials
                   if stored.get(t.config_id, {}).get("method") == "traced"})
    gpu = spec.estimate.gpu
    latest = device_calibration(store_path, gpu).source if gpu else None
    stale = None
    if latest and used and latest not in used:
        stale = (f"the store's calibration for {gpu} is now {latest}: `raybench rehearse {source}` prices the "
                 "rehearsals with it")
    asked = find_gpu(gpu)
    other = {t.config_id: stored[t.config_id].get("gpu") for t in trials
             if asked and t.config.resources.gpus_per_worker > 0
             and stored.get(t.config_id, {}).get("method") == "traced"
             and find_gpu(stored[t.config_id].get("gpu")) is not asked}
    on_gpu = [t for t in trials if t.config.resources.gpus_per_worker > 0]
    unrehearsed = {t.trial_id: t.axis_values for t in on_gpu if t.config_id not in stored}
    if len(unrehearsed) == len(on_gpu):  # none rehearsed: render_predicted_best says to rehearse first
        unrehearsed = {}
    return Prediction(results, used, stale, other, unrehearsed)


def prediction_text(found: Prediction, axis: str) -> str:
    return render_predicted_best(found.results, axis) + "\n\nrehearsals priced with: " + (
        "; ".join(found.priced_with) or "-")


def write_settle_sweep(spec, results: list[dict], path: str, axis: str) -> str:
    """Write the trials whose choice may flip as a short sweep to `path` (nothing when none is in doubt); the line
    that says what was written and how to run it."""
    points = [d["axis_values"] for r in results for d in r["in_doubt"]]
    if not points:
        return f"nothing in doubt: {path} not written"
    settle = flips.settle_sweep(spec, points)
    Path(path).write_text(yaml.safe_dump(settle, sort_keys=False))
    return (f"wrote {path}: {len(points)} trial(s) in doubt, {flips.SETTLE_STEPS} steps each; "
            f"`raybench run {path}`, then `raybench best {spec.store} --sweep {settle['name']} --axis {axis}`")


def render_predicted_best(results: list[dict], axis: str = "train.ac_ratio") -> str:
    """predicted_best's results as `raybench best --predict` prints them."""
    if not results:
        return "no rehearsed trials: run `raybench rehearse SWEEP` first (it stores rehearsals in the sweep's store)"
    named = ",".join(field.split(".")[-1] for field in axis.split(","))
    headers = ["group", f"best {named}", "pred tok/s/GPU", "reserved+ctx GiB", "limit GiB", "every value: "
               "reserved+ctx GiB / fits / tok/s/GPU"]
    rows = []
    for r in results:
        best = r["best"]
        every = "; ".join(f"{v['value']}: {v['peak_gib']:.1f}/{'yes' if v['fits'] else 'NO'}/"
                          f"{v['tok_per_s_per_device'] or 0:.0f}" for v in r["values"])
        if best:
            chosen = [str(best["value"]),
                      uncertainty.with_interval(best["tok_per_s_per_device"], best["tok_interval"], ".0f"),
                      uncertainty.with_interval(best["peak_gib"], best["peak_interval_gib"], ".1f")]
        else:
            chosen = ["none fits", "-", "-"]
        rows.append([_group_name(r), *chosen, _limit(r), every])
    text = render(headers, rows) + f"\n({PEAKS_LEGEND})\n\n" + _doubt_report(results)
    if any(r["op_policy"] is not None for r in results):
        text += "\n\n" + _op_policy_report(results)
    return text


def _doubt_report(results: list[dict]) -> str:
    """Per group: whether the choice stands inside the intervals, else which values are in doubt, why, and the
    measurement that settles them."""
    lines = ["within the prediction intervals (bands checked on rows they were not derived from, widened with model "
             "and world size; docs/rehearse.md, intervals and flips):"]
    for r in results:
        doubts = r["in_doubt"]
        if not doubts:
            lines.append(f"  {_group_name(r)}: the choice stands ({_bands(r)})")
            continue
        lines.append(f"  {_group_name(r)}: in doubt ({_bands(r)}); {flips.settle_line(doubts)}")
        lines += [f"    {d['value']}: {d['why']}" for d in doubts]
    return "\n".join(lines)


def _bands(result: dict) -> str:
    """The bands the chosen value's intervals (else the first value's) are drawn with."""
    band = (result["best"] or result["values"][0])["band"]
    return f"bands: step time {band['step_time']:.1%}, reserved peak {band['reserved_peak']:.1%}"


def _group_name(result: dict) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in result["group"].items()) or "-"


def _limit(result: dict) -> str:
    return "-" if result["memory_gib"] is None else f"{result['memory_gib'] - result['margin_gib']:.1f}"


def _op_policy_report(results: list[dict]) -> str:
    """One line per group: the op-level policy's predicted figures next to the best block ratio's, and which
    operators of each decoder block it saves and recomputes."""
    headers = ["group", "pred tok/s/GPU", "vs best ratio", "peak GiB", "limit GiB", "kept", "saved per block",
               "recomputed per block"]
    rows = []
    for r in results:
        found = r["op_policy"]
        if "why" in found:
            rows.append([_group_name(r), "-", "-", "-", _limit(r), "-", found["why"], "-"])
            continue
        policy = found["policy"]
        if policy is None:
            rows.append([_group_name(r), "none fits", "-", "-", _limit(r), "-", "-", "-"])
            continue
        ratio = r["best"]["tok_per_s_per_device"] if r["best"] else None
        versus = f"{found['tok_per_s_per_device'] / ratio - 1:+.1%}" if ratio else "-"
        rows.append([_group_name(r), f"{found['tok_per_s_per_device']:.0f}", versus, f"{found['peak_gib']:.1f}",
                     _limit(r), f"{policy['kept_fraction']:.2f}", _op_counts(policy["saved"]),
                     _op_counts(policy["recomputed"])])
    runs = [f"  {_group_name(r)}: {{ac_ratio: '1', ac_mode: op, ac_saved_ops: "
            f"[{', '.join(r['op_policy']['policy']['ac_saved_ops'])}]}}"
            for r in results if r["op_policy"].get("policy")]
    return ("op-level policy (torch's SAC ILP per decoder block, from the ac_ratio 1 rehearsal; kept = share of "
            "a block's output bytes it may keep):\n" + render(headers, rows)
            + ("\nto run a group's policy, set in its train section:\n" + "\n".join(runs) if runs else ""))


def _op_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} x{n}" if n > 1 else name for name, n in sorted(counts.items())) or "-"
