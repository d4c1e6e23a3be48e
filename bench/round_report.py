"""What the GPU rounds' summaries share (bench/speed_best.py, bench/data_round.py): a sweep's rows read as any
reader would, every point in the order it ran, what failed and why, then the round's own answers.

Not a script: imported by the rounds' summary scripts (bench/ on the path, as Python puts a script's folder).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import pandas as pd

from raybench import read_results


def axis_values(row) -> dict:
    """The row's grid point as the sweep names it (axis_values_json: a stored column may be null for a default
    value, such as train.fp8 off)."""
    text = row.get("axis_values_json")
    return json.loads(text) if isinstance(text, str) else {}


def point_rows(rows: pd.DataFrame, want: dict) -> list:
    """The rows of the point `want` names (axis name -> value), in the order they ran."""
    return [row for _, row in rows.iterrows() if all(axis_values(row).get(k) == v for k, v in want.items())]


def latest(rows: pd.DataFrame, want: dict):
    """The point's last row (its latest attempt), or None."""
    found = point_rows(rows, want)
    return found[-1] if found else None


def point(row) -> dict:
    """axis_values by each field's last name (fp8, not train.fp8)."""
    return {name.split(".")[-1]: value for name, value in axis_values(row).items()}


def point_name(row) -> str:
    return " ".join(f"{name}={value if isinstance(value, str) else json.dumps(value)}"
                    for name, value in point(row).items())


def number(value, spec: str) -> str:
    """A figure, or "-" where the row has none (MFU or reserved GPU memory on a CPU)."""
    return "-" if value is None or pd.isna(value) else format(value, spec)


def points_table(rows: pd.DataFrame, columns: list[str], extra: pd.Series | None = None) -> str:
    """Every point in the order it ran: its axis values, `extra` (a column of the round's own), `columns`."""
    table = pd.DataFrame([point(row) for _, row in rows.iterrows()], index=rows.index)
    if extra is not None:
        table[extra.name] = extra
    table = table.join(rows[[c for c in columns if c in rows]])
    return table.to_string(index=False, float_format=lambda x: f"{x:,.3f}" if abs(x) < 100 else f"{x:,.0f}")


def failures(rows: pd.DataFrame) -> list[str]:
    """What each point that did not end ok said (its message and the error's last lines)."""
    out = []
    for _, row in rows[rows["status"] != "ok"].iterrows():
        detail = row.get("error_detail")
        tail = " | ".join(str(detail).strip().splitlines()[-3:]) if isinstance(detail, str) and detail else ""
        out.append(f"  {row['trial_id']} {point_name(row)}: {row['status']}: {row.get('message') or ''} {tail}".rstrip())
    return out


def report(rows: pd.DataFrame, sweep: str, table: Callable[[pd.DataFrame], str],
           answers: Callable[[pd.DataFrame], list[str]]) -> str:
    """The counts by status, the points `table` prints, what failed, then the round's `answers`."""
    if rows.empty:
        return f"{sweep}: no rows"
    counts = json.dumps(rows["status"].value_counts().to_dict(), sort_keys=True)
    lines = [f"{sweep}: {len(rows)} rows {counts}", table(rows)]
    wrong = failures(rows)
    if wrong:
        lines += ["not ok:", *wrong]
    return "\n".join(lines + answers(rows))


def main(argv, description: str, sweep: str, summary: Callable[[pd.DataFrame, str], str],
         every_attempt: bool = False) -> int:
    """`SCRIPT STORE [--sweep NAME]`: prints `summary` of the sweep's rows in the order they ran (each trial's latest
    attempt, or every_attempt: all of them); exit 1 when no point ended ok."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("store")
    parser.add_argument("--sweep", default=sweep)
    args = parser.parse_args(argv)
    rows = read_results(args.store, args.sweep, latest=not every_attempt)
    print(summary(rows.sort_values("started_at") if not rows.empty else rows, args.sweep))
    return 0 if not rows.empty and (rows["status"] == "ok").any() else 1
