"""GPU round 5's summary of its sweep (bench/sweeps/gpu-leftovers-1gpu.yaml: the public 8B LoRA point and its
dropout-0 point; seed 000's LoRA with the chunked loss against the full loss and against dropout 0.1): every point
with its step per micro-batch and its memory, what failed and why, then the round's answers against what the
rehearsal predicted for an H100 (docs/results/lean-loop-2026-11-28.md). Reads the store as any reader would; writes
nothing.

    python3 bench/leftovers_round.py STORE [--sweep gpu-leftovers-1gpu]
"""

from __future__ import annotations

import pandas as pd

from round_report import axis_values, number, points_table
from round_report import latest as find
from round_report import main as round_main
from round_report import report as round_report

# The points by what the twin keeps of them too (its model is the tiny one): the 8B LoRA is r16 on every linear
# layer, seed 000's r64 on attention and MLP.
PUBLIC = {"train.lora.targets": "all_linear", "train.grad_accum": 16, "train.lora.dropout": 0.1}
NO_DROPOUT = {"train.lora.targets": "all_linear", "train.grad_accum": 1, "train.lora.dropout": 0.0}
SEED000 = {"train.lora.targets": "attention_mlp", "train.lora.dropout": 0.0, "train.loss": "chunked"}
FULL_LOSS = {**SEED000, "train.loss": "full"}
DROPOUT = {**SEED000, "train.lora.dropout": 0.1}
# `raybench rehearse` of this sweep on an H100 SXM (shipped constants, docs/results/gpu-round5-cpu-twin-2026-11-28.md):
# the public point's tensor peak and reservation (lean-loop-2026-11-28.md's, with its interval) and step; the public
# run's own step and speed; and the step per micro-batch of each pair: the public point's 16.6 s over 16 against
# point 1's 0.89 s, seed 000's chunked 0.296 s against full 0.291 s, and dropout 0.1's 0.355 s against 0.296 s.
PREDICTED_ALLOC_GIB, PREDICTED_RESERVED_GIB, PREDICTED_RESERVED_RANGE = 63.73, 73.93, "69.75-78.65"
PREDICTED_STEP_S, PUBLIC_STEP_S, PUBLIC_TOKENS_S = 16.6, 10.5, 12_473
PREDICTED_8B_DROPOUT, PREDICTED_CHUNKED, PREDICTED_1B_DROPOUT = 16.6 / 16 / 0.89, 0.296 / 0.291, 0.355 / 0.296
COLUMNS = ["trial_id", "status", "tok_per_s_per_device", "step_time_p50_s", "peak_alloc_gib", "peak_reserved_gib",
           "est_peak_gib", "model_build_s", "loss_first", "loss_final", "trial_wall_s"]


def micro_batch_step(row) -> float:
    """Seconds per micro-batch: the optimizer step's p50 over its accumulated micro-batches."""
    return row["step_time_p50_s"] / axis_values(row).get("train.grad_accum", 1)


def table(rows: pd.DataFrame) -> str:
    per_micro_batch = pd.Series([micro_batch_step(row) for _, row in rows.iterrows()], index=rows.index,
                                name="s_per_micro_batch")
    return points_table(rows, COLUMNS, per_micro_batch)


def ok(row) -> bool:
    return row is not None and row["status"] == "ok"


def not_ok(name: str, row) -> str:
    return f"{name}: {'not run' if row is None else row['status']}"


def public_point(rows: pd.DataFrame) -> list[str]:
    row = find(rows, PUBLIC)
    if not ok(row):
        return [not_ok("the public 8B point (dropout 0.1, accumulation 16)", row)]
    return [f"the public 8B point (dropout 0.1, accumulation 16, {row['trial_id']}): fits; peak allocated "
            f"{number(row['peak_alloc_gib'], '.2f')} GiB (rehearsed {PREDICTED_ALLOC_GIB}), reserved "
            f"{number(row['peak_reserved_gib'], '.2f')} GiB (rehearsed {PREDICTED_RESERVED_GIB} "
            f"[{PREDICTED_RESERVED_RANGE}])",
            f"  step p50 {number(row['step_time_p50_s'], '.2f')} s (rehearsed {PREDICTED_STEP_S}, the public run "
            f"{PUBLIC_STEP_S}), {number(row['tok_per_s_per_device'], ',.0f')} tokens/s/GPU: "
            f"{row['tok_per_s_per_device'] / PUBLIC_TOKENS_S:.3f}x the public run's {PUBLIC_TOKENS_S:,}"]


def ratio_line(name: str, point, base, predicted: str) -> str:
    """`point`'s seconds per micro-batch against `base`'s, and its tokens/s as a multiple of base's."""
    if not (ok(point) and ok(base)):
        return f"{name}: no pair ({not_ok('point', point)}, {not_ok('baseline', base)})"
    slower = micro_batch_step(point) / micro_batch_step(base)
    speed = point["tok_per_s_per_device"] / base["tok_per_s_per_device"]
    return (f"{name}: {micro_batch_step(point):.4f} against {micro_batch_step(base):.4f} s per micro-batch, "
            f"{slower:.3f}x ({predicted}); tokens/s {speed:.3f}x ({point['trial_id']} vs {base['trial_id']})")


def answers(rows: pd.DataFrame) -> list[str]:
    """The round's questions, one line each (the 8B point's fit and speed in two)."""
    seed000 = find(rows, SEED000)
    return [*public_point(rows),
            ratio_line("LoRA dropout 0.1 against 0 at the 8B, per micro-batch", find(rows, PUBLIC),
                       find(rows, NO_DROPOUT), f"rehearsed {PREDICTED_8B_DROPOUT:.3f}x on an H100"),
            ratio_line("the chunked loss against the full loss at seed 000's LoRA", seed000, find(rows, FULL_LOSS),
                       f"rehearsed {PREDICTED_CHUNKED:.3f}x"),
            ratio_line("LoRA dropout 0.1 against 0 at seed 000's LoRA", find(rows, DROPOUT), seed000,
                       f"rehearsed {PREDICTED_1B_DROPOUT:.3f}x")]


def report(rows: pd.DataFrame, sweep: str) -> str:
    return round_report(rows, sweep, table, answers)


if __name__ == "__main__":
    raise SystemExit(round_main(None, __doc__.splitlines()[0], "gpu-leftovers-1gpu", report))
