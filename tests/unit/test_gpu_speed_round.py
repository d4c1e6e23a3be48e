"""GPU round 3's sweep (bench/sweeps/gpu-speed-1gpu.yaml: FP8, Liger, the full loss and micro-batch 12 beside the bf16
points of seed 000's LoRA and the 1B full fine-tune) validates and plans, each `raybench losses` comparison the
`speed` stage of bench/gpu_truth.sh runs finds the pairs the round is for, its CPU twin (gpu-speed-1gpu-cpu.yaml,
what the stage runs with RAYBENCH_GPU_SPEED_TWIN=1) is the GPU sweep on another shape less what needs CUDA, and the
stage's summary (bench/speed_best.py) names the best point of each fine-tune with its profile. The twin's run itself
is the stage's (docs/results/gpu-round3-cpu-twin-2026-11-28.md); no trial starts here."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from raybench.cli import main as cli
from raybench.planning.plan import plan
from raybench.reports.losses import compare_losses
from raybench.spec.load import load_sweep
from tests import bench_script
from tests.gpu_rounds import flat, planned_rows

REPO = Path(__file__).resolve().parents[2]
SWEEPS = REPO / "bench" / "sweeps"
GPU, TWIN = SWEEPS / "gpu-speed-1gpu.yaml", SWEEPS / "gpu-speed-1gpu-cpu.yaml"
# What the twin may change: its size and shape, the hardware, and compile (inductor on two CPU cores costs minutes).
SHAPE_FIELDS = {"name", "description", "model.preset", "data.pin_memory", "train.steps", "train.warmup_steps",
                "train.seq_len", "train.compile", "resources", "axes"}
# What only CUDA runs: the twin leaves out the points that set it.
CUDA_ONLY = {"train.fp8": "off", "train.liger": False}


def stage_pairs() -> list[tuple[str, str]]:
    """The (axis, baseline) pairs the speed stage of bench/gpu_truth.sh hands to `raybench losses`."""
    script = (REPO / "bench" / "gpu_truth.sh").read_text()
    (body,) = re.findall(r"\nspeed_stage\(\) \{\n(.*?)\n\}\n", script, re.DOTALL)
    (line,) = re.findall(r"for pair in (.*); do", body)
    return [tuple(pair.split("=", 1)) for pair in line.split()]


def test_the_gpu_sweep_validates_and_plans_its_eleven_points(capsys):
    assert cli.main(["validate", str(GPU)]) == 0, capsys.readouterr().err
    trials = plan(load_sweep(GPU))
    assert len(trials) == 11
    assert all(t.config.train.compile and t.config.train.profile_steps > 0 for t in trials)
    assert all(t.config.resources.gpus_per_worker == 1 for t in trials)


def test_each_point_is_one_of_the_fastest_sweeps_but_the_chunked_losss_pair():
    fastest = load_sweep(REPO / "sweeps" / "fastest-1gpu.yaml")
    for trial in plan(load_sweep(GPU)):
        train = trial.config.train
        if train.loss == "full":
            continue
        for field, values in fastest.axes.items():
            assert getattr(train, field.removeprefix("train.")) in values, (trial.trial_id, field)


@pytest.mark.parametrize("axis, baseline", [("train.fp8", "off"), ("train.liger", "false")])
def test_every_fp8_and_liger_point_has_its_bf16_baseline(axis, baseline):
    # A bundle entry naming other fields than its baseline's would group apart and go uncompared: each speed-up
    # point must be found.
    rows = planned_rows(GPU)
    speedups = [t for t in plan(load_sweep(GPU)) if str(t.axis_values[axis]).lower() != baseline]
    found = compare_losses(rows, axis, baseline)
    assert {c.trial_id for c in found} == {t.trial_id for t in speedups}


def test_each_losses_command_of_the_stage_finds_the_rounds_pairs():
    # FP8: tensorwise and rowwise at both fine-tunes; Liger at both; the chunked loss at the full fine-tune.
    rows = planned_rows(GPU)
    counts = {axis: len(compare_losses(rows, axis, baseline)) for axis, baseline in stage_pairs()}
    assert counts == {"train.fp8": 4, "train.liger": 2, "train.loss": 1}


def test_the_stage_compares_fp8_liger_and_the_chunked_loss():
    assert stage_pairs() == [("train.fp8", "off"), ("train.liger", "false"), ("train.loss", "full")]


def test_the_twin_is_the_gpu_sweep_on_another_shape_without_what_needs_cuda(capsys):
    gpu, twin = flat(yaml.safe_load(GPU.read_text())), flat(yaml.safe_load(TWIN.read_text()))
    assert gpu.keys() == twin.keys()
    assert {k for k in gpu if gpu[k] != twin[k]} <= SHAPE_FIELDS
    assert "gpus_per_worker" not in twin["resources"] and gpu["resources"]["gpus_per_worker"] == 1
    # The twin's points: the GPU sweep's in its order, less those that set FP8 or Liger.
    runnable = [p for p in gpu["axes"]["point"] if all(p[k] == v for k, v in CUDA_ONLY.items())]
    assert twin["axes"]["point"] == runnable
    assert cli.main(["validate", str(TWIN)]) == 0, capsys.readouterr().err


def test_on_the_twins_rows_only_the_chunked_loss_has_a_pair():
    rows = planned_rows(TWIN)
    counts = {axis: len(compare_losses(rows, axis, baseline)) for axis, baseline in stage_pairs()}
    assert counts == {"train.fp8": 0, "train.liger": 0, "train.loss": 1}


def axis_values(finetune: str, micro_batch: int, fp8: str = "off") -> str:
    return json.dumps({"train.finetune": finetune, "train.fp8": fp8, "train.liger": False, "train.loss": "chunked",
                       "train.micro_batch": micro_batch}, sort_keys=True)


def speed_rows() -> pd.DataFrame:
    """Rows as the store gives them back: train_fp8 is null for its default, off."""
    points = list(itertools.product(["lora", "full"], [6, 12]))
    rows = pd.DataFrame({
        "trial_id": [f"t{i}" for i in range(len(points))], "status": "ok",
        "axis_values_json": [axis_values(f, m) for f, m in points], "train_finetune": [f for f, _ in points],
        "train_fp8": None, "tok_per_s_per_device": [60_000.0, 72_000.0, 50_000.0, 55_000.0],
        "mfu": [0.36, 0.44, 0.47, 0.52], "step_time_p50_s": 0.2, "profile_step_s": [0.3, 0.4, 0.5, 0.6],
        "profile_matmul_s": 0.3, "profile_attention_s": 0.06, "profile_elementwise_s": 0.1,
        "profile_optimizer_s": 0.02, "profile_comm_s": 0.0, "profile_idle_s": 0.12, "message": None,
        "error_detail": None})
    failed = {**rows.iloc[0].to_dict(), "trial_id": "t9", "status": "error", "axis_values_json":
              axis_values("lora", 6, "tensorwise"), "tok_per_s_per_device": None,
              "message": "RuntimeError: no FP8 kernel",
              "error_detail": "Traceback (most recent call last):\n  ...\nRuntimeError: no FP8 kernel"}
    return pd.concat([rows, pd.DataFrame([failed])], ignore_index=True)


def test_the_summary_names_each_fine_tunes_best_with_its_profile_and_goal():
    speed_best = bench_script.load(REPO / "bench" / "speed_best.py")
    text = speed_best.report(speed_rows(), "gpu-speed-1gpu")
    assert "best lora: finetune=lora fp8=off liger=false loss=chunked micro_batch=12" in text
    assert "72,000 tokens/s/GPU" in text
    assert "goal tok_per_s_per_device >= 70,000: met" in text
    assert "best full: finetune=full fp8=off" in text and "goal mfu >= 0.5: met (0.520)" in text
    assert "matmul 0.3000 s (75%)" in text and "idle 0.1200 s (30%)" in text
    assert "t9 finetune=lora fp8=tensorwise liger=false loss=chunked micro_batch=6: error" in text
    assert "RuntimeError: no FP8 kernel" in text


def test_the_summary_says_a_goal_is_not_met_and_a_missing_profile():
    speed_best = bench_script.load(REPO / "bench" / "speed_best.py")
    rows = speed_rows().assign(profile_step_s=None, mfu=0.40)
    text = speed_best.report(rows, "gpu-speed-1gpu")
    assert "goal mfu >= 0.5: not met (0.400)" in text and "no profile" in text
    assert "goal mfu >= 0.5: no value" in speed_best.report(speed_rows().assign(mfu=None), "gpu-speed-1gpu")
