"""GPU round 4's summary of its sweep (bench/sweeps/gpu-data-1gpu.yaml: seed 000's LoRA on chat data, packed against
padded rows, sdpa's dense mask against FlexAttention's block mask, 0, 2 and 4 loader workers): every point's real
(non-padding) tokens/s against the baseline point's, the loader's wait, the memory, and what failed and why. Reads
the store as any reader would; writes nothing.

    python3 bench/data_round.py STORE [--sweep gpu-data-1gpu]
"""

from __future__ import annotations

import json

import pandas as pd

from round_report import axis_values, number, point_name, points_table
from round_report import main as round_main
from round_report import report as round_report

# The point every other is measured against: packed rows, sdpa, each 2048 wide, 2 loader workers.
BASELINE = {"model.attn_implementation": "sdpa", "data.packing": True, "data.pad_to": "seq_len",
            "data.num_workers": 2}
# Real tokens, not positions: a padded row's padding is no work done for the user.
SPEED = "nonpad_tok_per_s_per_device"
COLUMNS = ["trial_id", "status", SPEED, "tok_per_s_per_device", "nonpad_tokens_per_step", "step_time_p50_s",
           "phase_data_p50_s", "peak_alloc_gib", "peak_reserved_gib", "loss_first", "loss_final", "trial_wall_s"]


def measured(row) -> str:
    return (f"data phase p50 {number(row['phase_data_p50_s'], '.4f')} s, "
            f"peak reserved {number(row['peak_reserved_gib'], '.2f')} GiB")


def baseline_row(rows: pd.DataFrame):
    """The ok row of the baseline point, or None (it failed or has not run)."""
    for _, row in rows[rows["status"] == "ok"].iterrows():
        if all(axis_values(row).get(k) == v for k, v in BASELINE.items()):
            return row
    return None


def table(rows: pd.DataFrame) -> str:
    """Every point in the order it ran: its axis values, status, speed against the baseline's, loader wait, memory."""
    base = baseline_row(rows)
    against = None
    if base is not None and pd.notna(base[SPEED]) and base[SPEED] > 0:
        against = (rows[SPEED] / base[SPEED]).rename("x_baseline")
    return points_table(rows, COLUMNS, against)


def answers(rows: pd.DataFrame) -> list[str]:
    """The round's questions, one line each: every ok point that differs from the baseline in one field."""
    base = baseline_row(rows)
    if base is None:
        return ["no ok baseline point (packed, sdpa, seq_len wide, 2 workers): no comparison"]
    out = [f"baseline {point_name(base)}: {base[SPEED]:,.0f} real tokens/s/GPU, {measured(base)}"]
    for _, row in rows[rows["status"] == "ok"].iterrows():
        changed = {k: v for k, v in axis_values(row).items() if BASELINE.get(k) != v}
        if not changed:
            continue
        what = " ".join(f"{k.split('.')[-1]}={v if isinstance(v, str) else json.dumps(v)}" for k, v in changed.items())
        out.append(f"  {what}: {row[SPEED] / base[SPEED]:.3f}x the baseline's real tokens/s ({row[SPEED]:,.0f}), "
                   f"{measured(row)}")
    return out


def report(rows: pd.DataFrame, sweep: str) -> str:
    return round_report(rows, sweep, table, answers)


if __name__ == "__main__":
    raise SystemExit(round_main(None, __doc__.splitlines()[0], "gpu-data-1gpu", report))
