"""GPU round 7's summary of its sweep (bench/sweeps/gpu-compiled-ac-1gpu.yaml: op-level AC, block AC at 1 and at 1/2,
each eager and compiled, Llama-3.2-1B full fine-tune on one GPU): every point with its peaks and step, what failed and
why, then each point's tensor peak, reserved peak and step against the rehearsal's predictions committed before the
round ran (docs/results/gpu-round7-predictions-2026-12-07.md), and each compiled point's saving against its eager
twin's, measured and predicted. A point run twice (the stage's second pass) is scored on its latest attempt, and its
attempts' spread is printed. Reads the store as any reader would; writes nothing.

    python3 bench/compiled_ac_round.py STORE [--sweep gpu-compiled-ac-1gpu]
"""

from __future__ import annotations

import pandas as pd

from round_report import number, point_rows, points_table
from round_report import main as round_main
from round_report import report as round_report

SETTINGS = {"op-level 1": ("op", "1"), "block 1": ("block", "1"), "block 1/2": ("block", "1/2")}
# The committed predictions (H100 SXM, shipped constants), as the record's table holds them, by (setting, compiled):
# tensor peak GiB, reserved GiB and its interval, step s.
PREDICTED = {("op-level 1", False): (46.32, 53.73, "48.5-60.2", 0.536),
             ("op-level 1", True): (45.35, 52.61, "47.5-58.9", 0.432),
             ("block 1", False): (39.04, 45.28, "40.9-50.7", 0.587),
             ("block 1", True): (39.04, 45.28, "40.9-50.7", 0.483),
             ("block 1/2", False): (51.80, 60.09, "54.3-67.3", 0.537),
             ("block 1/2", True): (47.80, 55.45, "50.1-62.1", 0.443)}
COLUMNS = ["trial_id", "status", "tok_per_s_per_device", "step_time_p50_s", "peak_alloc_gib", "peak_reserved_gib",
           "compile_s", "trial_wall_s"]


def attempts(rows: pd.DataFrame, setting: str, compiled: bool) -> list:
    """The rows of one point, in the order they ran."""
    mode, ratio = SETTINGS[setting]
    want = {"train.ac_mode": mode, "train.ac_ratio": ratio, "train.compile": compiled}
    return point_rows(rows, want)


def table(rows: pd.DataFrame) -> str:
    return points_table(rows, COLUMNS)


def error(measured, predicted: float) -> str:
    return "-" if measured is None or pd.isna(measured) else f"{predicted / measured - 1:+.1%}"


def point_lines(rows: pd.DataFrame, setting: str, compiled: bool) -> list[str]:
    name = f"{setting} {'compiled' if compiled else 'eager'}"
    ran = attempts(rows, setting, compiled)
    if not ran or ran[-1]["status"] != "ok":
        return [f"{name}: {'not run' if not ran else ran[-1]['status']}"]
    row = ran[-1]
    alloc, reserved, step = row["peak_alloc_gib"], row["peak_reserved_gib"], row["step_time_p50_s"]
    p_alloc, p_reserved, interval, p_step = PREDICTED[setting, compiled]
    ok = pd.DataFrame([r for r in ran if r["status"] == "ok"])
    peaks, steps = ok["peak_alloc_gib"], ok["step_time_p50_s"]
    tensor = f"tensor peak {peaks.min():.2f}-{peaks.max():.2f} GiB, " if peaks.notna().any() else ""
    spread = f"; {len(ok)} runs: {tensor}step {steps.min():.3f}-{steps.max():.3f} s" if len(ok) > 1 else ""
    return [f"{name} ({row['trial_id']}): tensor peak {number(alloc, '.2f')} GiB (predicted {p_alloc}, "
            f"{error(alloc, p_alloc)}), reserved {number(reserved, '.2f')} GiB (predicted {p_reserved} [{interval}], "
            f"{error(reserved, p_reserved)}), step p50 {number(step, '.3f')} s (predicted {p_step}, "
            f"{error(step, p_step)}){spread}"]


def saving_line(rows: pd.DataFrame, setting: str) -> str:
    """What compiling saved of the tensor peak under `setting`, measured (latest attempts) and predicted."""
    predicted = PREDICTED[setting, False][0] - PREDICTED[setting, True][0]
    eager, compiled = (attempts(rows, setting, c) for c in (False, True))
    if not (eager and compiled and eager[-1]["status"] == compiled[-1]["status"] == "ok"):
        return f"{setting}: no pair to compare (predicted saving {predicted:.2f} GiB)"
    measured = eager[-1]["peak_alloc_gib"] - compiled[-1]["peak_alloc_gib"]
    return f"{setting}: compiling saved {number(measured, '.2f')} GiB of the tensor peak (predicted {predicted:.2f})"


def answers(rows: pd.DataFrame) -> list[str]:
    lines = []
    if rows["peak_alloc_gib"].isna().all():  # the CPU twin: the stage's commands, not the GPU's figures
        lines.append("no GPU peaks in these rows (a CPU run): the predictions below are the H100's, for the format")
    for setting in SETTINGS:
        lines += point_lines(rows, setting, False) + point_lines(rows, setting, True)
    return lines + [saving_line(rows, setting) for setting in SETTINGS]


def report(rows: pd.DataFrame, sweep: str) -> str:
    return round_report(rows, sweep, table, answers)


if __name__ == "__main__":
    raise SystemExit(round_main(None, __doc__.splitlines()[0], "gpu-compiled-ac-1gpu", report,
                                every_attempt=True))
