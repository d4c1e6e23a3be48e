"""GPU round 3's summary of a speed sweep (bench/sweeps/gpu-speed-1gpu.yaml): every point's speed, what failed and
why, and the fastest point of each fine-tune with its step profile (train.profile_steps: where a profiled step's
time went) against the round's goals. Reads the store as any reader would; writes nothing.

    python3 bench/speed_best.py STORE [--sweep gpu-speed-1gpu]
"""

from __future__ import annotations

import argparse
import json

import pandas as pd

from raybench import read_results

# Issue 46's goals for round 3: seed 000's LoRA shape in tokens/s per GPU, the 1B full fine-tune in MFU.
GOALS = {"lora": ("tok_per_s_per_device", 70_000), "full": ("mfu", 0.50)}
# What says the point ran as asked besides its speed: the linears FP8 converted, the compiled graphs' breaks.
SPEED_COLUMNS = ["trial_id", "status", "tok_per_s_per_device", "mfu", "step_time_p50_s", "peak_alloc_gib",
                 "peak_reserved_gib", "compile_s", "compile_graph_breaks", "fp8_linears", "loss_first", "loss_final",
                 "trial_wall_s"]
# Where a profiled step's time went (docs/metrics.md, Step profile), in the order the report prints them.
PROFILE_PARTS = ["matmul", "attention", "elementwise", "optimizer", "comm", "idle"]


def points_table(rows: pd.DataFrame) -> str:
    """Every point in the order it ran: its axis values, its status and its speed."""
    table = pd.DataFrame([point(row) for _, row in rows.iterrows()], index=rows.index)
    table = table.join(rows[[c for c in SPEED_COLUMNS if c in rows]])
    return table.to_string(index=False, float_format=lambda x: f"{x:,.3f}" if abs(x) < 100 else f"{x:,.0f}")


def point(row) -> dict:
    """The row's grid point as the sweep names it (axis_values_json: a stored column may be null for a default
    value, such as train.fp8 off)."""
    text = row.get("axis_values_json")
    values = json.loads(text) if isinstance(text, str) else {}
    return {name.split(".")[-1]: value for name, value in values.items()}


def failures(rows: pd.DataFrame) -> list[str]:
    """What each point that did not end ok said (its message and the error's last lines)."""
    out = []
    for _, row in rows[rows["status"] != "ok"].iterrows():
        detail = row.get("error_detail")
        tail = " | ".join(str(detail).strip().splitlines()[-3:]) if isinstance(detail, str) and detail else ""
        out.append(f"  {row['trial_id']} {point_name(row)}: {row['status']}: {row.get('message') or ''} {tail}".rstrip())
    return out


def point_name(row) -> str:
    return " ".join(f"{name}={json.dumps(value) if not isinstance(value, str) else value}"
                    for name, value in point(row).items())


def number(value, spec: str) -> str:
    """A figure, or "-" where the row has none (MFU on a CPU)."""
    return "-" if value is None or pd.isna(value) else format(value, spec)


def profile_text(row) -> str:
    """The profile of one row: seconds per profiled step of each part and its share of the profiled step."""
    step = row.get("profile_step_s")
    if step is None or pd.isna(step) or step <= 0:
        return "  no profile (train.profile_steps was 0, or the profiled steps did not run)"
    parts = [f"{part} {row[f'profile_{part}_s']:.4f} s ({row[f'profile_{part}_s'] / step:.0%})"
             for part in PROFILE_PARTS if pd.notna(row.get(f"profile_{part}_s"))]
    return f"  profile, per profiled step of {step:.4f} s: " + ", ".join(parts)


def best_text(rows: pd.DataFrame) -> list[str]:
    """The fastest ok point of each fine-tune (tokens/s per GPU), its profile and its goal."""
    out = []
    ok = rows[rows["status"] == "ok"]
    for finetune, group in ok.groupby("train_finetune", sort=True):
        best = group.sort_values("tok_per_s_per_device", ascending=False).iloc[0]
        out.append(f"best {finetune}: {point_name(best)} ({best['trial_id']}): "
                   f"{number(best['tok_per_s_per_device'], ',.0f')} tokens/s/GPU, MFU {number(best['mfu'], '.3f')}, "
                   f"step {number(best['step_time_p50_s'], '.4f')} s")
        if finetune in GOALS:
            column, goal = GOALS[finetune]
            value = best[column]
            if pd.isna(value):  # MFU on a CPU, or a GPU missing from the peak table
                out.append(f"  goal {column} >= {goal:,}: no value")
            else:
                out.append(f"  goal {column} >= {goal:,}: {'met' if value >= goal else 'not met'} ({value:,.3f})")
        out.append(profile_text(best))
    return out


def report(rows: pd.DataFrame, sweep: str) -> str:
    if rows.empty:
        return f"{sweep}: no rows"
    counts = json.dumps(rows["status"].value_counts().to_dict(), sort_keys=True)
    lines = [f"{sweep}: {len(rows)} rows {counts}", points_table(rows)]
    wrong = failures(rows)
    if wrong:
        lines += ["not ok:", *wrong]
    return "\n".join(lines + best_text(rows))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("--sweep", default="gpu-speed-1gpu")
    args = parser.parse_args(argv)
    rows = read_results(args.store, args.sweep)
    print(report(rows.sort_values("started_at") if not rows.empty else rows, args.sweep))
    return 0 if not rows.empty and (rows["status"] == "ok").any() else 1


if __name__ == "__main__":
    raise SystemExit(main())
