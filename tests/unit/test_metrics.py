"""Metric math: percentiles, the FLOP model, MFU, peak table lookups."""

from __future__ import annotations

import numpy as np
import pytest

from raybench import metrics


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
    assert metrics.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert metrics.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert metrics.peak_tflops("NVIDIA H100 NVL", "bf16") is None
    assert metrics.peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert metrics.peak_tflops("Some Future GPU", "bf16") is None
    assert metrics.peak_tflops(None, "bf16") is None
    assert metrics.mfu(1000.0, 6e9, None) is None
    assert metrics.mfu(10_000.0, 6e9, 989.0) == pytest.approx(10_000 * 6e9 / 989e12)
