"""train.lora.base_dtype: a LoRA trial's frozen base stored in bf16 (auto under bf16 compute), adapters in fp32.

The cast happens on the meta device (techniques/lora.py), so the values a bf16 base receives are those of the fp32
build rounded: random init draws in fp32 (runtime/materialize.py), and safetensors arrive through
torch.distributed.checkpoint's copy into the bf16 tensors. A run on it follows the fp32-base run's losses within
bf16's precision (the bound below), on one gloo rank, in the same process.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.results import store
from raybench.runtime import bench, weights
from raybench.runtime.build import build_and_wrap, build_meta, fill
from raybench.runtime.strategies import RankContext
from raybench.runtime.techniques import lora
from raybench.spec.load import parse_sweep
from raybench.spec.presets import PRESETS
from raybench.spec.sweep_spec import LoraSpec, ModelSpec, TrainSpec

CPU = torch.device("cpu")
# The bf16-base run against the fp32-base run under ddp's autocast. Every matmul uses the same bf16 weights in
# both (autocast rounds the fp32 base to exactly the values the bf16 base holds: one fp32 draw, one rounding), so
# they differ only where the residual stream is rounded to bf16: the embedding's output and the two residual adds
# of each of the tiny preset's 4 blocks, 9 roundings of at most eps/2 each (eps = 2**-7, 8 significant bits).
# Independent rounding errors grow as the square root of their number: 3 * eps / 2 (1.2%, 0.09 at a loss of 7.6).
# Measured: 0.48% at most over these 8 steps. Trajectories that round differently drift apart as steps go on (1.3%
# at step 19 of 20, docs/results/lora-base-dtype-2026-11-26.md), as ddp's and fsdp2's with an fp32 base do.
BF16_BASE_RTOL = 3 * torch.finfo(torch.bfloat16).eps / 2


def lora_model(base_dtype: str, precision: str = "bf16", shape=PRESETS["tiny"], spec=None):
    """The tiny preset (or `spec`'s model directory) with LoRA on every linear, on the meta device."""
    train = TrainSpec(finetune="lora", precision=precision, lora=LoraSpec(rank=4, targets="all_linear",
                                                                          base_dtype=base_dtype))
    model, source, info = build_meta(spec or ModelSpec(preset="tiny"), seed=0, shape=shape)
    return lora.apply(model, train), source, info


def filled(base_dtype: str, spec=None):
    model, source, info = lora_model(base_dtype, spec=spec)
    fill(model, CPU, source, info, whole=True)
    return model


def test_the_frozen_base_is_cast_on_meta_the_adapters_stay_fp32_and_a_tied_head_stays_tied():
    tied = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True)
    model, _, _ = lora_model("auto", shape=tied)
    for name, param in model.named_parameters():
        assert param.device.type == "meta"
        assert (param.dtype, param.requires_grad) == ((torch.float32, True) if ".lora_" in name
                                                      else (torch.bfloat16, False)), name
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert all(b.dtype == torch.float32 for b in model.buffers())  # rotary frequencies are not weights
    assert {p.dtype for p in lora_model("auto", precision="fp32")[0].parameters()} == {torch.float32}


def test_a_bf16_base_holds_the_fp32_builds_values_rounded():
    """Random init draws in fp32 whatever the tensor's dtype: the bf16 base is a cast of the fp32 model."""
    bf16, fp32 = filled("bf16"), filled("fp32")
    for (name, a), (_, b) in zip(bf16.named_parameters(), fp32.named_parameters()):
        assert torch.equal(a, b.to(a.dtype)), name  # adapters: fp32 both, equal


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_safetensors_arrive_rounded_into_a_bf16_base(stored, model_dir, tmp_path):
    """torch.distributed.checkpoint's Hugging Face reader copies each stored tensor into the bf16 destination: an
    fp32 checkpoint arrives rounded (as a cast would), a bf16 one exactly."""
    (weights_file,) = model_dir.glob("*.safetensors")
    checkpoint = {k: t.to(stored) for k, t in load_file(weights_file).items()}
    directory = tmp_path / "model"
    directory.mkdir()
    for other in model_dir.iterdir():
        if other.suffix != ".safetensors":
            (directory / other.name).write_bytes(other.read_bytes())
    save_file(checkpoint, directory / weights_file.name, metadata={"format": "pt"})
    spec = ModelSpec(path=str(directory))
    model, source, info = build_meta(spec, seed=0)
    model = lora.apply(model, TrainSpec(finetune="lora", lora=LoraSpec(rank=4, targets="all_linear")))
    fill(model, CPU, source, info, whole=True)
    state = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v  # checkpoint keys
             for k, v in model.state_dict().items() if ".lora_" not in k}
    for key, tensor in checkpoint.items():
        assert state[key].dtype == torch.bfloat16 and torch.equal(state[key], tensor.to(torch.bfloat16)), key


def test_the_weights_cache_keeps_a_bf16_base_apart_from_fp32_builds():
    """The warm pool's cache holds tensors as built: a bf16 base must not hand rounded values to an fp32 trial."""
    weights.STATE_CACHE.entries.clear()
    for base_dtype, expected in (("bf16", "miss"), ("fp32", "miss"), ("bf16", "hit"), ("fp32", "hit")):
        model, source, info = lora_model(base_dtype)
        fill(model, CPU, dataclasses.replace(source, cache_key="preset:tiny:0", cache_gib=1.0), info, whole=True)
        assert info["weights_cache"] == expected, base_dtype
    fp32 = filled("fp32")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fp32.parameters()))  # the fp32 hit
    weights.STATE_CACHE.entries.clear()


def test_rows_record_the_resolved_base_dtype_and_null_without_a_lora_base(tmp_path):
    spec = parse_sweep({"name": "rows", "model": {"preset": "tiny"},
                        "axes": {"train.finetune": ["full", "lora", "qlora"], "train.precision": ["bf16", "fp32"]}})
    for trial in plan(spec, keep_invalid=True):  # qlora is invalid on CPU: its row is written all the same
        store.write_row(tmp_path, build_row(trial.payload, "rows", trial.status, ""))
    rows = store.read_table(tmp_path).to_pylist()
    recorded = {(r["train_finetune"], r["train_precision"]): r["train_lora_base_dtype"] for r in rows}
    assert recorded == {("full", "bf16"): None, ("full", "fp32"): None, ("lora", "bf16"): "bf16",
                        ("lora", "fp32"): "fp32", ("qlora", "bf16"): None, ("qlora", "fp32"): None}


def run_losses(strategy: str, base_dtype: str, tmp_path, steps: int) -> tuple[list[float], torch.nn.Module]:
    """Losses of `steps` LoRA steps of the tiny preset on one gloo rank, built and wrapped as the worker does, over
    two fixed batches in turn (the adapters learn them: the loss falls)."""
    spec = parse_sweep({"name": "base", "model": {"preset": "tiny"}, "train": {
        "strategy": strategy, "finetune": "lora", "precision": "bf16", "steps": steps, "warmup_steps": 1,
        "seq_len": 32, "micro_batch": 2, "lr": 1e-2, "lora": {"base_dtype": base_dtype}}})
    (trial,) = plan(spec)
    generator = torch.Generator().manual_seed(0)
    fixed = [torch.randint(0, PRESETS["tiny"].vocab_size, (2, 32), generator=generator) for _ in range(2)]
    batches = ({"input_ids": ids, "labels": ids} for ids in itertools.cycle(fixed))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/{strategy}-{base_dtype}", rank=0, world_size=1)
    try:
        built = build_and_wrap(trial.payload, RankContext(0, 1, 0, CPU))
        clock = bench.PhaseClock(CPU)
        losses = [bench.train_step(built.trainable, batches, trial.config.train, CPU, clock)[0].item()
                  for _ in range(steps)]
    finally:
        dist.destroy_process_group()
    return losses, built.trainable.model


def test_a_bf16_base_trains_as_the_fp32_base_within_bf16_precision(tmp_path):
    bf16, model = run_losses("ddp", "auto", tmp_path, steps=8)
    fp32, _ = run_losses("ddp", "fp32", tmp_path, steps=8)
    for step, (a, b) in enumerate(zip(bf16, fp32)):
        assert a == pytest.approx(b, rel=BF16_BASE_RTOL), (step, bf16, fp32)
    assert bf16[-1] < bf16[0] - 0.1  # it learns
    for name, param in model.named_parameters():  # only the adapters train, and they alone are fp32
        assert (param.dtype, param.requires_grad) == ((torch.float32, True) if ".lora_" in name
                                                      else (torch.bfloat16, False)), name


def test_fsdp2_computes_the_same_with_a_bf16_base(tmp_path):
    """FSDP2's policy gathers bf16 weights either way, and they are the same rounded values: the runs agree to the
    bit. One FSDP unit holds the bf16 base and the fp32 adapters (FSDP2 asks one dtype of trainable ones only).
    ddp with a bf16 base computes the same too: the same bf16 weights, and a bf16 residual stream."""
    fsdp2 = run_losses("fsdp2", "auto", tmp_path, steps=3)[0]
    assert fsdp2 == run_losses("fsdp2", "fp32", tmp_path, steps=3)[0] == run_losses("ddp", "auto", tmp_path, 3)[0]
