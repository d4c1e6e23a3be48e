"""GPU round 4's sweep (bench/sweeps/gpu-data-1gpu.yaml: seed 000's LoRA on the round's chat data; packed sdpa, padded
rows, packed flex_attention, loader workers) validates and plans next to the files the `data` stage of
bench/gpu_truth.sh writes, its points run the most wanted first, each `raybench losses` comparison of the stage
finds the pairs the round is for, its CPU twin (gpu-data-1gpu-cpu.yaml, what the stage runs with
RAYBENCH_GPU_DATA_TWIN=1) is the GPU sweep on another shape less what needs CUDA, and the stage's summary
(bench/data_round.py) sets every point against the baseline. The twin's run itself is the stage's
(docs/results/gpu-round4-cpu-twin-2026-11-28.md); no trial starts here."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from raybench.cli import main as cli
from raybench.planning.plan import plan
from raybench.reports.losses import compare_losses
from raybench.spec.load import load_sweep
from tests import bench_script
from tests.gpu_rounds import flat, planned_rows, write_round_data

REPO = Path(__file__).resolve().parents[2]
SWEEPS = REPO / "bench" / "sweeps"
GPU, TWIN = "gpu-data-1gpu", "gpu-data-1gpu-cpu"
# What the twin may change: where its files are, their size and shape, and the hardware (not its precision).
SHAPE_FIELDS = {"name", "description", "model.path", "data.path", "data.tokenizer", "data.pin_memory", "train.steps",
                "train.warmup_steps", "train.seq_len", "train.micro_batch", "resources", "axes"}
# What only CUDA runs: the twin leaves out the points that set it.
CUDA_ONLY = {"model.attn_implementation": "flex_attention"}


def raw(name: str) -> dict:
    return yaml.safe_load((SWEEPS / f"{name}.yaml").read_text())


def stage_pairs() -> list[tuple[str, str]]:
    """The (axis, baseline) pairs the data stage of bench/gpu_truth.sh hands to `raybench losses`."""
    script = (REPO / "bench" / "gpu_truth.sh").read_text()
    (body,) = re.findall(r"\ndata_stage\(\) \{\n(.*?)\n\}\n", script, re.DOTALL)
    (line,) = re.findall(r"for pair in (.*); do", body)
    return [tuple(pair.split("=", 1)) for pair in line.split()]


@pytest.fixture(scope="module")
def round_files(tmp_path_factory) -> Path:
    """bench/sweeps as the GPU machine has it after the stage wrote its files: for the GPU sweep, the 1B's
    config.json beside an empty safetensors file (planning reads the config only) and the chat data (fewer chats);
    the twin's files as the stage's own script writes them."""
    sweeps = tmp_path_factory.mktemp("clone") / "sweeps"
    sweeps.mkdir()
    for name in (GPU, TWIN):
        shutil.copy(SWEEPS / f"{name}.yaml", sweeps / f"{name}.yaml")
    write_round_data(sweeps)
    return sweeps


def test_the_gpu_sweep_validates_and_plans_its_six_eager_points(round_files, capsys):
    assert cli.main(["validate", str(round_files / f"{GPU}.yaml")]) == 0, capsys.readouterr().err
    trials = plan(load_sweep(round_files / f"{GPU}.yaml"))
    assert [t.status for t in trials] == ["planned"] * 6
    for trial in trials:
        config = trial.config
        assert config.resources.gpus_per_worker == 1 and not config.train.compile
        assert config.data.source == "hf" and config.data.pin_memory
        assert config.model.path.endswith("example-data/stack-round/model")


def test_the_twin_validates_and_plans_on_the_stages_files(round_files, capsys):
    assert cli.main(["validate", str(round_files / f"{TWIN}.yaml")]) == 0, capsys.readouterr().err
    assert len(plan(load_sweep(round_files / f"{TWIN}.yaml"))) == 5


def test_the_points_run_packed_against_padded_first_then_flex_then_the_loader():
    points = raw(GPU)["axes"]["point"]
    short = [(p["model.attn_implementation"], p["data.packing"], p["data.pad_to"], p["data.num_workers"])
             for p in points]
    assert short == [("sdpa", True, "seq_len", 2), ("sdpa", False, "longest", 2), ("flex_attention", True, "seq_len", 2),
                     ("sdpa", True, "seq_len", 0), ("sdpa", True, "seq_len", 4), ("sdpa", False, "seq_len", 2)]
    assert len({tuple(sorted(p)) for p in points}) == 1  # every entry names the same fields


def test_the_base_is_seed_000s_lora_point_of_the_speed_round_on_round_2s_data():
    base, speed, stack = flat(raw(GPU)), flat(raw("gpu-speed-1gpu")), flat(raw("gpu-stack-raybench"))
    for field in ("train.strategy", "train.seq_len", "train.micro_batch", "train.precision", "train.optimizer",
                  "train.finetune", "train.lora.rank", "train.lora.alpha", "train.ac_ratio", "train.lr", "train.steps", "train.warmup_steps"):
        assert base[field] == speed[field], field
    for field in ("model.path", "data.path", "data.tokenizer", "data.format"):
        assert base[field] == stack[field], field


def test_the_stage_compares_attention_workers_width_and_packing():
    assert stage_pairs() == [("model.attn_implementation", "sdpa"), ("data.num_workers", "2"),
                             ("data.pad_to", "seq_len"), ("data.packing", "true")]


def test_each_losses_command_of_the_stage_finds_the_rounds_pairs(round_files):
    # flex against packed sdpa; 0 and 4 workers against 2; padded longest against padded to seq_len; padded to
    # seq_len against packed.
    rows = planned_rows(round_files / f"{GPU}.yaml")
    counts = {axis: len(compare_losses(rows, axis, baseline)) for axis, baseline in stage_pairs()}
    assert counts == {"model.attn_implementation": 1, "data.num_workers": 2, "data.pad_to": 1, "data.packing": 1}


def test_the_twin_is_the_gpu_sweep_on_another_shape_without_what_needs_cuda():
    gpu, twin = flat(raw(GPU)), flat(raw(TWIN))
    assert gpu.keys() == twin.keys()
    assert {k for k in gpu if gpu[k] != twin[k]} <= SHAPE_FIELDS
    assert "gpus_per_worker" not in twin["resources"] and gpu["resources"]["gpus_per_worker"] == 1
    runnable = [p for p in gpu["axes"]["point"] if all(p[k] != v for k, v in CUDA_ONLY.items())]
    assert twin["axes"]["point"] == runnable


def test_on_the_twins_rows_only_flex_has_no_pair(round_files):
    rows = planned_rows(round_files / f"{TWIN}.yaml")
    counts = {axis: len(compare_losses(rows, axis, baseline)) for axis, baseline in stage_pairs()}
    assert counts == {"model.attn_implementation": 0, "data.num_workers": 2, "data.pad_to": 1, "data.packing": 1}


def data_rows() -> pd.DataFrame:
    """Rows as the store gives them back, one per point of the GPU sweep, the flex point failed."""
    points = raw(GPU)["axes"]["point"]
    speeds = [36_000.0, 3_600.0, None, 35_000.0, 36_500.0, 600.0]
    rows = pd.DataFrame({
        "trial_id": [f"t{i}" for i in range(len(points))],
        "status": ["ok", "ok", "error", "ok", "ok", "ok"],
        "axis_values_json": [json.dumps(p, sort_keys=True) for p in points],
        "nonpad_tok_per_s_per_device": speeds, "tok_per_s_per_device": 36_000.0, "nonpad_tokens_per_step": 12_000.0,
        "step_time_p50_s": 0.34, "phase_data_p50_s": [0.002, 0.001, None, 0.02, 0.002, 0.001],
        "peak_alloc_gib": 20.0, "peak_reserved_gib": [21.0, 9.0, None, 21.0, 21.0, 21.0], "loss_first": 12.1,
        "loss_final": 11.0, "trial_wall_s": 40.0, "message": [None, None, "RuntimeError: no flex kernel", None,
                                                              None, None],
        "error_detail": [None, None, "Traceback (most recent call last):\n  ...\nRuntimeError: no flex kernel",
                         None, None, None]})
    return rows


def test_the_summary_sets_every_point_against_the_baseline_and_says_what_failed():
    data_round = bench_script.load(REPO / "bench" / "data_round.py")
    text = data_round.report(data_rows(), GPU)
    assert "baseline num_workers=2 packing=true pad_to=seq_len attn_implementation=sdpa: 36,000 real tokens/s/GPU" \
        in text
    assert "packing=false pad_to=longest: 0.100x the baseline's real tokens/s (3,600)" in text
    assert "num_workers=0: 0.972x the baseline's real tokens/s (35,000), data phase p50 0.0200 s" in text
    assert "packing=false: 0.017x" in text
    assert "t2 num_workers=2 packing=true pad_to=seq_len attn_implementation=flex_attention: error" in text and "RuntimeError: no flex kernel" in text


def test_the_summary_without_a_baseline_says_so():
    data_round = bench_script.load(REPO / "bench" / "data_round.py")
    rows = data_rows()
    rows.loc[0, "status"] = "error"
    assert "no ok baseline point" in data_round.report(rows, GPU)


def test_the_summary_of_cpu_rows_has_no_reserved_memory():
    data_round = bench_script.load(REPO / "bench" / "data_round.py")
    text = data_round.report(data_rows().assign(peak_reserved_gib=None), GPU)
    assert "peak reserved - GiB" in text and "nan" not in text
