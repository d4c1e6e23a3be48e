"""Run under torchrun by test_sharded_build.py: every rank builds the tiny preset on the meta device, wraps it
with each sharding strategy, materializes its own shards, and checks that the gathered parameters equal one
whole build's, LoRA adapters included. Exits non-zero (naming the parameters) on any difference."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from raybench.config import ModelSpec, TrainSpec
from raybench.model import build_meta, fill
from raybench.strategies import RankContext, fsdp2, tp, tp_fsdp2
from raybench.techniques import lora

CPU = torch.device("cpu")


def built(train: TrainSpec, strategy=None) -> torch.nn.Module:
    model, source, info = build_meta(ModelSpec(preset="tiny"), seed=7)
    if train.finetune == "lora":
        model = lora.apply(model, train)
    if strategy is None:
        fill(model, CPU, source, info, whole=True)
        return model
    ctx = RankContext(dist.get_rank(), dist.get_world_size(), 0, CPU)
    return strategy.setup(model, train, ctx, lambda whole: fill(model, CPU, source, info, whole)).model


def main() -> int:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cases = {"fsdp2": (TrainSpec(strategy="fsdp2", precision="fp32"), fsdp2),
             "fsdp2-lora": (TrainSpec(strategy="fsdp2", precision="fp32", finetune="lora"), fsdp2),
             "tp": (TrainSpec(strategy="tp", tp_size=world, precision="fp32"), tp)}
    if world == 4:
        cases["tp_fsdp2"] = (TrainSpec(strategy="tp_fsdp2", tp_size=2, precision="fp32"), tp_fsdp2)
    failures = []
    for name, (train, strategy) in cases.items():
        whole = dict(built(train).named_parameters())
        for pname, param in built(train, strategy).named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            if not torch.equal(full, whole[pname]):
                failures.append(f"{name}: {pname}")
    if dist.get_rank() == 0:
        print(f"checked {', '.join(cases)} at world size {world}; differences: {failures or 'none'}")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
