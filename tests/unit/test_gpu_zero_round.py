"""GPU round 8's sweep (bench/sweeps/gpu-zero-1gpu.yaml: FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 on one GPU) validates and
plans its three points, its CPU twin (gpu-zero-1gpu-cpu.yaml, what the `zero` stage of bench/gpu_truth.sh runs with
RAYBENCH_GPU_ZERO_TWIN=1) is the GPU sweep on another shape, the stage runs the sweep and the summary, and the summary
(bench/zero_round.py) scores each point against both committed tables of
docs/results/gpu-round8-predictions-2026-12-07.md. The twin's run itself is the stage's
(docs/results/gpu-round8-cpu-twin-2026-12-07.md); no trial starts here."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import yaml

from raybench.cli import main as cli
from raybench.planning.plan import plan
from raybench.spec.load import load_sweep
from tests import bench_script
from tests.gpu_rounds import twin_changes

REPO = Path(__file__).resolve().parents[2]
SWEEPS = REPO / "bench" / "sweeps"
GPU, TWIN = SWEEPS / "gpu-zero-1gpu.yaml", SWEEPS / "gpu-zero-1gpu-cpu.yaml"
SCRIPT = REPO / "bench" / "gpu_truth.sh"
RECORD = REPO / "docs" / "results" / "gpu-round8-predictions-2026-12-07.md"
# What the twin may change: its size, its steps, the optimizer (fused AdamW is CUDA's) and the hardware.
TWIN_FIELDS = {"name", "description", "model.preset", "train.steps", "train.warmup_steps", "train.seq_len",
               "train.optimizer", "resources", "estimate.gpu"}


def test_the_gpu_sweep_plans_fsdp2_zero2_and_zero3_on_one_gpu(capsys):
    assert cli.main(["validate", str(GPU)]) == 0, capsys.readouterr().err
    trials = plan(load_sweep(GPU))
    assert [(t.config.train.strategy, t.config.train.zero_stage if t.config.train.strategy == "deepspeed" else None)
            for t in trials] == [("fsdp2", None), ("deepspeed", 2), ("deepspeed", 3)]
    assert {(t.status, t.config.resources.workers, t.config.resources.gpus_per_worker) for t in trials} == {
        ("planned", 1, 1)}


def test_the_twin_is_the_gpu_sweep_on_another_shape():
    assert twin_changes(GPU, TWIN) <= TWIN_FIELDS and "axes" not in twin_changes(GPU, TWIN)
    assert yaml.safe_load(TWIN.read_text())["model"]["preset"] == "tiny"
    assert plan(load_sweep(TWIN))[0].config.resources.gpus_per_worker == 0


def test_the_stage_runs_the_sweep_then_the_summary():
    (body,) = re.findall(r"\nzero_stage\(\) \{\n(.*?)\n\}\n", SCRIPT.read_text(), re.DOTALL)
    assert "sweep=gpu-zero-1gpu" in body and "sweep=$sweep-cpu" in body
    assert 'stage_sweep "$sweep"' in body and "bench/zero_round.py" in body
    assert "    zero) zero_stage ;;" in SCRIPT.read_text()


def test_the_summary_holds_the_records_tables():
    """The predictions the summary scores against are the record's two tables, figure for figure."""
    summary = bench_script.load(REPO / "bench" / "zero_round.py")
    record = RECORD.read_text()
    tables = re.findall(r"\| 0 \| fsdp2 .*?\n\| 1 \| .*?\n\| 2 \| .*?\n", record)
    assert len(tables) == 2
    for which, text in zip(("blind", "re-predicted"), tables):
        for line, name in zip(text.splitlines(), ("fsdp2", "ZeRO-2", "ZeRO-3")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            tensor, reserved, step = float(cells[3]), cells[4], float(cells[5].split()[0])
            p_tensor, p_reserved, p_interval, p_step = summary.PREDICTED[which][name]
            assert (tensor, reserved, step) == (p_tensor, f"{p_reserved:.2f} [{p_interval}]", p_step)


def test_the_summary_scores_each_point_against_both_tables():
    summary = bench_script.load(REPO / "bench" / "zero_round.py")
    rows = pd.DataFrame({
        "trial_id": ["a", "b", "c"], "status": ["ok", "ok", "error"],
        "axis_values_json": ['{"train.strategy": "fsdp2"}',
                             '{"train.strategy": "deepspeed", "train.zero_stage": 2}',
                             '{"train.strategy": "deepspeed", "train.zero_stage": 3}'],
        "peak_alloc_gib": [40.0, 44.0, None], "peak_reserved_gib": [50.0, 52.68, None],
        "step_time_p50_s": [0.5, 0.4, None], "message": [None, None, "RuntimeError: out of memory"]})
    text = summary.report(rows, "gpu-zero-1gpu")
    assert "fsdp2 (a): tensor peak 40.00 GiB, reserved 50.00 GiB, step p50 0.500 s" in text
    assert "blind: tensor 44.04 (+10.1%), reserved 51.08 [46.1-57.2] (+2.2%), step 0.42 (-16.0%)" in text
    assert "re-predicted: tensor 45.41 (+3.2%), reserved 52.68 [47.6-59.0] (+0.0%), step 0.4 (+0.0%)" in text
    assert "ZeRO-3: error" in text and "RuntimeError: out of memory" in text
    assert "ZeRO-2 above fsdp2: +4.00 GiB of tensors (re-predicted +1.37)" in text


def test_the_offload_stage_snapshots_each_offloaded_zero_trial_beside_its_twin_without():
    """The `zero-offload` stage's plan indices are gpu-validate's ZeRO trials: each offloaded one, then the same
    stage without offload, every one on a GPU (the snapshot refuses CPU trials)."""
    script = SCRIPT.read_text()
    (indices,) = re.findall(r"zero-offload\) for index in ([\d ]+);", script)
    trials = plan(load_sweep(SWEEPS / "gpu-validate.yaml"))
    chosen = [trials[int(i)].config for i in indices.split()]
    assert [(c.train.strategy, c.train.zero_stage, c.train.offload) for c in chosen] == [
        ("deepspeed", 2, "optimizer"), ("deepspeed", 2, "none"), ("deepspeed", 3, "optimizer_params"),
        ("deepspeed", 3, "none")]
    assert {c.resources.gpus_per_worker for c in chosen} == {1}
    assert "RAYBENCH_CUDA_MEMORY_SNAPSHOT=$out/zero-offload" in script
