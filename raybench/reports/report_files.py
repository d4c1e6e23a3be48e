"""Report files: Markdown (tables + PNGs next to it), one self-contained HTML page, or a directory of PNGs.

Every format holds the same content: the per-trial results table, a cross-system comparison when the rows come
from more than one system, and the figures of `raybench.reports.plots`. The CLI imports this module only when a report
file is asked for (matplotlib is slow to import).
"""

from __future__ import annotations

import base64
import html
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from raybench.reports import cluster_health, compare, frames, plots
from raybench.reports.report import repeats_lines, results_rows

DEFAULT_OUT = {"md": "raybench-report.md", "html": "raybench-report.html", "png": "raybench-report"}


def _heading(df: pd.DataFrame, title: str) -> tuple[str, str]:
    """The report's title and its one-line summary (rows by status, systems, when)."""
    ok = int((df["status"] == "ok").sum())
    failed = frames.failure_counts(df)
    counts = f"{len(df)} trial row(s): {ok} ok" + "".join(f", {n} {status}" for status, n in failed.items())
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return title, f"{counts}; systems: {', '.join(sorted(set(frames.system_label(df))))}; generated {stamp}"


def _comparison(df: pd.DataFrame) -> compare.Comparison | None:
    """Systems side by side when the ok rows come from two or more of them."""
    if frames.system_label(frames.ok_rows(df)).nunique() < 2:
        return None
    return compare.compare(df)


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(map(cell, headers)) + " |", "|" + " --- |" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


def _html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _comparison_sections(comparison: compare.Comparison) -> list[tuple[str, list[str], list[list[str]]]]:
    """(caption, headers, rows) of the comparison's tables; empty when nothing matched."""
    if comparison.table.empty:
        return []
    sections = [("Matched configurations", *compare.table_rows(comparison))]
    if comparison.differences:
        sections.append(("Fingerprint differences (what may explain the gap)", *compare.difference_rows(comparison)))
    return sections


def markdown(df: pd.DataFrame, title: str, figures: dict[str, str], health: list[list[str]] = ()) -> str:
    """The report as Markdown; `figures` maps each plot name to the image path written next to the file;
    `health`, the cluster-health section's rows (cluster_health.health_rows)."""
    heading, counts = _heading(df, title)
    headers, rows, note = results_rows(df)
    lines = [f"# {heading}", "", counts, "", "## Results", "", _md_table(headers, rows)]
    lines += ["", f"*{note}*"] if note else []
    repeats = repeats_lines(df)
    lines += ["", "## Repeats (one configuration measured more than once)", "", *(f"-{r[1:]}" for r in repeats)] \
        if repeats else []
    comparison = _comparison(df)
    if comparison is not None:
        lines += ["", f"## Systems: {' vs '.join(comparison.systems)}", ""]
        lines += [f"- {line}" for line in compare.summary_lines(comparison)] or ["No configuration ran ok on "
                                                                                 "every system."]
        for caption, h, r in _comparison_sections(comparison):
            lines += ["", f"### {caption}", "", _md_table(h, r)]
        if comparison.same:
            lines += ["", f"Same on every system: {', '.join(comparison.same)}."]
    if health:
        lines += ["", f"## {cluster_health.CAPTION}", "", _md_table(cluster_health.HEADERS, health)]
    lines += ["", "## Figures"]
    for name, (caption, _) in plots.PLOTS.items():
        lines += ["", f"### {caption}", "", f"![{caption}]({figures[name]})"]
    return "\n".join(lines) + "\n"


_CSS = ("body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}th{background:#f0f0f0}img{max-width:100%}")


def html_page(df: pd.DataFrame, title: str, pngs: dict[str, bytes], health: list[list[str]] = ()) -> str:
    """The report as one HTML page with every figure embedded as a base64 data URI (no other files)."""
    heading, counts = _heading(df, title)
    headers, rows, note = results_rows(df)
    parts = [f"<h1>{html.escape(heading)}</h1>", f"<p>{html.escape(counts)}</p>", "<h2>Results</h2>",
             _html_table(headers, rows)]
    parts += [f"<p><em>{html.escape(note)}</em></p>"] if note else []
    repeats = repeats_lines(df)
    if repeats:
        parts += ["<h2>Repeats (one configuration measured more than once)</h2>",
                  "<ul>" + "".join(f"<li>{html.escape(line.strip())}</li>" for line in repeats) + "</ul>"]
    comparison = _comparison(df)
    if comparison is not None:
        parts.append(f"<h2>Systems: {html.escape(' vs '.join(comparison.systems))}</h2>")
        summary = compare.summary_lines(comparison) or ["No configuration ran ok on every system."]
        parts.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in summary) + "</ul>")
        for caption, h, r in _comparison_sections(comparison):
            parts += [f"<h3>{html.escape(caption)}</h3>", _html_table(h, r)]
        if comparison.same:
            parts.append(f"<p>Same on every system: {html.escape(', '.join(comparison.same))}.</p>")
    if health:
        parts += [f"<h2>{html.escape(cluster_health.CAPTION)}</h2>", _html_table(cluster_health.HEADERS, health)]
    parts.append("<h2>Figures</h2>")
    for name, (caption, _) in plots.PLOTS.items():
        data = base64.b64encode(pngs[name]).decode("ascii")
        parts += [f"<h3>{html.escape(caption)}</h3>", f'<img alt="{html.escape(caption)}" '
                                                      f'src="data:image/png;base64,{data}">']
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(heading)}</title>'
            f"<style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


def write(df: pd.DataFrame, fmt: str, out: str | Path, title: str, health: list[list[str]] = ()) -> list[Path]:
    """Write the report in `fmt` to `out` (a file for md and html, a directory for png); returns the files;
    `health`: the cluster-health section's rows, if any."""
    out = Path(out)
    pngs = plots.render_all(df)
    if fmt == "png":
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"{name}.png" for name in pngs]
        for path, data in zip(paths, pngs.values()):
            path.write_bytes(data)
        return paths
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "html":
        out.write_text(html_page(df, title, pngs, health), encoding="utf-8")
        return [out]
    # Markdown: the figures go next to the file, named after it, and are referenced relatively.
    figures = {name: f"{out.stem}-{name}.png" for name in pngs}
    for name, data in pngs.items():
        (out.parent / figures[name]).write_bytes(data)
    out.write_text(markdown(df, title, figures, health), encoding="utf-8")
    return [out, *(out.parent / f for f in figures.values())]
