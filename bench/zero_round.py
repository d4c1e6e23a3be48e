"""GPU round 8's summary of its sweep (bench/sweeps/gpu-zero-1gpu.yaml: FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 on one GPU,
Llama-3.2-1B full fine-tune): every point with its peaks and step, what failed and why, then each point's measured
tensor peak, reserved peak and step against the rehearsal's predictions committed before the round ran
(docs/results/gpu-round8-predictions-2026-12-07.md: the blind table, then the table re-predicted the same day after
ZeRO-3's gathered weights changed, still before any GPU ran it). Reads the store as any reader would; writes nothing.

    python3 bench/zero_round.py STORE [--sweep gpu-zero-1gpu]
"""

from __future__ import annotations

import pandas as pd

from round_report import latest as find
from round_report import number, points_table
from round_report import main as round_main
from round_report import report as round_report

# The points by their setup (the twin's are the same setups on the tiny model).
POINTS = {"fsdp2": {"train.strategy": "fsdp2"},
          "ZeRO-2": {"train.strategy": "deepspeed", "train.zero_stage": 2},
          "ZeRO-3": {"train.strategy": "deepspeed", "train.zero_stage": 3}}
# The committed predictions (H100 SXM, shipped constants), as the record's tables hold them: tensor peak GiB,
# reserved GiB and its interval, step s. "blind": at the commit that added the record; "re-predicted": at 631c7e4.
PREDICTED = {
    "blind": {"fsdp2": (44.04, 51.08, "46.1-57.2", 0.420), "ZeRO-2": (45.41, 52.68, "47.6-59.0", 0.400),
              "ZeRO-3": (45.20, 52.43, "47.4-58.7", 0.413)},
    "re-predicted": {"fsdp2": (44.04, 51.08, "46.1-57.2", 0.420), "ZeRO-2": (45.41, 52.68, "47.6-59.0", 0.400),
                     "ZeRO-3": (46.33, 53.74, "48.5-60.2", 0.413)},
}
COLUMNS = ["trial_id", "status", "tok_per_s_per_device", "step_time_p50_s", "peak_alloc_gib", "peak_reserved_gib",
           "est_peak_gib", "trial_wall_s"]


def table(rows: pd.DataFrame) -> str:
    return points_table(rows, COLUMNS)


def error(measured, predicted: float) -> str:
    return "-" if measured is None or pd.isna(measured) else f"{predicted / measured - 1:+.1%}"


def answers(rows: pd.DataFrame) -> list[str]:
    """Each point against both committed tables (error = predicted / measured - 1), and ZeRO-2's and ZeRO-3's
    tensor peaks above FSDP2's against the predicted differences."""
    lines = []
    if rows["peak_alloc_gib"].isna().all():  # the CPU twin: the stage's commands, not the GPU's figures
        lines.append("no GPU peaks in these rows (a CPU run): the predictions below are the H100's, for the format")
    for name, want in POINTS.items():
        row = find(rows, want)
        if row is None or row["status"] != "ok":
            lines.append(f"{name}: {'not run' if row is None else row['status']}")
            continue
        alloc, reserved, step = row["peak_alloc_gib"], row["peak_reserved_gib"], row["step_time_p50_s"]
        lines.append(f"{name} ({row['trial_id']}): tensor peak {number(alloc, '.2f')} GiB, reserved "
                     f"{number(reserved, '.2f')} GiB, step p50 {number(step, '.3f')} s")
        for which, predicted in PREDICTED.items():
            p_alloc, p_reserved, interval, p_step = predicted[name]
            lines.append(f"  {which}: tensor {p_alloc} ({error(alloc, p_alloc)}), reserved {p_reserved} [{interval}] "
                         f"({error(reserved, p_reserved)}), step {p_step} ({error(step, p_step)})")
    base, predicted = find(rows, POINTS["fsdp2"]), PREDICTED["re-predicted"]
    for name in ("ZeRO-2", "ZeRO-3"):
        row = find(rows, POINTS[name])
        if base is not None and row is not None and base["status"] == row["status"] == "ok":
            above = predicted[name][0] - predicted["fsdp2"][0]
            lines.append(f"{name} above fsdp2: {row['peak_alloc_gib'] - base['peak_alloc_gib']:+.2f} GiB of tensors "
                         f"(re-predicted {above:+.2f})")
    return lines


def report(rows: pd.DataFrame, sweep: str) -> str:
    return round_report(rows, sweep, table, answers)


if __name__ == "__main__":
    raise SystemExit(round_main(None, __doc__.splitlines()[0], "gpu-zero-1gpu", report))
