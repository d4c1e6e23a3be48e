"""Metric math: percentiles, the FLOP model, MFU, peak table lookups."""

from __future__ import annotations

import numpy as np
import pytest

from raybench.spec import hardware, metrics
from raybench.spec.schema import RankResult


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [0.31, 0.12, 0.55, 0.2, 0.9, 0.47, 0.33]
    assert metrics.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_step_stats():
    stats = metrics.step_time_stats([1.0, 2.0, 3.0, 4.0])
    assert stats["step_time_p50_s"] == 2.5 and stats["step_time_mean_s"] == 2.5
    assert stats["step_time_std_s"] == pytest.approx(np.std([1, 2, 3, 4]))


def test_flops_full_vs_lora():
    n = metrics.matmul_params(1_000_000, vocab_size=1000, hidden_size=100, tied_embeddings=False)
    assert n == 900_000
    full = metrics.flops_per_token(n, n, True, num_layers=2, seq_len=10, hidden_size=100)
    assert full == 6 * n + 12 * 2 * 10 * 100
    lora = metrics.flops_per_token(n, 1_000, False, num_layers=2, seq_len=10, hidden_size=100)
    assert lora == 4 * n + 2 * 1_000 + 12 * 2 * 10 * 100
    assert lora < full


def test_peak_table_and_mfu():
    assert hardware.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert hardware.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert hardware.peak_tflops("NVIDIA H100 NVL", "bf16") == 835.0
    assert hardware.peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert hardware.peak_tflops("Some Future GPU", "bf16") is None
    assert hardware.peak_tflops(None, "bf16") is None
    # fp16 tensor cores run at the bf16 rate on every listed part, so fp16 rows get an MFU too.
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "AMD Instinct MI300X", "NVIDIA L40S"):
        assert hardware.peak_tflops(name, "fp16") == hardware.peak_tflops(name, "bf16") is not None
    assert hardware.gpu_memory_gib("NVIDIA L40S") == pytest.approx(45.0, abs=0.1)
    assert hardware.gpu_memory_gib("NVIDIA GB200") == pytest.approx(185.0, abs=0.1)  # not B200's 179.1
    assert hardware.gpu_memory_gib("NVIDIA A100-SXM4") is None  # 40 or 80 GB: ambiguous
    assert metrics.mfu(1000.0, 6e9, None) is None
    assert metrics.mfu(10_000.0, 6e9, 989.0) == pytest.approx(10_000 * 6e9 / 989e12)


def test_phase_stats_reconcile_by_hand():
    phases = {"data": [0.01, 0.01], "forward": [0.1, 0.2], "backward": [0.2, 0.4], "optimizer": [0.05, 0.05]}
    stats = metrics.phase_stats(phases, step_times_s=[0.37, 0.66])
    assert stats["phase_forward_p50_s"] == pytest.approx(0.15)
    assert stats["phase_backward_p90_s"] == pytest.approx(0.38)
    assert stats["phase_sum_over_step"] == pytest.approx((0.01 + 0.15 + 0.3 + 0.05) / 0.515)


def test_projection_by_hand():
    # 1e9 real tokens, 2 epochs, 262,144 tokens per step, all real (packed) -> 7,629.4 steps, rounded up to
    # 7,630; hours at 1.5 s per mean step, not rounded to whole steps, on 64 GPUs.
    got = metrics.projection(1.5, 262_144, 1.0, 64, dataset_tokens=1e9, epochs=2, total_steps=None)
    assert got["projected_steps"] == 7630
    assert got["projected_hours"] == pytest.approx(2e9 / (262_144 / 1.5) / 3600)  # tokens / real-token rate
    assert got["projected_device_hours"] == pytest.approx(got["projected_hours"] * 64)
    # A quarter of each step is padding: the same real tokens take 4/3 as many steps.
    padded = metrics.projection(1.5, 262_144, 0.75, 64, dataset_tokens=1e9, epochs=2, total_steps=None)
    assert padded["projected_steps"] == 10173  # ceil(2e9 / 196,608)
    assert padded["projected_hours"] == pytest.approx(2e9 / (0.75 * 262_144 / 1.5) / 3600)
    assert metrics.projection(2.0, 1, 1.0, 8, None, 1, total_steps=1800)["projected_hours"] == pytest.approx(1.0)
    assert metrics.projection(2.0, 1, 1.0, 8, None, 1, None)["projected_hours"] is None


def _measured_row(step_times_s: list[float], tokens_per_step: int, nonpad_tokens: list[int]) -> RankResult:
    """The throughput columns of a row as rank_metrics computes them from the timed steps."""
    timed_s = sum(step_times_s)
    return RankResult.from_columns({**metrics.step_time_stats(step_times_s), "tokens_per_step": tokens_per_step,
                                    "tok_per_s": tokens_per_step * len(step_times_s) / timed_s,
                                    "nonpad_tok_per_s": sum(nonpad_tokens) / timed_s})


def test_row_projection_uses_real_tokens_and_the_mean_step():
    from raybench.drivers.trial import build_row
    from raybench.planning.plan import plan
    from raybench.spec.load import parse_sweep

    spec = parse_sweep({"name": "proj", "model": {"preset": "tiny"}, "resources": {"workers": 2},
                        "projection": {"dataset_tokens": 1e6, "epochs": 2}})
    payload = plan(spec)[0].payload
    steps_s = [1.0, 1.0, 1.6]  # median 1.0 s, mean 1.2 s: the throughput columns use the mean
    packed = build_row(payload, "proj", "ok", "", _measured_row(steps_s, 4096, [4096] * 3))
    padded = build_row(payload, "proj", "ok", "", _measured_row(steps_s, 4096, [3072] * 3))
    assert packed["projected_steps"] == 489  # ceil(2e6 / 4096): every processed token is real
    assert padded["projected_steps"] == 652  # ceil(2e6 / 3072): a quarter of each step is padding
    for row in (packed, padded):
        assert row["projected_hours"] == pytest.approx(2e6 / row["nonpad_tok_per_s"] / 3600)
        assert row["projected_device_hours"] == pytest.approx(row["projected_hours"] * 2)


def test_bus_bandwidth_formula_matches_nccl_tests():
    from raybench.runtime.allreduce import bus_bandwidth_gbps

    # nccl-tests: 8 ranks, 1 GB in 10 ms -> algbw 100 GB/s, busbw = 100 * 2 * 7 / 8 = 175 GB/s.
    assert bus_bandwidth_gbps(10**9, 0.01, 8) == pytest.approx(175.0)
    assert bus_bandwidth_gbps(10**9, 0.01, 2) == pytest.approx(100.0)
