"""Text tables: the renderer every table uses, stored results, and query results (table, CSV, JSON)."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import sys
import textwrap


# The three memory figures a trial gets, named alike in `estimate`, `rehearse` and `best --predict`.
PEAKS_LEGEND = ("tensor peak: the most torch's tensors hold at once; reserved: that with the allocator's reserve "
                "(torch's max_memory_reserved); reserved+ctx: reserved plus the CUDA context, what the device holds "
                "and what is held to the limit; analytic: the estimate's sum of parts, before any rehearsal")


SHORTEST_CUT = 24  # a message cut short keeps this much before columns are left out


def render(headers: list[str], rows: list[list[str]], width: int | None = None, droppable: tuple[str, ...] = ()) -> str:
    """An aligned table, one line per row. Where `width` (a terminal's columns) is narrower than that, the table is
    fitted to it rather than wrapped across the screen by the terminal: headers fold at their spaces over their
    columns, the `droppable` columns go, in that order, until it fits, then the last column (free text, such as a
    message) is cut short with "…"; a last line names what was left out."""
    columns = list(range(len(headers)))
    header_lines = [[h] for h in headers]
    if width is None or _width(rows, columns, header_lines) <= width:
        return _aligned(rows, columns, header_lines)
    header_lines = [_folded(h, max((len(r[i]) for r in rows), default=0)) for i, h in enumerate(headers)]
    rows = _cut_last(rows, columns, header_lines, width, SHORTEST_CUT)
    left_out = []
    for name in droppable:
        if _width(rows, columns, header_lines) <= width:
            break
        columns.remove(headers.index(name))
        left_out.append(name)
    rows = _cut_last(rows, columns, header_lines, width, len(headers[columns[-1]]))
    table = _aligned(rows, columns, header_lines)
    if not left_out:
        return table
    note = (f"(left out at this width: {', '.join(left_out)}; `raybench report STORE --format md` shows every "
            "column)")
    return table + "\n" + textwrap.fill(note, width)


def _cut_last(rows, columns, header_lines, width: int, shortest: int) -> list[list[str]]:
    """The rows, the last column's cells cut short with "…" so that the table fits `width`, none below `shortest`."""
    last, over = columns[-1], _width(rows, columns, header_lines) - width
    room = max(shortest, max((len(r[last]) for r in rows), default=0) - over)
    return [[*r[:last], r[last] if len(r[last]) <= room else r[last][:room - 1] + "…", *r[last + 1:]] for r in rows]


def _widths(rows, columns, header_lines) -> list[int]:
    return [max([*(len(line) for line in header_lines[i]), *(len(r[i]) for r in rows)]) for i in columns]


def _width(rows, columns, header_lines) -> int:
    return sum(_widths(rows, columns, header_lines)) + 2 * (len(columns) - 1)


def _folded(header: str, cells: int) -> list[str]:
    """The header's words on as few lines as a column as wide as its cells (or its longest word) holds."""
    lines: list[str] = []
    for word in header.split():
        if lines and len(lines[-1]) + 1 + len(word) <= max([cells, *(len(w) for w in header.split())]):
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines or [header]


def _aligned(rows, columns, header_lines) -> str:
    widths = _widths(rows, columns, header_lines)
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    depth = max(len(header_lines[i]) for i in columns)
    padded = [[""] * (depth - len(header_lines[i])) + header_lines[i] for i in columns]  # folded headers end low
    heads = [line([lines[k] for lines in padded]) for k in range(depth)]
    return "\n".join([*heads, line(["-" * w for w in widths])] + [line([r[i] for i in columns]) for r in rows])


def terminal_width() -> int | None:
    """The columns of the terminal stdout is, or None where it is not one (a pipe, a log): tables are printed whole
    there, one line per row."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def cell(value, spec: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def results_table(df, replaced: int = 0, width: int | None = None) -> str:
    """Stored rows (a DataFrame from read_results) as a table, one line per measurement (fitted to `width`, a
    terminal's columns), then the configurations measured more than once (repeats_lines) and how many earlier
    attempts the table leaves out (`replaced`)."""
    if len(df) == 0:
        return "no results"
    headers, rows, note = results_rows(df)
    notes = [note] if note else []
    if replaced:
        notes.append(f"{replaced} earlier attempt(s) not shown: each replaced by a later attempt of the same trial in "
                     "the same sweep on the same system and GPU type; --all-attempts shows them")
    repeats = repeats_lines(df)
    text = render(headers, rows, width, droppable_columns(headers)) + "".join(f"\n({n})" for n in notes)
    return text + ("\n\nrepeats (one configuration measured more than once):\n" + "\n".join(repeats) if repeats
                   else "")


def droppable_columns(headers: list[str]) -> tuple[str, ...]:
    """The results table's columns a narrow terminal leaves out first, in this order: each details another one or
    the store has it (`raybench report` in Markdown shows every column)."""
    order = ("nonpad tok/s/", "step p90 ms", "sweep", "loss first→final", "step p50 ms")
    return tuple(h for prefix in order for h in headers if h.startswith(prefix))


def repeats_lines(df) -> list[str]:
    """One line per configuration measured more than once on one system and GPU type (by several sweeps, or a
    sweep's `repeats`): its ok runs' throughput as mean ± 95% CI and n, the sweeps that measured it."""
    from raybench.reports import frames
    from raybench.spec.stats import format_ci, mean_ci95

    ok = frames.labelled(frames.ok_rows(df)).dropna(subset=["tok_per_s_per_device"])
    keys = ["system_label", "device_label", "config_id"]
    repeated = ok[ok.groupby(keys)["config_id"].transform("size") > 1]  # before the loop: most groups are one row
    lines = []
    for _, group in repeated.groupby(keys, sort=True):
        mean, n, half = mean_ci95(group["tok_per_s_per_device"].astype(float).tolist())
        sweeps = ", ".join(sorted(group["sweep"].unique()))
        lines.append(f"  {group['config_label'].iloc[0]} on {group['system_label'].iloc[0]} "
                     f"({group['device_label'].iloc[0]}): tok/s {format_ci(mean, n, half)}, sweeps {sweeps}")
    return lines


def results_rows(df) -> tuple[list[str], list[list[str]], str]:
    """Headers, formatted cells (one row per trial) and a note on units, for text, Markdown and HTML tables."""
    from raybench.reports import frames  # pandas: `raybench plan` and `estimate` render tables here without it

    records = (df.assign(system_label=frames.system_label(df))
               .sort_values(["sweep", "started_at", "trial_id"], na_position="last").to_dict("records"))
    axis_values = [json.loads(r["axis_values_json"] or "{}") for r in records]
    axes = list(dict.fromkeys(k for a in axis_values for k in a))
    on_gpu = _on_gpu(records)
    per = "GPU" if on_gpu else "worker"
    by_system = len({r["system_label"] for r in records}) > 1  # a column once a store holds several systems
    headers = ["sweep", *(["system"] if by_system else []), "trial_id", "status", *(a.split(".")[-1] for a in axes),
               f"tok/s/{per}", f"nonpad tok/s/{per}", "step p50 ms", "step p90 ms", "peak GiB", "loss first→final",
               "message"]
    rows = []
    for r, values in zip(records, axis_values):
        peak = r["peak_reserved_gib"] if r["device_type"] == "cuda" else r["peak_rss_gib"]
        loss = f"{cell(r['loss_first'], '.3f')}→{cell(r['loss_final'], '.3f')}" if r["status"] == "ok" else "-"
        rows.append([
            r["sweep"], *([r["system_label"]] if by_system else []), r["trial_id"], r["status"],
            *(str(values.get(a, "")) for a in axes),
            cell(r["tok_per_s_per_device"], ",.0f"), cell(r["nonpad_tok_per_s_per_device"], ",.0f"),
            cell(r["step_time_p50_s"] and r["step_time_p50_s"] * 1000, ".1f"),
            cell(r["step_time_p90_s"] and r["step_time_p90_s"] * 1000, ".1f"),
            cell(peak, ".2f"), loss, (r["message"] or "")[:80],
        ])
    note = "" if on_gpu else "CPU run: throughput is per worker process, not per GPU; peak is host RSS"
    return headers, rows, note


def _on_gpu(records: list[dict]) -> bool:
    """Whether throughput is per GPU: the devices the ok rows ran on or, where none ran, the GPUs the trials
    asked for (a CPU sweep whose trials all failed is still a CPU sweep)."""
    ok = [r for r in records if r["status"] == "ok"]
    if ok:
        return all(r["device_type"] == "cuda" for r in ok)
    return all((r["resources_gpus_per_worker"] or 0) > 0 for r in records)


def format_table(table, fmt: str) -> str:
    """A query result (results.query.run's Arrow table) as `raybench query` prints it: an aligned table, CSV
    with a header, or one JSON object per line."""
    rows = table.to_pylist()
    if fmt == "json":
        return "\n".join(json.dumps(r, default=str) for r in rows)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=table.column_names, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue().rstrip("\n")
    return render(table.column_names, [[_query_cell(r[c]) for c in table.column_names] for r in rows])


def _query_cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
