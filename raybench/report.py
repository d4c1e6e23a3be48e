"""Text tables of planned trials and of stored results."""

from __future__ import annotations

import json
import math

from raybench import estimate
from raybench.plan import PlannedTrial


def render(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _fmt(value, spec: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def plan_table(trials: list[PlannedTrial]) -> str:
    axes = list(dict.fromkeys(k for t in trials for k in t.axis_values))
    headers = ["#", "trial_id", *axes, "world", "layers", "ac_blocks", "status"]
    rows = [
        [str(t.index), t.trial_id, *(str(t.axis_values.get(a, "")) for a in axes), str(t.world_size),
         str(t.shape.num_hidden_layers), ",".join(map(str, t.ac_blocks)) or "-",
         t.status if not t.reasons else f"{t.status}: {'; '.join(t.reasons)}"]
        for t in trials
    ]
    return render(headers, rows)


def results_table(df) -> str:
    """Stored rows (a DataFrame from read_results) as a table, one line per trial."""
    if len(df) == 0:
        return "no results"
    headers, rows, note = results_rows(df)
    return render(headers, rows) + (f"\n({note})" if note else "")


def results_rows(df) -> tuple[list[str], list[list[str]], str]:
    """Headers, formatted cells (one row per trial) and a note on units, for text, Markdown and HTML tables."""
    from raybench import frames  # pandas: `raybench plan` and `estimate` render tables here without it

    records = (df.assign(system_label=frames.system_label(df))
               .sort_values(["sweep", "started_at", "trial_id"], na_position="last").to_dict("records"))
    axis_values = [json.loads(r["axis_values_json"] or "{}") for r in records]
    axes = list(dict.fromkeys(k for a in axis_values for k in a))
    on_gpu = all(r["device_type"] == "cuda" for r in records if r["status"] == "ok")
    per = "GPU" if on_gpu else "worker"
    by_system = len({r["system_label"] for r in records}) > 1  # a column once a store holds several systems
    headers = ["sweep", *(["system"] if by_system else []), "trial_id", "status", *(a.split(".")[-1] for a in axes),
               f"tok/s/{per}", f"nonpad tok/s/{per}", "step p50 ms", "step p90 ms", "peak GiB", "loss first→final",
               "message"]
    rows = []
    for r, values in zip(records, axis_values):
        peak = r["peak_reserved_gib"] if r["device_type"] == "cuda" else r["peak_rss_gib"]
        loss = f"{_fmt(r['loss_first'], '.3f')}→{_fmt(r['loss_final'], '.3f')}" if r["status"] == "ok" else "-"
        rows.append([
            r["sweep"], *([r["system_label"]] if by_system else []), r["trial_id"], r["status"],
            *(str(values.get(a, "")) for a in axes),
            _fmt(r["tok_per_s_per_device"], ",.0f"), _fmt(r["nonpad_tok_per_s_per_device"], ",.0f"),
            _fmt(r["step_time_p50_s"] and r["step_time_p50_s"] * 1000, ".1f"),
            _fmt(r["step_time_p90_s"] and r["step_time_p90_s"] * 1000, ".1f"),
            _fmt(peak, ".2f"), loss, (r["message"] or "")[:80],
        ])
    note = "" if on_gpu else "CPU run: throughput is per worker process, not per GPU; peak is host RSS"
    return headers, rows, note


def estimate_table(trials: list[PlannedTrial]) -> str:
    """One line per planned trial: axis values, the components, peak (raw and calibrated), fits, step guess."""
    axes = list(dict.fromkeys(k for t in trials for k in t.axis_values))
    headers = ["#", "trial_id", *(a.split(".")[-1] for a in axes), "world", "params", "grads", "optim", "activ",
               "other", "peak GiB", "calib", "calibrated", "rehearsed", "limit", "fits", "step s (guess)",
               "step s (rehearsed)", "status"]
    rows = []
    for t in trials:
        e = t.estimate
        if not e:  # invalid points (--keep-invalid) have no estimate
            rows.append([str(t.index), t.trial_id, *(str(t.axis_values.get(a, "")) for a in axes),
                         str(t.world_size), *["-"] * 13, f"{t.status}: {'; '.join(t.reasons)}"])
            continue
        fits = {True: "yes", False: "NO", None: "-"}[e["fits"]]
        limit = None if e["memory_gib"] is None else e["memory_gib"] - e["margin_gib"]
        rows.append([str(t.index), t.trial_id, *(str(t.axis_values.get(a, "")) for a in axes), str(t.world_size),
                     *(_fmt(e[k], ".2f") for k in ("params_gib", "grads_gib", "optimizer_gib", "activations_gib",
                                            "other_gib", "peak_gib")),
                     _fmt(e["calibration"], ".2f"), _fmt(e["peak_calibrated_gib"], ".2f"),
                     _fmt(e.get("rehearsed_peak_gib"), ".2f"), _fmt(limit, ".2f"), fits,
                     _fmt(e["step_time_s"], ".3g"), _fmt(e.get("rehearsed_step_time_s"), ".3g"), t.status])
    return render(headers, rows)


def rehearsal_table(rows: list[dict]) -> str:
    """One line per rehearsed configuration: peak memory by category, communication, predicted step time."""
    axes = list(dict.fromkeys(k for r in rows for k in r["axis_values"]))
    headers = ["#", "config_id", *(a.split(".")[-1] for a in axes), "world", "method", "params", "grads", "optim",
               "activ", "temp", "peak GiB", "reserved", "comm GB", "busbw", "compute s", "exposed comm s", "step s",
               "trace s", "notes"]
    lines = []
    for r in rows:
        m = r["memory_gib"]
        comm = sum(r["comm_bytes"].values()) / 1e9 if r["comm_bytes"] else None
        busbw = f"{r['busbw_gbps']:.0f} ({r['busbw_source']})" if r.get("busbw_gbps") else "-"
        lines.append([str(r["index"]), r["config_id"], *(str(r["axis_values"].get(a, "")) for a in axes),
                      str(r["world_size"]), r["method"],
                      *(_fmt(m.get(k), ".2f") for k in ("parameters", "gradients", "optimizer_state", "activations",
                                                        "temporaries")),
                      _fmt(r["peak_gib"], ".2f"), _fmt(r.get("reserved_gib"), ".2f"), _fmt(comm, ".1f"), busbw,
                      _fmt(r["compute_s"], ".3g"), _fmt(r["exposed_comm_s"], ".3g"), _fmt(r["step_time_s"], ".3g"),
                      _fmt(r["trace_s"], ".0f"),
                      "; ".join(r["notes"]) or "-"])
    return render(headers, lines)


def estimate_summary(trials: list[PlannedTrial], store_path: str) -> str:
    """What the table adds up to, and where its calibration came from."""
    estimated = [t for t in trials if t.estimate]
    fits = sum(t.estimate["fits"] is True for t in estimated)
    too_big = sum(t.estimate["fits"] is False for t in estimated)
    calibrated = sum(t.estimate["calibration"] is not None for t in estimated)
    unknown = len(estimated) - fits - too_big
    parts = [f"{len(trials)} trials: {fits} fit, {too_big} do not fit"]
    if unknown:
        parts.append(f"{unknown} without a device memory limit (set estimate.gpu or estimate.device_memory_gib)")
    parts.append(f"{sum(t.status == 'skipped' for t in trials)} skipped by pruning")
    parts.append(f"{calibrated} calibrated by measured rows in {store_path}")
    rehearsed = sum(t.estimate.get("peak_basis") == "rehearsed" for t in estimated)
    if rehearsed:
        parts.append(f"{rehearsed} judged by their rehearsal (`raybench rehearse`) instead of the estimate")
    return "; ".join(parts) + (f". Step times are guesses (dense peak x {estimate.ASSUMED_MFU:.0%} MFU), "
                               "not measurements.")
