"""Run under torchrun by test_sharded_build.py: every rank builds the tiny preset on the meta device, wraps it
with each sharding strategy (DeepSpeed ZeRO-3 included), materializes its own shards, and checks that the
gathered parameters equal one whole build's, LoRA adapters included. ZeRO-3 also reads a model directory
(the preset saved with another seed, in several safetensors files). Exits non-zero (naming the parameters) on
any difference."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

from raybench.runtime.build import build_meta, fill
from raybench.runtime.strategies import RankContext, deepspeed, fsdp2, tp, tp_fsdp2
from raybench.runtime.techniques import activation_checkpointing, lora
from raybench.spec.sweep_spec import ModelSpec, TrainSpec

CPU = torch.device("cpu")


def built(train: TrainSpec, strategy=None, spec: ModelSpec = ModelSpec(preset="tiny")) -> torch.nn.Module:
    model, source, info = build_meta(spec, seed=7)
    for technique in (lora, activation_checkpointing):
        if technique.wanted(train):
            model = technique.apply(model, train)
    if strategy is None:
        fill(model, CPU, source, info, whole=True)
        return model
    ctx = RankContext(dist.get_rank(), dist.get_world_size(), 0, CPU)
    model = strategy.setup(model, train, ctx, lambda whole: fill(model, CPU, source, info, whole)).model
    return model.module if strategy is deepspeed else model  # the engine's module keeps the model's names


def gathered(model: torch.nn.Module, strategy) -> dict[str, torch.Tensor]:
    """Whole copies of the parameters of a sharded model, by name."""
    if strategy is deepspeed:
        import deepspeed as ds

        with ds.zero.GatheredParameters(list(model.parameters())):
            return {name: param.detach().clone() for name, param in model.named_parameters()}
    return {name: param.full_tensor() if hasattr(param, "full_tensor") else param
            for name, param in model.named_parameters()}


def partitions_only(model: torch.nn.Module) -> list[str]:
    """ZeRO-3: every parameter holds no data outside its gathers, and this rank's partitions add up to its share
    of the model (DeepSpeed pads each tensor to a multiple of the world size)."""
    params, world = list(model.parameters()), dist.get_world_size()
    problems = [f"parameter {p.ds_id} holds {p.numel()} elements" for p in params if p.numel() > 0]
    held = sum(p.ds_tensor.numel() for p in params)
    share = sum(-(-p.ds_numel // world) for p in params)
    if held != share:
        problems.append(f"partitions hold {held} elements, this rank's share is {share}")
    return problems


def saved_preset(directory: str) -> ModelSpec:
    """The tiny preset drawn with another seed, saved by rank 0 as a model directory every rank reads."""
    if dist.get_rank() == 0:
        model, source, info = build_meta(ModelSpec(preset="tiny"), seed=11)
        fill(model, CPU, source, info, whole=True)
        model.save_pretrained(directory, safe_serialization=True, max_shard_size="1MB")
    dist.barrier()
    return ModelSpec(path=directory)


def main() -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    shared = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared)
    from_dir = saved_preset(shared[0])
    zero3 = {"strategy": "deepspeed", "zero_stage": 3, "precision": "fp32"}
    cases = {"fsdp2": (TrainSpec(strategy="fsdp2", precision="fp32"), fsdp2),
             "fsdp2-lora": (TrainSpec(strategy="fsdp2", precision="fp32", finetune="lora"), fsdp2),
             # the frozen base in bf16 (train.lora.base_dtype auto), drawn and read from safetensors shard by shard
             "fsdp2-lora-bf16-base": (TrainSpec(strategy="fsdp2", finetune="lora"), fsdp2),
             "fsdp2-lora-bf16-base-dir": (TrainSpec(strategy="fsdp2", finetune="lora"), fsdp2, from_dir),
             "tp": (TrainSpec(strategy="tp", tp_size=world, precision="fp32"), tp),
             "zero3": (TrainSpec(**zero3), deepspeed),
             "zero3-lora-sac": (TrainSpec(**zero3, finetune="lora", ac_ratio="1/2"), deepspeed),
             "zero3-dir": (TrainSpec(**zero3), deepspeed, from_dir),
             "zero3-lora-dir": (TrainSpec(**zero3, finetune="lora"), deepspeed, from_dir)}
    if world == 4:
        cases["tp_fsdp2"] = (TrainSpec(strategy="tp_fsdp2", tp_size=2, precision="fp32"), tp_fsdp2)
    failures = []
    for name, (train, strategy, *spec) in cases.items():
        whole = dict(built(train, None, *spec).named_parameters())
        model = built(train, strategy, *spec)
        if strategy is deepspeed:
            failures += [f"{name}: {problem}" for problem in partitions_only(model)]
        parts = gathered(model, strategy)
        if parts.keys() != whole.keys():
            failures.append(f"{name}: names {sorted(parts.keys() ^ whole.keys())}")
        failures += [f"{name}: {pname}" for pname, full in parts.items()
                     if pname in whole and not torch.equal(full, whole[pname])]
    if dist.get_rank() == 0:
        print(f"checked {', '.join(cases)} at world size {world}; differences: {failures or 'none'}")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(shared[0])
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
