"""A real trial's row carries the plan's memory estimate and the error of that estimate against its measured peak."""

from __future__ import annotations

import math

import pytest

from raybench.cli import main as cli
from raybench.results import store

pytestmark = pytest.mark.integration


def test_trial_row_has_estimate_error(tmp_path, capsys):
    sweep = tmp_path / "estimate.yaml"
    sweep.write_text(f"""
name: estimate
model: {{preset: tiny}}
train: {{steps: 4, warmup_steps: 1, seq_len: 64, micro_batch: 2, precision: fp32, strategy: ddp}}
resources: {{workers: 2, memory_limit_gib: 4}}
store: {tmp_path / 'store'}
estimate: {{device_memory_gib: 8}}
""")
    # The host memory cap has room to spare: it changes nothing (test_faults_torchrun's over-the-cap trial fails
    # as oom; this is its counterpart at the same shape).
    assert cli.main(["trial", str(sweep), "0"]) == 0
    row = store.read_results(tmp_path / "store").iloc[0]
    assert row.status == "ok" and row.est_peak_gib > 0
    assert row.est_peak_calibrated_gib == row.est_peak_gib  # the store had no measured rows to calibrate with
    assert math.isfinite(row.est_peak_error)
    # CPU: the measured peak is host RSS and the whole estimate (process baseline included) is compared with it
    assert row.est_peak_error == pytest.approx(row.peak_rss_gib / row.est_peak_gib - 1)
    assert abs(row.est_peak_error) < 0.5  # a tiny model: the baseline the estimate assumes is most of it
