"""2D parallelism: tensor parallel inside groups of tp_size ranks, FSDP2 sharding across the groups.

The mesh is (dp, tp) with tp innermost, so a TP group is tp_size consecutive ranks (on GPU clusters: one node's
NVLink domain, where TP's per-block all-reduces belong). TP is applied first so FSDP2 shards the already
TP-split DTensors along dp (`fully_shard(mesh=mesh["dp"])`; the `dp_mesh_dims=` form failed here).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from raybench.runtime.strategies import RankContext, Trainable, already_materialized, fsdp2, torch_trainable, tp
from raybench.spec.sweep_spec import TrainSpec


def setup(model: nn.Module, train: TrainSpec, ctx: RankContext, materialize=already_materialized) -> Trainable:
    dp_size = ctx.world_size // train.tp_size
    mesh = init_device_mesh(ctx.device.type, (dp_size, train.tp_size), mesh_dim_names=("dp", "tp"))
    loss_context = tp.parallelize(model, mesh["tp"], train)
    no_grad_sync = fsdp2.shard(model, train, mesh["dp"])
    materialize(False)
    # FSDP2's MixedPrecisionPolicy casts for bf16 (as in fsdp2), so no autocast; grads mix 2D and dp-only
    # DTensors, hence TP's mesh-aware clipping.
    return torch_trainable(model, train, ctx, no_grad_sync=no_grad_sync, autocast=contextlib.nullcontext,
                           clip_grad_norm=tp.clip_grad_norm, loss_context=loss_context)
