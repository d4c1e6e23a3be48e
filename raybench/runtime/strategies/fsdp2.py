"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks.

Each decoder block is its own FSDP unit (all-gathered just before it runs, freed after if
reshard_after_forward), then the root takes the embeddings and head. bf16 uses a MixedPrecisionPolicy with
gradients reduced in train.reduce_dtype (fp32 by default), so no autocast is needed. A LoRA base stored in bf16
(train.lora.base_dtype) shares its units with the fp32 adapters: FSDP2 asks one dtype of a unit's trainable
parameters only, and gathers the bf16 base without a cast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from raybench.runtime.model import decoder_blocks
from raybench.runtime.strategies import RankContext, Trainable, already_materialized, torch_trainable
from raybench.spec.sweep_spec import TrainSpec


def shard(model: nn.Module, train: TrainSpec, mesh: DeviceMesh) -> Callable[[], ContextManager]:
    """fully_shard each decoder block, then the root, over a 1D mesh; returns the no-gradient-sync context."""
    mp = MixedPrecisionPolicy()
    if train.precision == "bf16":
        reduce_dtype = torch.bfloat16 if train.reduce_dtype == "bf16" else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=train.reshard_after_forward)
    for block in decoder_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)

    @contextlib.contextmanager
    def no_grad_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return no_grad_sync


def setup(model: nn.Module, train: TrainSpec, ctx: RankContext, materialize=already_materialized) -> Trainable:
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    no_grad_sync = shard(model, train, mesh)
    materialize(False)
    return torch_trainable(model, train, ctx, no_grad_sync=no_grad_sync, autocast=contextlib.nullcontext)
