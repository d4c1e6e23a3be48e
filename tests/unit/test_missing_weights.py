"""A checkpoint that lacks base weights fails the build, naming them, unless model.missing_weights is random.

The model is the tests' tiny Llama saved with safetensors (conftest.make_model_dir); one tensor is deleted from
its file, as in a truncated or mismatched checkpoint.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from raybench.runtime.build import build_meta, build_model, fill
from raybench.runtime.techniques import lora
from raybench.spec.sweep_spec import ModelSpec, TrainSpec

DROPPED = "model.layers.1.mlp.up_proj.weight"
CPU = torch.device("cpu")


def without(model_dir, tmp_path, *keys: str):
    """A copy of the model directory whose safetensors file lacks `keys`; returns (dir, the tensors kept)."""
    copy = shutil.copytree(model_dir, tmp_path / "partial")
    (weights_file,) = copy.glob("*.safetensors")
    tensors = load_file(weights_file)
    for key in keys:
        del tensors[key]
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return copy, tensors


def test_a_missing_base_weight_is_an_error_naming_it(model_dir, tmp_path):
    partial, _ = without(model_dir, tmp_path, DROPPED)
    with pytest.raises(ValueError) as err:
        build_model(ModelSpec(path=str(partial)), CPU, seed=0)
    message = str(err.value)
    assert "1 base weight(s)" in message and DROPPED in message and str(partial) in message
    assert "model.missing_weights: random" in message  # the fix


def test_many_missing_weights_are_counted_and_a_few_named(model_dir, tmp_path):
    dropped = [f"model.layers.{layer}.mlp.{proj}.weight" for layer in (0, 1) for proj in ("up_proj", "gate_proj",
                                                                                            "down_proj")]
    partial, _ = without(model_dir, tmp_path, *dropped)
    with pytest.raises(ValueError, match=r"6 base weight\(s\)") as err:
        build_model(ModelSpec(path=str(partial)), CPU, seed=0)
    assert sum(key in str(err.value) for key in dropped) == 5 and ", ..." in str(err.value)


def test_random_missing_weights_when_asked(model_dir, tmp_path):
    partial, kept = without(model_dir, tmp_path, DROPPED)
    model, _ = build_model(ModelSpec(path=str(partial), missing_weights="random"), CPU, seed=0)
    state = model.state_dict()
    assert all(torch.equal(state[key], tensor) for key, tensor in kept.items())  # the rest is the checkpoint's
    drawn = state[DROPPED]
    assert torch.isfinite(drawn).all() and drawn.std() > 0  # drawn, not left as uninitialized memory or zeros


def test_lora_adapters_are_not_missing_base_weights(model_dir):
    # A complete checkpoint has no adapters: raybench adds them, and they start from PEFT's init.
    model, source, info = build_meta(ModelSpec(path=str(model_dir)), seed=0)
    model = lora.apply(model, TrainSpec(finetune="lora"))
    fill(model, CPU, source, info, whole=True)
    adapters = [name for name, _ in model.named_parameters() if ".lora_" in name]
    assert adapters and all(p.device == CPU for p in model.parameters())
