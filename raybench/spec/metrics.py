"""Pure metric functions: percentiles, throughput, the FLOP model, MFU. No torch, no I/O.

FLOP model (per processed token, forward + backward; activation recomputation is NOT counted, so MFU is
model FLOPs utilization as in PaLM, not hardware FLOPs):
  N   = parameters that take part in matmuls: every weight except the input embedding lookup
        (a tied output head counts once, as the head)
  full fine-tuning: 6N            (forward 2N, backward 4N: activation grads 2N + weight grads 2N)
  LoRA / frozen base: 4N + 2T     (forward 2N, activation grads 2N, weight grads only for the T trainables)
  attention: 12 * L * s * d       (QK^T and AV: 4*s*d per layer forward, twice that backward; no causal discount)
"""

from __future__ import annotations

import math
import statistics


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def step_time_stats(step_times_s: list[float]) -> dict[str, float]:
    return {
        "step_time_p50_s": percentile(step_times_s, 50),
        "step_time_p90_s": percentile(step_times_s, 90),
        "step_time_mean_s": statistics.fmean(step_times_s),
        "step_time_std_s": statistics.pstdev(step_times_s),
    }


def phase_stats(phase_times_s: dict[str, list[float]], step_times_s: list[float]) -> dict[str, float]:
    """p50/p90/mean/std per phase, and how much of the mean step the phases account for (ideally ~1)."""
    stats = {}
    for phase, times in phase_times_s.items():
        stats.update({
            f"phase_{phase}_p50_s": percentile(times, 50),
            f"phase_{phase}_p90_s": percentile(times, 90),
            f"phase_{phase}_mean_s": statistics.fmean(times),
            f"phase_{phase}_std_s": statistics.pstdev(times),
        })
    covered = sum(statistics.fmean(t) for t in phase_times_s.values())
    stats["phase_sum_over_step"] = covered / statistics.fmean(step_times_s)
    return stats


def projection(step_time_s: float, tokens_per_step: int, nonpad_fraction: float, world_size: int,
               dataset_tokens: float | None, epochs: float, total_steps: int | None) -> dict[str, float | None]:
    """Steps, wall hours and device-hours of the user's full run, at this trial's throughput.

    dataset_tokens counts real tokens (no padding), so a step advances by its real tokens,
    tokens_per_step × nonpad_fraction (nonpad_fraction = nonpad_tok_per_s / tok_per_s: 1 for packed data).
    Time per step is the throughput columns' own, tokens_per_step / tok_per_s (the timed window's elapsed time
    over its steps; not the median step):

        projected_steps = ⌈dataset_tokens × epochs / (tokens_per_step × nonpad_fraction)⌉
        projected_hours = dataset_tokens × epochs / (tokens_per_step × nonpad_fraction) × step_time_s / 3600
                        = dataset_tokens × epochs / nonpad_tok_per_s / 3600

    Hours are not rounded up to whole steps, so they equal the run's tokens at the measured real-token rate.
    With total_steps instead: projected_hours = total_steps × step_time_s / 3600.
    """
    if total_steps is None and dataset_tokens is None:
        return {"projected_steps": None, "projected_hours": None, "projected_device_hours": None}
    if total_steps is not None:
        steps, exact_steps = total_steps, total_steps
    else:
        exact_steps = dataset_tokens * epochs / (tokens_per_step * nonpad_fraction)
        steps = math.ceil(exact_steps)
    hours = exact_steps * step_time_s / 3600
    return {"projected_steps": steps, "projected_hours": hours, "projected_device_hours": hours * world_size}


def matmul_params(params_total: int, vocab_size: int, hidden_size: int, tied_embeddings: bool) -> int:
    """Parameters used in matmuls: the input embedding is a lookup, unless it doubles as the output head."""
    return params_total if tied_embeddings else params_total - vocab_size * hidden_size


def flops_per_token(
    matmul_params_n: int, trainable_params: int, full_finetune: bool, num_layers: int, seq_len: int, hidden_size: int
) -> float:
    dense = 6 * matmul_params_n if full_finetune else 4 * matmul_params_n + 2 * trainable_params
    attention = 12 * num_layers * seq_len * hidden_size
    return float(dense + attention)


def mfu(tok_per_s_per_gpu: float, flops_per_tok: float, peak_tflops_per_gpu: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1]; None when the GPU's peak is unknown (CPU runs included)."""
    if peak_tflops_per_gpu is None:
        return None
    return tok_per_s_per_gpu * flops_per_tok / (peak_tflops_per_gpu * 1e12)
