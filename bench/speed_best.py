"""GPU round 3's summary of a speed sweep (bench/sweeps/gpu-speed-1gpu.yaml): every point's speed, what failed and
why, and the fastest point of each fine-tune with its step profile (train.profile_steps: where a profiled step's
time went) against the round's goals. Reads the store as any reader would; writes nothing.

    python3 bench/speed_best.py STORE [--sweep gpu-speed-1gpu]
"""

from __future__ import annotations

import pandas as pd

from round_report import main as round_main
from round_report import number, point_name, points_table, report as round_report

# Issue 46's goals for round 3: seed 000's LoRA shape in tokens/s per GPU, the 1B full fine-tune in MFU.
GOALS = {"lora": ("tok_per_s_per_device", 70_000), "full": ("mfu", 0.50)}
# What says the point ran as asked besides its speed: the linears FP8 converted, the compiled graphs' breaks.
SPEED_COLUMNS = ["trial_id", "status", "tok_per_s_per_device", "mfu", "step_time_p50_s", "peak_alloc_gib",
                 "peak_reserved_gib", "compile_s", "compile_graph_breaks", "fp8_linears", "loss_first", "loss_final",
                 "trial_wall_s"]
# Where a profiled step's time went (docs/metrics.md, Step profile), in the order the report prints them.
PROFILE_PARTS = ["matmul", "attention", "elementwise", "optimizer", "comm", "idle"]


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
    return round_report(rows, sweep, lambda r: points_table(r, SPEED_COLUMNS), best_text)


if __name__ == "__main__":
    raise SystemExit(round_main(None, __doc__.splitlines()[0], "gpu-speed-1gpu", report))
