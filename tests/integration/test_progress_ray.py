"""Live progress fed by the Ray Tune callback of a real sweep (warm pool executor, tiny model)."""

from __future__ import annotations

import pytest

from raybench.config import parse_sweep
from raybench.plan import plan
from raybench.progress import SweepProgress
from raybench.sweep import ray_cluster, run_planned

pytestmark = pytest.mark.integration


def test_tune_callback_reports_dashboard_starts_and_results(tmp_path):
    spec = parse_sweep({"name": "progress", "model": {"preset": "tiny"}, "executor": "pool",
                        "train": {"steps": 4, "warmup_steps": 1, "seq_len": 32, "precision": "fp32"},
                        "resources": {"workers": 2}, "axes": {"train.micro_batch": [1, 2]}})
    trials = plan(spec)
    lines: list[str] = []
    progress = SweepProgress("lines", write=lines.append)
    with ray_cluster(None):
        run_planned(trials, spec.name, str(tmp_path), "pool", progress=progress)
    assert lines[0].startswith("Ray dashboard: http://127.0.0.1:")
    assert sorted(line.split()[0] for line in lines[1:]) == ["[1/2]", "[2/2]"]
    assert set(progress.states) == {t.trial_id for t in trials}
    for state in progress.states.values():
        assert state.status == "ok" and state.label.startswith("micro_batch=")
        assert state.tok_per_s_per_device > 0 and state.peak_gib > 0  # host RSS on CPU
        assert state.ended_s > state.started_s  # on_trial_start was seen before the result
