"""GPU round 5's sweep (bench/sweeps/gpu-leftovers-1gpu.yaml: the public 8B LoRA point and its dropout-0 point, then
seed 000's LoRA with the chunked loss, the full loss and dropout 0.1) validates and plans, its points are the
configurations the round names (sweeps/lora-8b-1gpu.yaml's points 8 and 0, gpu-seed000-1gpu's recipe point) in the
order the round wants them, the public point stays planned when its rehearsal is in the store, each `raybench
losses` comparison of the `leftovers` stage of bench/gpu_truth.sh finds its pair, its CPU twin
(gpu-leftovers-1gpu-cpu.yaml, what the stage runs with RAYBENCH_GPU_LEFTOVERS_TWIN=1) is the GPU sweep on another
shape, the stage's other trials and tests are what it says, and its summary (bench/leftovers_round.py) answers the
round's questions. The twin's run itself is the stage's (docs/results/gpu-round5-cpu-twin-2026-11-28.md); no trial
starts here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from raybench.cli import main as cli
from raybench.planning import calibration
from raybench.planning.plan import plan
from raybench.reports.losses import compare_losses
from raybench.spec.load import load_sweep
from tests import bench_script
from tests.gpu_rounds import flat, planned_rows

REPO = Path(__file__).resolve().parents[2]
SWEEPS = REPO / "bench" / "sweeps"
GPU, TWIN = SWEEPS / "gpu-leftovers-1gpu.yaml", SWEEPS / "gpu-leftovers-1gpu-cpu.yaml"
SCRIPT = REPO / "bench" / "gpu_truth.sh"
# The trial ids the round's record and docs/results/gpu-rounds.md name, in the sweep's order.
IDS = ["79131259573d299b", "038d80fe44175212", "778de9321c2a1093", "5f567b4018f16e87", "46daff934346f251"]
# What the twin may change: its size and shape, and the hardware; in each point, the model, the row, the steps.
SHAPE_FIELDS = {"name", "description", "model.preset", "data.pin_memory", "train.steps", "train.warmup_steps",
                "train.seq_len", "resources", "axes"}
POINT_SHAPE_FIELDS = {"model.preset", "train.seq_len", "train.micro_batch", "train.steps", "train.warmup_steps"}
# The fields a point may differ in from the configuration it stands for: how long it runs and when it is hung.
RUN_LENGTH = {"train.steps", "train.warmup_steps", "resources.timeout_s"}


def stage_body() -> str:
    (body,) = re.findall(r"\nleftovers_stage\(\) \{\n(.*?)\n\}\n", SCRIPT.read_text(), re.DOTALL)
    return body


def stage_pairs() -> list[tuple[str, str]]:
    """The (axis, baseline) pairs the leftovers stage hands to `raybench losses`."""
    (line,) = re.findall(r"for pair in (.*); do", stage_body())
    return [tuple(pair.split("=", 1)) for pair in line.split()]


def config(trial) -> dict:
    """A planned trial's configuration by dotted field (resources' fields too)."""
    dumped = trial.config.model_dump(mode="json")
    return {**flat(dumped), **{f"resources.{k}": v for k, v in dumped["resources"].items()}}


def differences(a, b) -> set[str]:
    left, right = config(a), config(b)
    return {k for k in left.keys() | right.keys() if k != "resources" and left.get(k) != right.get(k)}


def test_the_gpu_sweep_validates_and_plans_its_five_points_in_the_rounds_order(capsys):
    assert cli.main(["validate", str(GPU)]) == 0, capsys.readouterr().err
    trials = plan(load_sweep(GPU))
    assert [t.config_id for t in trials] == IDS
    assert [t.status for t in trials] == ["planned"] * 5
    for trial in trials:
        assert trial.config.resources.gpus_per_worker == 1 and not trial.config.train.compile
    short = [(t.config.model.preset, t.config.train.grad_accum, t.config.train.lora.dropout, t.config.train.loss)
             for t in trials]
    assert short == [("llama-3-8b", 16, 0.1, "chunked"), ("llama-3-8b", 1, 0.0, "chunked"),
                     ("llama-3.2-1b", 1, 0.0, "chunked"), ("llama-3.2-1b", 1, 0.0, "full"),
                     ("llama-3.2-1b", 1, 0.1, "chunked")]
    assert len({tuple(sorted(p)) for p in yaml.safe_load(GPU.read_text())["axes"]["point"]}) == 1  # same fields


def test_the_8b_points_are_the_public_point_and_point_0_of_the_8b_sweep_run_shorter():
    ours, lora_8b = plan(load_sweep(GPU)), plan(load_sweep(REPO / "sweeps" / "lora-8b-1gpu.yaml"))
    assert lora_8b[8].axis_values["train.grad_accum"] == 16  # the public point (lean-loop-2026-11-28.md)
    assert differences(ours[0], lora_8b[8]) <= RUN_LENGTH
    assert differences(ours[1], lora_8b[0]) <= RUN_LENGTH
    # 4 steps of 16 micro-batches, 1 of them warm-up: 3 timed steps.
    assert (ours[0].config.train.steps, ours[0].config.train.warmup_steps) == (4, 1)


def test_the_1b_points_are_seed_000s_recipe_point_eager():
    ours, seed000 = plan(load_sweep(GPU)), plan(load_sweep(SWEEPS / "gpu-seed000-1gpu.yaml"))
    assert seed000[1].axis_values == {"train.ac_ratio": "0"}  # its recipe point: no AC, eager, no Liger
    assert differences(ours[2], seed000[1]) <= RUN_LENGTH
    assert differences(ours[3], ours[2]) == {"train.loss"}
    assert differences(ours[4], ours[2]) == {"train.lora.dropout"}


def rehearsed(trial) -> calibration.Evidence:
    """A store holding the public point's traced rehearsal (lean-loop-2026-11-28.md: 63.73 GiB of tensors, 73.93
    GiB reserved; 74.93 GiB with the CUDA context)."""
    return calibration.Evidence(rehearsals={trial.config_id: {"method": "traced", "peak_gib": 63.73,
                                                                "reserved_gib": 73.93}})


def test_the_public_point_stays_planned_with_its_rehearsal_in_the_store():
    spec = load_sweep(GPU)
    public = plan(spec)[0]
    assert (spec.estimate.gpu, spec.estimate.margin_gib) == ("H100 SXM", 4)
    kept = plan(spec, evidence=rehearsed(public))[0]
    assert kept.status == "planned" and kept.assessment.peak_basis == "rehearsed"
    assert kept.assessment.limit_gib == pytest.approx(79.65 - 4, abs=0.01)
    # The default margin (10% of the H100's memory) skips it, as the round's row says.
    default = spec.model_copy(update={"estimate": spec.estimate.model_copy(update={"margin_gib": None})})
    assert plan(default, evidence=rehearsed(public))[0].status == "skipped"


def test_the_stage_compares_the_loss_and_the_dropout():
    assert stage_pairs() == [("train.loss", "full"), ("train.lora.dropout", "0.0")]


@pytest.mark.parametrize("sweep", [GPU, TWIN], ids=["gpu", "twin"])
def test_each_losses_command_of_the_stage_finds_its_one_pair(sweep):
    # The full loss against chunked, dropout 0.1 against 0, both at seed 000's LoRA; the 8B pair differs in its
    # accumulation too, so no comparison pairs it.
    rows = planned_rows(sweep)
    found = {axis: compare_losses(rows, axis, baseline) for axis, baseline in stage_pairs()}
    ids = [t.trial_id for t in plan(load_sweep(sweep))]
    assert {axis: [(c.trial_id, c.baseline_trial_id) for c in pairs] for axis, pairs in found.items()} == {
        "train.loss": [(ids[2], ids[3])], "train.lora.dropout": [(ids[4], ids[2])]}


def test_the_twin_is_the_gpu_sweep_on_another_shape(capsys):
    gpu, twin = flat(yaml.safe_load(GPU.read_text())), flat(yaml.safe_load(TWIN.read_text()))
    assert gpu.keys() == twin.keys()
    assert {k for k in gpu if gpu[k] != twin[k]} <= SHAPE_FIELDS
    assert "gpus_per_worker" not in twin["resources"] and gpu["resources"]["gpus_per_worker"] == 1
    gpu_points, twin_points = gpu["axes"]["point"], twin["axes"]["point"]
    assert len(gpu_points) == len(twin_points)
    for ours, theirs in zip(gpu_points, twin_points):
        assert ours.keys() == theirs.keys()
        assert {k for k in ours if ours[k] != theirs[k]} <= POINT_SHAPE_FIELDS
    assert cli.main(["validate", str(TWIN)]) == 0, capsys.readouterr().err
    assert all(t.config.model.preset == "tiny" for t in plan(load_sweep(TWIN)))


def test_the_stage_runs_the_sweep_then_ddp_liger_zero3_offload_and_every_gpu_test():
    body = stage_body()
    (budget,) = re.findall(r"\$\{RAYBENCH_GPU_LEFTOVERS_S:-(\d+)\}\)\) sweep=gpu-leftovers-1gpu", body)
    # The stage's budget and pip's ~25 s, env's ~10 s and the final summary's ~10 s: inside the round's 9 minutes.
    assert int(budget) + 45 <= 9 * 60
    assert "sweep=$sweep-cpu" in body and "RAYBENCH_GPU_LEFTOVERS_TWIN" in body
    assert "    leftovers) leftovers_stage ;;" in SCRIPT.read_text()
    # The two trials are gpu-validate's ddp + Liger and ZeRO-3 with optimizer and parameter offload.
    (line,) = re.findall(r"for trial in (.*); do", body)
    ids = [item.split(":")[0] for item in line.split()]
    validate = {t.config_id: t.config.train for t in plan(load_sweep(SWEEPS / "gpu-validate.yaml"))}
    liger, offload = validate[ids[0]], validate[ids[1]]
    assert (liger.strategy, liger.liger) == ("ddp", True)
    assert (offload.strategy, offload.zero_stage, offload.offload) == ("deepspeed", 3, "optimizer_params")
    assert f"gpu-validate.yaml {ids[0]}" in SCRIPT.read_text().split("ddp-liger)")[1].splitlines()[0]
    # Every file of tests/gpu, each once.
    (files,) = re.findall(r"local tests=\((.*?)\)", body, re.DOTALL)
    listed = files.split()
    assert sorted(listed) == sorted(f"tests/gpu/{p.name}" for p in (REPO / "tests" / "gpu").glob("test_*.py"))


def leftovers_rows() -> pd.DataFrame:
    """Rows as the store gives them back, one per point of the GPU sweep, the dropout-0.1 1B point failed."""
    points = yaml.safe_load(GPU.read_text())["axes"]["point"]
    return pd.DataFrame({
        "trial_id": [f"t{i}" for i in range(len(points))], "status": ["ok", "ok", "ok", "ok", "error"],
        "axis_values_json": [json.dumps(p, sort_keys=True) for p in points],
        "tok_per_s_per_device": [11_000.0, 10_000.0, 40_000.0, 41_000.0, None],
        "step_time_p50_s": [11.9, 0.82, 0.307, 0.300, None],
        "peak_alloc_gib": [63.5, 63.4, 22.9, 39.5, None], "peak_reserved_gib": [72.1, 72.0, 26.0, 45.0, None],
        "est_peak_gib": [66.11, 66.11, 24.89, 40.99, 24.89], "model_build_s": [9.0, 8.0, 0.9, 0.9, None],
        "loss_first": 12.0, "loss_final": 11.9, "trial_wall_s": [70.0, 30.0, 18.0, 18.0, 3.0],
        "message": [None, None, None, None, "RuntimeError: no dropout kernel"],
        "error_detail": [None, None, None, None, "Traceback (most recent call last):\n  ...\nRuntimeError: no dropout"
                                                 " kernel"]})


def test_the_summary_answers_the_public_points_fit_and_the_pairs():
    summary = bench_script.load(REPO / "bench" / "leftovers_round.py")
    text = summary.report(leftovers_rows(), "gpu-leftovers-1gpu")
    assert "the public 8B point (dropout 0.1, accumulation 16, t0): fits; peak allocated 63.50 GiB" in text
    assert "reserved 72.10 GiB (rehearsed 73.93 [69.75-78.65])" in text
    assert "step p50 11.90 s" in text and "11,000 tokens/s/GPU: 0.882x the public run's 12,473" in text
    # 11.9 s over 16 micro-batches against 0.82 s.
    assert "at the 8B, per micro-batch: 0.7438 against 0.8200 s per micro-batch, 0.907x" in text
    assert "the chunked loss against the full loss at seed 000's LoRA: 0.3070 against 0.3000 s per micro-batch, " \
           "1.023x" in text
    assert "dropout 0.1 against 0 at seed 000's LoRA: no pair (point: error, baseline: ok)" in text
    assert "t4 " in text and "RuntimeError: no dropout kernel" in text


def test_the_summary_says_what_did_not_run():
    summary = bench_script.load(REPO / "bench" / "leftovers_round.py")
    rows = leftovers_rows().iloc[2:]
    text = summary.report(rows, "gpu-leftovers-1gpu")
    assert "the public 8B point (dropout 0.1, accumulation 16): not run" in text
    assert "no pair (point: not run, baseline: not run)" in text
