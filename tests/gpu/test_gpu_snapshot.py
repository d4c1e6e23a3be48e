"""RAYBENCH_CUDA_MEMORY_SNAPSHOT on a GPU: the replayed peak of a real trial is the allocator's own peak, and the
file says what held it."""

from __future__ import annotations

import json

import pytest
import torch

from raybench.drivers.executors import torchrun
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_recorded_trial_says_what_held_its_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYBENCH_CUDA_MEMORY_SNAPSHOT", str(tmp_path / "snap"))
    spec = parse_sweep({"name": "gpu-snapshot", "model": {"preset": "tiny"},
                        "train": {"strategy": "ddp", "steps": 4, "warmup_steps": 1, "seq_len": 256,
                                  "precision": "bf16"}, "resources": {"workers": 1, "gpus_per_worker": 1}})
    (trial,) = plan(spec)
    measured = torchrun.execute(trial.payload).metrics
    (peak_file,) = (tmp_path / "snap").glob(f"{trial.trial_id}-*-peak.json")
    assert peak_file.with_name(peak_file.name.replace("-peak.json", ".pickle")).stat().st_size > 0
    peak = json.loads(peak_file.read_text())
    # The recording starts before the build: everything the training peak holds was allocated under it. The
    # file's peak is the training window's, the row's; the warm-up's and the build's may be higher (on an H100
    # this tiny trial's whole recording peaked at 0.097 GiB, its training at 0.034).
    assert peak["window"] == "training" and peak["history_complete"]
    assert peak["peak_gib"] == pytest.approx(measured.peak_alloc_gib, rel=0.02)
    assert peak["recording_peak_gib"] >= peak["peak_gib"]
    where = " ".join(g["allocated_at"] for g in peak["groups"])
    assert "modeling_llama.py" in where and "parallel/distributed.py" in where  # activations; DDP's buckets
