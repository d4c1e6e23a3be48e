"""GPU round 7's sweep (bench/sweeps/gpu-compiled-ac-1gpu.yaml: op-level AC, block AC at 1 and at 1/2, each eager and
compiled, one GPU) validates and plans its six points in the round's order, its CPU twin (gpu-compiled-ac-1gpu-cpu.yaml,
what the `compiled-ac` stage of bench/gpu_truth.sh runs with RAYBENCH_GPU_COMPILED_AC_TWIN=1) is the GPU sweep on
another shape, the stage runs the sweep, its second pass and the summary, and the summary (bench/compiled_ac_round.py)
scores each point and each compiled saving against the committed predictions
(docs/results/gpu-round7-predictions-2026-12-07.md). The twin's run itself is the stage's
(docs/results/gpu-round7-cpu-twin-2026-12-07.md); no trial starts here."""

from __future__ import annotations

import json
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
GPU, TWIN = SWEEPS / "gpu-compiled-ac-1gpu.yaml", SWEEPS / "gpu-compiled-ac-1gpu-cpu.yaml"
SCRIPT = REPO / "bench" / "gpu_truth.sh"
RECORD = REPO / "docs" / "results" / "gpu-round7-predictions-2026-12-07.md"
TWIN_FIELDS = {"name", "description", "model.preset", "train.steps", "train.warmup_steps", "train.seq_len",
               "train.optimizer", "resources", "estimate.gpu"}
ORDER = [("op", "1", False), ("op", "1", True), ("block", "1", False), ("block", "1", True), ("block", "1/2", False),
         ("block", "1/2", True)]


def test_the_gpu_sweep_plans_each_checkpointing_setting_eager_then_compiled(capsys):
    assert cli.main(["validate", str(GPU)]) == 0, capsys.readouterr().err
    trials = plan(load_sweep(GPU))
    assert [(t.config.train.ac_mode, t.config.train.ac_ratio, t.config.train.compile) for t in trials] == ORDER
    assert {(t.status, t.config.resources.gpus_per_worker, t.config.train.ac_saved_ops) for t in trials} == {
        ("planned", 1, None)}  # op-level AC runs torchtitan's policy, as the public compiled rows did


def test_the_twin_is_the_gpu_sweep_on_another_shape():
    assert twin_changes(GPU, TWIN) <= TWIN_FIELDS and "axes" not in twin_changes(GPU, TWIN)
    assert yaml.safe_load(TWIN.read_text())["model"]["preset"] == "tiny"
    assert plan(load_sweep(TWIN))[0].config.resources.gpus_per_worker == 0


def test_the_stage_runs_the_sweep_twice_then_the_summary():
    (body,) = re.findall(r"\ncompiled_ac_stage\(\) \{\n(.*?)\n\}\n", SCRIPT.read_text(), re.DOTALL)
    assert "sweep=gpu-compiled-ac-1gpu" in body and "sweep=$sweep-cpu" in body
    assert 'stage_sweep "$sweep"' in body and "--rerun --quiet" in body and "bench/compiled_ac_round.py" in body
    assert "    compiled-ac) compiled_ac_stage ;;" in SCRIPT.read_text()


def test_the_summary_holds_the_records_table():
    summary = bench_script.load(REPO / "bench" / "compiled_ac_round.py")
    lines = re.findall(r"^\| \d \| (op-level|block) (\S+) \| (yes|no) \| (\S+) \| (\S+) \[(\S+)\] \| \S+ \| (\S+) \[",
                       RECORD.read_text(), re.MULTILINE)
    assert len(lines) == 6
    for kind, ratio, compiled, tensor, reserved, interval, step in lines:
        setting = f"{kind} {ratio}"
        assert summary.PREDICTED[setting, compiled == "yes"] == (float(tensor), float(reserved), interval,
                                                                  float(step))


def test_the_summary_scores_points_savings_and_repeats():
    summary = bench_script.load(REPO / "bench" / "compiled_ac_round.py")
    values = [{"train.ac_mode": m, "train.ac_ratio": r, "train.compile": c} for m, r, c in ORDER]
    rows = pd.DataFrame({
        "trial_id": [f"t{i}" for i in range(6)] + ["t0"], "status": ["ok"] * 5 + ["error", "ok"],
        "axis_values_json": [json.dumps(v) for v in values] + [json.dumps(values[0])],
        "peak_alloc_gib": [45.0, 44.0, 40.0, 40.0, 50.0, None, 46.0],
        "peak_reserved_gib": [52.0, 51.0, 46.0, 46.0, 58.0, None, 53.0],
        "step_time_p50_s": [0.55, 0.45, 0.6, 0.5, 0.55, None, 0.53],
        "message": [None] * 5 + ["torch._dynamo.exc.Unsupported: graph break", None]})
    text = summary.report(rows, "gpu-compiled-ac-1gpu")
    # The op-level eager point ran twice: scored on its latest attempt, both in its spread.
    assert ("op-level 1 eager (t0): tensor peak 46.00 GiB (predicted 46.32, +0.7%), reserved 53.00 GiB (predicted "
            "53.73 [48.5-60.2], +1.4%), step p50 0.530 s (predicted 0.536, +1.1%); 2 runs: tensor peak 45.00-46.00 "
            "GiB, step 0.530-0.550 s") in text
    assert "op-level 1: compiling saved 2.00 GiB of the tensor peak (predicted 0.97)" in text
    assert "block 1: compiling saved 0.00 GiB of the tensor peak (predicted 0.00)" in text
    assert "block 1/2 compiled: error" in text and "block 1/2: no pair to compare (predicted saving 4.00 GiB)" in text
