"""`raybench best`: the best configuration per GPU type (or any column) and model, optionally the best value of
one axis (the sAC ratio) per group and model, under a memory cap. Repeats of a configuration are averaged and
shown with their 95% confidence interval. Also `raybench run`'s closing report, with the Pareto front of a
multi-objective run.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from raybench.results import store
from raybench.reports.frames import (
    config_label,
    device_label,
    model_label,
    peak_memory_gib,
    ratio_value,
)
from raybench.reports.report import render, results_table
from raybench.spec.errors import ConfigError, Problem
from raybench.spec.load import load_sweep
from raybench.spec.stats import format_ci, pareto_mask, repeat_summary
from raybench.spec.sweep_settings import default_mode
from raybench.spec.tokenized_data import CUT_LABEL_NOTE_FRAC
from raybench.spec.validate import metric_problem


def resolve_source(source: str, sweep: str | None) -> tuple[str, str | None]:
    """(store directory, sweep name or None) from a store directory or a sweep file (its store and name)."""
    path = Path(source)
    if path.is_file():
        spec = load_sweep(path)
        return spec.store, sweep or spec.name
    if path.is_dir():
        return str(path), sweep
    raise ConfigError(source, [Problem("STORE", source, "neither a result store directory nor a sweep file; "
                                       "pass the store (e.g. ./raybench-results) or the sweep YAML that wrote it")])


def read_rows(store_path: str, sweep: str | None = None) -> pd.DataFrame:
    """The store's measurements (store.MEASUREMENT_SQL): every sweep's, system's and GPU type's, repeats kept."""
    return store.read_results(store_path, sweep)


def axis_column(axis: str, columns: list[str]) -> str | None:
    """The row column of an axis given as `train.ac_ratio`, `train_ac_ratio` or just `ac_ratio`."""
    if axis in columns:
        return axis
    if axis.replace(".", "_") in columns:
        return axis.replace(".", "_")
    config_columns = [c for c, _, _ in store.CONFIG_COLUMNS]
    matches = [c for c in config_columns if c.endswith("_" + axis)]
    return matches[0] if len(matches) == 1 else None


def _group_column(rows: pd.DataFrame, by: str) -> pd.Series:
    # CPU rows have no GPU name: they are grouped as "cpu" rather than dropped.
    if by == "gpu_name":
        return device_label(rows)
    return rows[by].astype(object).where(rows[by].notna(), "-").astype(str)


def summarize(rows: pd.DataFrame, by: str, metric: str) -> pd.DataFrame:
    """One line per (group, configuration) of the ok rows: metric mean/n/95% CI and mean peak memory per device."""
    ok = rows[rows.status == "ok"].copy()
    ok["group"] = _group_column(ok, by)
    ok["model"] = model_label(ok)
    ok["config"] = config_label(ok)
    ok["peak_gib"] = peak_memory_gib(ok)
    # The same configuration measured on two GPU types is two entries (config ids do not name the hardware).
    ok["key"] = ok["group"] + "|" + ok["config_id"]
    ok["peak_gib"] = ok.groupby("key")["peak_gib"].transform("mean")
    summary = repeat_summary(ok.assign(config_id=ok["key"]), metric)
    return summary.rename(columns={f"{metric}_mean": "mean", f"{metric}_n": "n", f"{metric}_ci95": "ci95"})


def under_cap(summary: pd.DataFrame, max_mem_gib: float | None) -> pd.DataFrame:
    """Configurations whose mean peak memory is known and at most the cap (all of them without a cap)."""
    if max_mem_gib is None:
        return summary
    return summary[summary["peak_gib"].notna() & (summary["peak_gib"] <= max_mem_gib)]


def _pick_best(summary: pd.DataFrame, keys: list[str], mode: str) -> pd.DataFrame:
    ordered = summary.sort_values("mean", ascending=mode == "min", kind="stable")
    return ordered.groupby(keys, sort=True).head(1)


def best_configs(rows: pd.DataFrame, *, by: str = "gpu_name", metric: str = "tok_per_s_per_device",
                 mode: str | None = None, max_mem_gib: float | None = None) -> pd.DataFrame:
    """The best configuration per (group, model) under the memory cap, with mean, n, ci95 and peak_gib."""
    fits = under_cap(summarize(rows, by, metric), max_mem_gib)
    return _pick_best(fits, ["group", "model"], mode or default_mode(metric)).sort_values(["group", "model"])


def best_per_axis_value(rows: pd.DataFrame, axis: str, *, by: str = "gpu_name",
                        metric: str = "tok_per_s_per_device", mode: str | None = None,
                        max_mem_gib: float | None = None) -> pd.DataFrame:
    """For each (group, model, value of `axis` column): its best configuration under the cap; `is_best` marks
    the value whose best configuration is best in its (group, model)."""
    mode = mode or default_mode(metric)
    fits = under_cap(summarize(rows, by, metric), max_mem_gib)
    fits = fits.assign(axis_value=fits[axis].astype(str))
    per_value = _pick_best(fits, ["group", "model", "axis_value"], mode)
    winners = set(_pick_best(per_value, ["group", "model"], mode).index)
    return per_value.assign(is_best=per_value.index.isin(winners))


def check_options(rows: pd.DataFrame, by: str, metric: str, axis: str | None,
                  max_mem_gib: float | None) -> tuple[list[Problem], str | None]:
    """Problems with the command's options, and the axis column when it resolves."""
    problems = [p for p in [metric_problem("--metric", metric)] if p]
    if by not in rows.columns:
        problems.append(Problem("--by", by, "not a result column; e.g. gpu_name, system, hostname, gpu_topology"))
    column = None
    if axis is not None:
        column = axis_column(axis, list(rows.columns))
        if column is None:
            problems.append(Problem("--axis", axis, "no such config field; give it as in the sweep file, e.g. "
                                    "train.ac_ratio or ac_ratio"))
    if max_mem_gib is not None and max_mem_gib <= 0:
        problems.append(Problem("--max-mem-gib", max_mem_gib, "must be a positive number of GiB"))
    return problems, column


def best_report(rows: pd.DataFrame, *, by: str = "gpu_name", metric: str = "tok_per_s_per_device",
                mode: str | None = None, axis: str | None = None, max_mem_gib: float | None = None,
                source: str = "best") -> str:
    """The text `raybench best` prints; raises ConfigError for bad options."""
    problems, column = check_options(rows, by, metric, axis, max_mem_gib)
    if problems:
        raise ConfigError(source, problems)
    mode = mode or default_mode(metric)
    cap = f", peak memory <= {max_mem_gib:g} GiB per device" if max_mem_gib is not None else ""
    candidates = under_cap(summarize(rows, by, metric), max_mem_gib)
    once = len(candidates) > 0 and bool((candidates["n"] == 1).all())
    over = "one run per configuration (no interval)" if once else "mean ± 95% CI over repeats (n=1: one run)"
    title = f"best {metric} ({mode}) per {by} and model{cap}; {over}"
    if column is None:
        table = best_configs(rows, by=by, metric=metric, mode=mode, max_mem_gib=max_mem_gib)
        lines = [[r.group, r.model, format_ci(r.mean, r.n, r.ci95, _spec(r.mean)), _gib(r.peak_gib), r.config]
                 for r in table.itertuples()]
        body = render([by, "model", metric, "peak GiB", "configuration"], lines)
    else:
        table = best_per_axis_value(rows, column, by=by, metric=metric, mode=mode, max_mem_gib=max_mem_gib)
        dotted = {c: ".".join(path) for c, path, _ in store.CONFIG_COLUMNS}.get(column, column)
        short = dotted.split(".")[-1]
        lines, winners = [], []
        for (group, model), part in table.groupby(["group", "model"], sort=True):
            others = dict(zip(part.axis_value, config_label(part, leave_out=(dotted,))))  # the axis has its column
            by_value = dict(zip(part.axis_value, part.itertuples()))
            for value in sorted(by_value, key=_value_order):
                r = by_value[value]
                lines.append([group, model, f"{value} *" if r.is_best else value,
                              format_ci(r.mean, r.n, r.ci95, _spec(r.mean)), _gib(r.peak_gib), others[value]])
                if r.is_best:
                    winners.append(f"best {short} for {group} / {model}: {value}")
        body = render([by, "model", short, f"best {metric}", "peak GiB", "its configuration"], lines)
        if winners:
            body += "\n\n" + "\n".join(winners)
    if len(table) == 0:
        return f"{title}\nno ok rows{' under the memory cap' if cap else ''}"
    unsettled = unsettled_lines(candidates, mode)
    return f"{title}\n{body}" + ("\n\n" + "\n".join(unsettled) if unsettled else "")


def unsettled_lines(candidates: pd.DataFrame, mode: str) -> list[str]:
    """Per (group, model), a line where the best configuration is not settled against the runner-up: either ran
    once (a single run can rank the other way on the next), or their 95% intervals overlap; and how to settle it."""
    lines = []
    for (group, model), part in candidates.groupby(["group", "model"], sort=True):
        if len(part) < 2:
            continue
        best, runner = part.sort_values("mean", ascending=mode == "min", kind="stable").iloc[:2].itertuples()
        if min(best.n, runner.n) == 1:
            why = "one of the two ran once"
        elif _overlap(best, runner):
            why = "their 95% intervals overlap"
        else:
            continue
        lines.append(f"{group} / {model}: not settled: the best ({best.config}, "
                     f"{format_ci(best.mean, best.n, best.ci95, _spec(best.mean))}) against the runner-up "
                     f"({runner.config}, {format_ci(runner.mean, runner.n, runner.ci95, _spec(runner.mean))}): "
                     f"{why}; run the sweep again with `repeats: 3` (its stored runs count as the first)")
    return lines


def _overlap(a, b) -> bool:
    return a.mean - a.ci95 <= b.mean + b.ci95 and b.mean - b.ci95 <= a.mean + a.ci95


def _value_order(value: str) -> tuple:
    """Numbers and fractions by value ("1/2" before "1"), then other values by name."""
    number = ratio_value(value)
    return (number is None, number or 0.0, value)


def _spec(value: float) -> str:
    return ",.0f" if abs(value) >= 100 else ".4g"


def _gib(value) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:.2f}"


def front_report(rows: pd.DataFrame, objectives: list[tuple[str, str]]) -> str:
    """The Pareto front (single objective: the best configuration) of a sweep's ok rows, repeats averaged."""
    metrics = [m for m, _ in objectives]
    ok = rows[(rows.status == "ok")].dropna(subset=metrics)
    if len(ok) == 0:
        return "no ok rows with " + ", ".join(metrics)
    means = ok.groupby("config_id")[metrics].mean()
    front = means[pareto_mask(means.to_numpy().tolist(), [mode for _, mode in objectives])]
    front = front.sort_values(metrics[0], ascending=objectives[0][1] == "min")
    labels = config_label(ok.drop_duplicates("config_id").set_index("config_id").loc[front.index].reset_index())
    lines = [[label, *(format(v, _spec(v)) for v in values)] for label, values in zip(labels, front.to_numpy())]
    what = "Pareto front" if len(objectives) > 1 else "best"
    head = ", ".join(f"{m} ({mode})" for m, mode in objectives)
    return f"{what} of {len(means)} configuration(s) over {head}:\n" + render(["configuration", *metrics], lines)


def run_report(rows, run_ids: set[str], search, store_path: str, width: int | None = None,
               quiet: bool = False) -> tuple[str, int]:
    """`raybench run`'s closing report: the sweep's stored rows (fitted to `width`, a terminal's columns), the front
    of a search's objectives (`search`, the sweep's search section), and how many of the trials this run ran
    (`run_ids`) ended not ok; (text, that count). quiet (`run --quiet`, batch jobs): no table and no front, only
    what needs a look (a line per trial of this run that ended not ok, the data cuts) and the closing line."""
    ran = rows[rows.trial_id.isin(run_ids)]
    not_ok = ran[ran.status != "ok"]
    parts = []
    if not quiet:
        parts.append(results_table(rows, width=width))
        if search.algo != "grid" or not isinstance(search.metric, str):
            parts.append(front_report(rows, search.objectives()))
    elif len(not_ok):
        parts.append("\n".join(f"{r.trial_id}: {r.status}" + (f": {r.message}" if r.message else "")
                                for r in not_ok.itertuples()))
    cut = cut_report(ran)
    if cut:
        parts.append(cut)
    table = f" (`raybench report {store_path}` for the table)" if quiet else ""
    parts.append(f"{len(ran)} trial(s) run, {len(not_ok)} not ok; results in {store_path}{table}")
    return "\n\n".join(parts), len(not_ok)


def cut_report(rows) -> str | None:
    """The trials whose data.overflow cut more than CUT_LABEL_NOTE_FRAC of the label tokens, one line each (None:
    none did): what they trained on is less than the data holds."""
    if "label_tokens_cut_frac" not in rows:
        return None
    cut = rows[rows.label_tokens_cut_frac.fillna(0) > CUT_LABEL_NOTE_FRAC]
    if cut.empty:
        return None
    # The default, truncate, is stored as null (a missing value to pandas).
    lines = [f"{r.trial_id}: data.overflow {r.data_overflow if isinstance(r.data_overflow, str) else 'truncate'} "
             f"at seq_len {r.train_seq_len} cut "
             f"{r.samples_cut} samples, {r.tokens_cut} tokens, {r.label_tokens_cut_frac:.1%} of the label tokens"
             for r in cut.itertuples()]
    return "\n".join(["data cut by data.overflow (a longer train.seq_len keeps more; so do, for hf data, "
                       "data.overflow split and, for json data, data.packing true with truncate):", *lines])
