"""`raybench calibrate`: a CPU calibration stores a profile with positive figures and a CPU rehearsal is priced
with it; a planted GPU profile replaces the shipped constants for that GPU, and every row names what priced it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from raybench.cli.main import main
from raybench.rehearse import fitted, roofline
from raybench.results import profiles

TINY_TRAIN = {"steps": 2, "warmup_steps": 1, "seq_len": 64, "micro_batch": 1, "precision": "fp32",
              "strategy": "fsdp2"}


def write_sweep(tmp_path, resources: dict, **sections) -> str:
    sweep = tmp_path / "s.yaml"
    sweep.write_text(json.dumps({"name": "cal", "model": {"preset": "tiny"}, "train": TINY_TRAIN,
                                 "resources": resources, "store": str(tmp_path / "store"), **sections}))
    return str(sweep)


def test_cpu_calibration_is_stored_and_prices_a_cpu_rehearsal(tmp_path, capsys):
    store = tmp_path / "store"
    start = time.perf_counter()
    assert main(["calibrate", "--device", "cpu", "--quick", "--store", str(store), "--json"]) == 0
    assert time.perf_counter() - start < 15
    printed = json.loads(capsys.readouterr().out)
    stored = profiles.load_profile(store, "cpu")
    assert printed["path"] == str(store / "calibration" / "CPU.json") and stored["fingerprint"]["key"] == "CPU"
    assert stored["fingerprint"]["torch_version"] == torch.__version__ and stored["duration_s"] > 0
    assert all(g["flop_per_s"] > 0 for g in stored["matmul"]) and stored["bandwidth_bytes_per_s"] > 0
    assert stored["launch_s"] > 0 and stored["allocator_reserve"] == 1.0
    derived = stored["derived"]  # a CPU has no table row: its measured figures are its roofline's peaks
    assert derived["peaks_flop_per_s"]["fp32"] == max(g["flop_per_s"] for g in stored["matmul"] if g["dtype"] == "fp32")
    assert derived["efficiency"] == pytest.approx(fitted.step_share())

    # The text report says what it measured and where it stored it.
    assert main(["calibrate", "--device", "cpu", "--quick", "--store", str(store)]) == 0
    text = capsys.readouterr().out
    assert "matmul fp32 256x256x256" in text and "launch cost" in text and f"stored in {store}/calibration" in text

    assert main(["rehearse", write_sweep(tmp_path, {"workers": 2}), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    source = f"profile: CPU {stored['date']}"
    assert f"priced with {source}" in row["notes"] and row["calibration"]["source"] == source
    assert row["step_time_s"] > 0 and row["reserved_gib"] == row["peak_gib"]  # the CPU roofline prices the step


def planted_h100(store, reserve: float) -> dict:
    """An H100 profile as `raybench calibrate` would store it, with its own allocator reserve."""
    measured = {"matmul_fraction": {"bf16": 0.803, "fp32": 0.9}, "bandwidth_fraction": 0.9,
                "matmul_flop_per_s": {"bf16": 794e12, "fp32": 60e12}, "bandwidth_bytes_per_s": 3.0e12,
                "allocator_reserve": reserve, "launch_s": 5e-6}
    profile = {"fingerprint": {"key": profiles.profile_key("NVIDIA H100 80GB HBM3")}, "date": "2026-11-26",
               **measured, "derived": fitted.derive(measured)}
    profiles.save_profile(store, profile)
    return profile


def test_a_planted_gpu_profile_replaces_the_shipped_constants(tmp_path, capsys):
    sweep = write_sweep(tmp_path, {"workers": 8, "gpus_per_worker": 1}, estimate={"gpu": "H100 SXM"})
    assert main(["rehearse", sweep, "--json"]) == 0
    shipped = json.loads(capsys.readouterr().out)
    assert "priced with shipped H100 constants" in shipped["notes"]
    assert shipped["reserved_gib"] == pytest.approx(shipped["peak_gib"] * fitted.ALLOCATOR_RESERVE)

    planted_h100(tmp_path / "store", reserve=1.40)
    assert main(["rehearse", sweep, "--json"]) == 0
    profiled = json.loads(capsys.readouterr().out)
    assert "priced with profile: H100 2026-11-26" in profiled["notes"]
    assert profiled["peak_gib"] == shipped["peak_gib"]
    # Its measured reserve is recorded, not priced: a small model's steps do not reserve what a real one's do.
    assert profiled["reserved_gib"] == pytest.approx(profiled["peak_gib"] * fitted.ALLOCATOR_RESERVE)
    assert profiled["calibration"]["reserve"] == fitted.ALLOCATOR_RESERVE
    # The profile's matmul fraction is the H100's table figure: FLOPs cost what the shipped constant says; bytes
    # run at 0.9 of the bandwidth x the step share, faster than the shipped 0.70.
    efficiency = profiled["calibration"]["efficiency"]
    assert profiled["roofline_s"] / efficiency < shipped["roofline_s"] / fitted.ROOFLINE_EFFICIENCY
    # Its launch cost prices the host's kernel launches (the shipped constants do not), and this tiny step is
    # host-bound: its compute is the longer of the two.
    assert shipped["host_s"] is None and profiled["host_s"] == pytest.approx(profiled["launches"] * 5e-6)
    assert profiled["compute_s"] == pytest.approx(max(profiled["host_s"], profiled["roofline_s"] / efficiency))
    assert profiled["host_s"] > profiled["roofline_s"] / efficiency

    assert main(["rehearse", sweep]) == 0
    assert "priced with: profile: H100 2026-11-26" in capsys.readouterr().out
    assert main(["best", sweep, "--predict", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["priced_with"] == ["profile: H100 2026-11-26"]


def test_the_shipped_calibration_prices_as_the_constants_did():
    """Without a profile the roofline is the one the constants were fitted with: bytes at the table's
    bandwidth, tensor-core peaks scaled by matmul_efficiency_ratio, the step over ROOFLINE_EFFICIENCY."""
    gpu = "NVIDIA A100-SXM4-80GB"
    shipped = roofline.gpu_roofline(gpu)
    assert shipped.bandwidth == pytest.approx(2.039e12)
    assert shipped.peaks[torch.bfloat16] == pytest.approx(312e12 * roofline.matmul_efficiency_ratio(gpu))
    measured = {"matmul_fraction": {"bf16": 0.8}, "bandwidth_fraction": 0.9, "matmul_flop_per_s": {},
                "bandwidth_bytes_per_s": 1.8e12, "allocator_reserve": 1.2, "launch_s": 4e-6}
    calibrated = fitted.Calibration.from_profile({"fingerprint": {"key": "A100 80GB"}, "date": "2026-11-26",
                                                  **measured, "derived": fitted.derive(measured)})
    profiled = roofline.gpu_roofline(gpu, calibrated)
    # FLOPs at 0.8 of the peak x step share, bytes at 0.9 of the bandwidth x step share, once over efficiency.
    assert profiled.peaks[torch.bfloat16] * calibrated.efficiency == pytest.approx(312e12 * 0.8 * fitted.step_share())
    assert profiled.bandwidth * calibrated.efficiency == pytest.approx(2.039e12 * 0.9 * fitted.step_share())
    assert profiles.profile_key("H100 SXM") == profiles.profile_key("NVIDIA H100 80GB HBM3") == "H100"
    assert profiles.profile_key(None) == profiles.profile_key("cpu") == "CPU"
