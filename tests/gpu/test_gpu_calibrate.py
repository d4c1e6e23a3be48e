"""`raybench calibrate` on a GPU: the full calibration finishes within 2 minutes, its figures are physical, and a
rehearsal for that GPU is priced with the stored profile."""

from __future__ import annotations

import json
import time

import pytest
import torch

from raybench.cli.main import main
from raybench.rehearse import fitted
from raybench.results import profiles

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_full_gpu_calibration_is_physical_and_prices_its_gpu(tmp_path, capsys):
    store = tmp_path / "store"
    start = time.perf_counter()
    assert main(["calibrate", "--device", "cuda", "--store", str(store), "--json"]) == 0
    assert time.perf_counter() - start < 120
    profile = json.loads(capsys.readouterr().out)
    name = torch.cuda.get_device_name()
    assert profiles.load_profile(store, name)["measured_at"] == profile["measured_at"]
    assert profile["fingerprint"]["device_count"] == torch.cuda.device_count()
    assert all(g["flop_per_s"] > 0 for g in profile["matmul"]) and profile["launch_s"] > 0
    if profile["fingerprint"]["table_row"]:  # a GPU of the hardware table: fractions of its peaks
        bf16 = [g["fraction_of_peak"] for g in profile["matmul"] if g["dtype"] == "bf16"]
        assert all(0 < f <= 1.05 for f in bf16), bf16
        assert 0 < profile["bandwidth_fraction"] <= 1.05
        assert 0 < profile["derived"]["efficiency"] <= 1.05
    assert profile["allocator_reserve"] >= 1.0 and profile["derived"]["reserve"] == fitted.ALLOCATOR_RESERVE

    sweep = tmp_path / "s.yaml"
    sweep.write_text(json.dumps({
        "name": "cal", "model": {"preset": "tiny"}, "store": str(store), "estimate": {"gpu": name},
        "train": {"steps": 2, "warmup_steps": 1, "seq_len": 64, "micro_batch": 1, "precision": "bf16",
                  "strategy": "fsdp2"}, "resources": {"workers": 2, "gpus_per_worker": 1}}))
    assert main(["rehearse", str(sweep), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    key = profile["fingerprint"]["key"]
    assert f"priced with profile: {key} {profile['date']}" in row["notes"]
    assert row["reserved_gib"] == pytest.approx(row["peak_gib"] * fitted.ALLOCATOR_RESERVE)
