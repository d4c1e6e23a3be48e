"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets during backward."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raybench.runtime.strategies import RankContext, Trainable, already_materialized, autocast_for, torch_trainable
from raybench.spec.sweep_spec import TrainSpec


def setup(model: nn.Module, train: TrainSpec, ctx: RankContext, materialize=already_materialized) -> Trainable:
    materialize(True)  # DDP broadcasts rank 0's whole parameters at construction
    autocast = autocast_for(train, ctx.device)
    if ctx.world_size == 1:  # nothing to all-reduce: DDP's reducer would only copy every gradient into its buckets
        return torch_trainable(model, train, ctx, no_grad_sync=contextlib.nullcontext, autocast=autocast)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # LoRA freezes most weights; DDP then needs to skip them when building its reducer buckets (it does). A base
    # stored in bf16 (train.lora.base_dtype) runs under the same autocast, which has nothing to cast for it.
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    return torch_trainable(ddp, train, ctx, no_grad_sync=ddp.no_sync, autocast=autocast)
