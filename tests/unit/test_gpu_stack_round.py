"""GPU round 2's sweeps (bench/sweeps/gpu-stack-*.yaml: raybench's loop, TRL's SFTTrainer and Lightning on one model
directory and chat data) validate and plan next to the files `bench/gpu_truth.sh OUT stacks` writes, and each CPU
twin (gpu-stack-*-cpu.yaml, what the stage runs with RAYBENCH_GPU_STACKS_TWIN=1) is its GPU sweep on another shape:
the twin's rows prove the GPU's code path only where the two differ in nothing else. The twins' runs themselves are
the stage's (docs/results/gpu-round2-cpu-twin-2026-11-28.md); no trial starts here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from raybench.cli import main as cli
from raybench.planning.plan import plan
from raybench.spec.load import load_sweep
from tests import bench_script
from tests.gpu_rounds import flat, write_round_data

REPO = Path(__file__).resolve().parents[2]
STACKS = ("raybench", "hf", "lightning")
# What a twin may change: where its files are, their size and shape, and the hardware (not its precision).
SHAPE_FIELDS = {"name", "description", "model.path", "data.path", "data.tokenizer", "data.pin_memory", "train.steps",
                "train.warmup_steps", "train.seq_len", "train.micro_batch", "resources",
                "stack.overrides.batch_size", "stack.overrides.pin_memory"}


@pytest.mark.parametrize("stack", STACKS)
def test_each_twin_is_its_gpu_sweep_on_another_shape(stack):
    gpu = flat(yaml.safe_load((REPO / "bench" / "sweeps" / f"gpu-stack-{stack}.yaml").read_text()))
    twin = flat(yaml.safe_load((REPO / "bench" / "sweeps" / f"gpu-stack-{stack}-cpu.yaml").read_text()))
    assert gpu.keys() == twin.keys()
    assert {k for k in gpu if gpu[k] != twin[k]} <= SHAPE_FIELDS
    assert "gpus_per_worker" not in twin["resources"] and gpu["resources"]["gpus_per_worker"] == 1


@pytest.fixture(scope="module")
def round_files(tmp_path_factory) -> Path:
    """bench/sweeps as a clone has it, with the twins' files written by the stage's own script (fewer chats) and,
    for the GPU sweeps, the 1B's config.json beside an empty safetensors file (planning reads the config only)."""
    root = tmp_path_factory.mktemp("clone")
    sweeps = root / "sweeps"
    sweeps.mkdir()
    for path in (REPO / "bench" / "sweeps").glob("gpu-stack-*.yaml"):
        shutil.copy(path, sweeps / path.name)
    (root / "stacks").symlink_to(REPO / "bench" / "stacks", target_is_directory=True)
    write_round_data(sweeps)
    return sweeps


@pytest.mark.parametrize("name", [f"gpu-stack-{s}{t}" for s in STACKS for t in ("", "-cpu")])
def test_the_rounds_sweeps_validate_and_plan_one_trial(name, round_files, capsys):
    assert cli.main(["validate", str(round_files / f"{name}.yaml")]) == 0, capsys.readouterr().err
    (trial,) = plan(load_sweep(round_files / f"{name}.yaml"))
    assert trial.config.data.source == "hf" and trial.config.data.packing


def test_the_lightning_entrys_optimizer_lets_bf16_mixed_clip_gradients(round_files):
    """Lightning's bf16-mixed refuses to clip gradients (train.max_grad_norm, on by default) for a fused optimizer,
    which unscales them itself: the round's Lightning run, fused, failed so at its first step (its twin in bf16
    on the CPU; an fp32 run never meets the check)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    entry = bench_script.load(REPO / "bench" / "stacks" / "seed000_lightning.py")
    module = entry.LoraCausalLM(str(round_files / "example-data" / "stack-round-twin" / "model"), "sdpa",
                                torch.bfloat16, rank=4, alpha=8, lr=1e-3)
    MixedPrecision("bf16-mixed", "cpu").clip_gradients(module.configure_optimizers(), clip_val=1.0)


def test_the_1b_ties_its_output_head_so_no_adapter_goes_there():
    """The issue says LoRA on attention + MLP + output: Llama-3.2-1B's output head is its embedding matrix (tied),
    so the round's adapters are on attention and MLP only, in all three stacks."""
    from raybench.spec.presets import PRESETS

    assert PRESETS["llama-3.2-1b"].hf_config_kwargs()["tie_word_embeddings"] is True
    raybench = yaml.safe_load((REPO / "bench" / "sweeps" / "gpu-stack-raybench.yaml").read_text())
    assert raybench["train"]["lora"] == {"rank": 64, "alpha": 128, "dropout": 0.0, "targets": "attention_mlp"}
    for entry in ("seed000_hf.py", "seed000_lightning.py"):
        assert 'TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]' in \
            (REPO / "bench" / "stacks" / entry).read_text()
