"""Run under torchrun by test_sharded_build.py: every rank builds a preset with LoRA under DeepSpeed ZeRO-3
(`strategies.deepspeed.setup`, meta build → partitions → values) and rank 0 prints one JSON line: each rank's
peak RSS growth during the setup, the bytes of the partitions it holds, and the whole model's fp32 bytes."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from raybench.runtime.build import build_meta, fill
from raybench.runtime.strategies import RankContext, deepspeed
from raybench.runtime.techniques import lora
from raybench.runtime.rank_memory import peak_host_memory_gib, reset_peaks
from raybench.spec.sweep_spec import ModelSpec, TrainSpec

CPU = torch.device("cpu")


def main(preset: str) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed as ds  # noqa: F401  imported (and its CPU comm op loaded) before the window opens

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    train = TrainSpec(strategy="deepspeed", zero_stage=3, finetune="lora", precision="fp32")
    model, source, info = build_meta(ModelSpec(preset=preset), seed=0)
    model = lora.apply(model, train)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    ctx = RankContext(dist.get_rank(), dist.get_world_size(), 0, CPU)
    before, _ = reset_peaks(CPU)
    engine = deepspeed.setup(model, train, ctx, lambda whole: fill(model, CPU, source, info, whole)).model
    growth = (peak_host_memory_gib() or 0.0) - before
    partitions = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
    whole_left = sum(p.numel() for p in engine.module.parameters())  # a partitioned parameter holds no data
    rows = [None] * ctx.world_size
    dist.all_gather_object(rows, {"growth_gib": growth, "partition_gib": partitions / 2**30,
                                  "whole_elements": whole_left})
    if ctx.rank == 0:
        print(json.dumps({"model_gib": model_bytes / 2**30, "ranks": rows}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
