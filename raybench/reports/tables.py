"""Text tables of planned trials: the plan, its estimates and its rehearsals."""

from __future__ import annotations

from raybench.planning import estimate, uncertainty
from raybench.planning.plan import PlannedTrial
from raybench.rehearse.fitted import Calibration
from raybench.reports.report import PEAKS_LEGEND, cell, render
from raybench.results.rehearsals import REHEARSALS_DIR


def plan_table(trials: list[PlannedTrial]) -> str:
    axes = list(dict.fromkeys(k for t in trials for k in t.axis_values))
    headers = ["#", "trial_id", *axes, "world", "layers", "ac_blocks", "loss", "status"]
    rows = [
        [str(t.index), t.trial_id, *(str(t.axis_values.get(a, "")) for a in axes), str(t.world_size),
         str(t.shape.num_hidden_layers), ",".join(map(str, t.ac_blocks)) or "-", t.config.train.loss,
         t.status if not t.reasons else f"{t.status}: {'; '.join(t.reasons)}"]
        for t in trials
    ]
    return render(headers, rows)


def estimate_table(trials: list[PlannedTrial]) -> str:
    """One line per planned trial: axis values, the components, peak (raw and calibrated), fits, step guess."""
    axes = list(dict.fromkeys(k for t in trials for k in t.axis_values))
    headers = ["#", "trial_id", *(a.split(".")[-1] for a in axes), "world", "loss", "params", "grads", "optim", "activ",
               "other", "analytic GiB", "calib", "calibrated", "rehearsed+ctx GiB", "limit", "fits", "step s (guess)",
               "step s (rehearsed)", "status"]
    rows = []
    for t in trials:
        a = t.assessment
        values = [str(t.index), t.trial_id, *(str(t.axis_values.get(axis, "")) for axis in axes), str(t.world_size),
                  t.config.train.loss]
        if a is None:  # invalid points (--keep-invalid) have no estimate
            rows.append([*values, *["-"] * 13, f"{t.status}: {'; '.join(t.reasons)}"])
            continue
        e = a.analytic
        fits = {True: "yes", False: "NO", None: "-"}[a.fits]
        rows.append([*values, *(cell(gib, ".2f") for gib in (e.params_gib, e.grads_gib, e.optimizer_gib,
                                                               e.activations_gib, e.other_gib, e.peak_gib)),
                     cell(a.calibration, ".2f"), cell(a.peak_calibrated_gib, ".2f"), cell(a.rehearsed_peak_gib, ".2f"),
                     cell(a.limit_gib, ".2f"), fits, cell(e.step_time_s, ".3g"), cell(a.rehearsed_step_time_s, ".3g"),
                     t.status])
    return render(headers, rows) + f"\n({PEAKS_LEGEND})"


def rehearsal_table(rows: list[dict]) -> str:
    """One line per rehearsed configuration: peak memory by category, communication, predicted step time; the
    peaks and the step time with their intervals (planning/uncertainty.py)."""
    axes = list(dict.fromkeys(k for r in rows for k in r["axis_values"]))
    headers = ["#", "config_id", *(a.split(".")[-1] for a in axes), "world", "method", "params", "grads", "optim",
               "activ", "temp", "tensor peak GiB", "reserved GiB", "comm GB", "busbw", "compute s", "exposed comm s",
               "step s", "trace s", "notes"]
    lines = []
    for r in rows:
        m = r["memory_gib"]
        comm = sum(r["comm_bytes"].values()) / 1e9 if r["comm_bytes"] else None
        busbw = f"{r['busbw_gbps']:.0f} ({r['busbw_source']})" if r.get("busbw_gbps") else "-"
        iv = r["intervals"]  # rehearse_trials': by the trial's basis, model and world size
        lines.append([str(r["index"]), r["config_id"], *(str(r["axis_values"].get(a, "")) for a in axes),
                      str(r["world_size"]), r["method"],
                      *(cell(m.get(k), ".2f") for k in ("parameters", "gradients", "optimizer_state", "activations",
                                                        "temporaries")),
                      uncertainty.with_interval(r["peak_gib"], iv["peak_gib"], ".2f"),
                      uncertainty.with_interval(r.get("reserved_gib"), iv["reserved_gib"], ".2f"), cell(comm, ".1f"),
                      busbw, cell(r["compute_s"], ".3g"), cell(r["exposed_comm_s"], ".3g"),
                      uncertainty.with_interval(r["step_time_s"], iv["step_time_s"], ".3g"),
                      cell(r["trace_s"], ".0f"),
                      "; ".join(r["notes"]) or "-"])
    return render(headers, lines) + f"\n({PEAKS_LEGEND})"



def rehearsal_report(rows: list[dict], store_path: str, sweep_file: str) -> str:
    """`raybench rehearse`'s table, where the rehearsals are stored, and the calibrations that priced them."""
    text = (rehearsal_table(rows) + f"\n\n{len(rows)} configuration(s) rehearsed; stored in {store_path}/"
            f"{REHEARSALS_DIR} (`raybench estimate {sweep_file}` fits them by their rehearsal)")
    used = _priced_with(rows)
    if used:
        text += "\npriced with: " + "; ".join(used)
    crossing = sum(_across_nodes_on_nominal_links(r) for r in rows)
    if crossing:
        text += (f"\nfabric: {crossing} configuration(s) cross nodes on nominal links (nothing measured the "
                 "network): their step times are the least certain here (docs/rehearse.md, node layout); give the "
                 "cluster's fabric with --busbw, estimate.busbw_gbps or estimate.nics_per_node")
    return text


def _across_nodes_on_nominal_links(row: dict) -> bool:
    layout = row.get("layout")
    return row.get("busbw_source") == "links" and bool(layout) and row["world_size"] > layout["gpus_per_node"]


def _priced_with(rows: list[dict]) -> list[str]:
    """The calibrations that priced the traced rows (a CPU trial the shipped constants priced has no time)."""
    return sorted({Calibration.of(r).source for r in rows
                   if r["method"] == "traced" and (r["gpu"] or Calibration.of(r).profiled)})


def estimate_summary(trials: list[PlannedTrial], store_path: str) -> str:
    """What the table adds up to, and where its calibration came from."""
    assessed = [t.assessment for t in trials if t.assessment]
    fits = sum(a.fits is True for a in assessed)
    too_big = sum(a.fits is False for a in assessed)
    calibrated = sum(a.calibration is not None for a in assessed)
    unknown = len(assessed) - fits - too_big
    parts = [f"{len(trials)} trials: {fits} fit, {too_big} do not fit"]
    if unknown:
        parts.append(f"{unknown} without a device memory limit (set estimate.gpu or estimate.device_memory_gib)")
    parts.append(f"{sum(t.status == 'skipped' for t in trials)} skipped by pruning")
    parts.append(f"{calibrated} calibrated by measured rows in {store_path}")
    rehearsed = sum(a.peak_basis == "rehearsed" for a in assessed)
    if rehearsed:
        parts.append(f"{rehearsed} judged by their rehearsal (`raybench rehearse`) instead of the estimate")
    return "; ".join(parts) + (f". Step times are guesses (dense peak x {estimate.ASSUMED_MFU:.0%} MFU), "
                               "not measurements.")
