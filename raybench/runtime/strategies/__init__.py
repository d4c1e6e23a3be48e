"""Distributed strategies. Each module has one function, `setup(model, train, ctx, materialize) -> Trainable`.

The model arrives built on the meta device; `materialize(whole)` gives it its values. Strategies that hold whole
parameters (ddp, DeepSpeed ZeRO-1/2) call `materialize(True)` before wrapping; sharding strategies (fsdp2, tp,
tp_fsdp2) wrap on meta, and ZeRO-3 partitions on meta, and then call `materialize(False)`, so that each rank
allocates and fills only its own shards, and create the optimizer only after that, over the materialized
parameters.

A Trainable is what the timed loop drives: the model to call, how to run backward, how to take an optimizer
step, and how to skip gradient sync on non-final micro-batches. Plain PyTorch strategies share
`torch_trainable`; an engine with its own step (DeepSpeed) fills the same fields with its own functions.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn

from raybench.spec.sweep_spec import TrainSpec


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


@dataclass
class Trainable:
    model: nn.Module
    optimizer: Any
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]  # clip, optimizer step, zero grads
    no_grad_sync: Callable[[], ContextManager]  # wraps a micro-batch whose gradients are not reduced yet
    autocast: Callable[[], ContextManager]  # wraps forward
    # wraps forward and backward: torch's loss_parallel where the LM head's output is split over the vocabulary
    loss_context: Callable[[], ContextManager] = contextlib.nullcontext


def already_materialized(whole: bool) -> None:
    """The `materialize` of a model that has its values already (tests, benchmarks)."""


def setup(name: str, model: nn.Module, train: TrainSpec, ctx: RankContext,
          materialize: Callable[[bool], None] = already_materialized) -> Trainable:
    return importlib.import_module(f"raybench.runtime.strategies.{name}").setup(model, train, ctx, materialize)


SGD_MOMENTUM = 0.9


def make_optimizer(model: nn.Module, train: TrainSpec, device: torch.device) -> torch.optim.Optimizer:
    """The torch optimizer train.optimizer names, over the trainable parameters (DeepSpeed gets one too)."""
    params = param_groups([p for p in model.parameters() if p.requires_grad])
    if train.optimizer == "sgd":
        return torch.optim.SGD(params, lr=train.lr, momentum=SGD_MOMENTUM, weight_decay=train.weight_decay)
    if train.optimizer == "adafactor":
        return torch.optim.Adafactor(params, lr=train.lr, weight_decay=train.weight_decay)
    # "adamw": fused is the fast path on CUDA, foreach elsewhere; the other two force one implementation.
    fused = train.optimizer == "adamw_fused" or (train.optimizer == "adamw" and device.type == "cuda")
    return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay, fused=fused, foreach=not fused)


def param_groups(params: list[nn.Parameter]) -> list[dict]:
    """One optimizer parameter group per tensor kind: plain tensors, and DTensors of each device mesh.

    foreach/fused optimizer kernels take one list per group and fail on mixed Tensor/DTensor lists (tensor
    parallel leaves norms and embeddings as plain tensors); separate groups keep every kernel homogeneous.
    With DDP or FSDP2 all parameters are of one kind, so there is a single group, as before.
    """
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": group} for group in groups.values()]


def torch_trainable(model: nn.Module, train: TrainSpec, ctx: RankContext, no_grad_sync, autocast,
                    clip_grad_norm: Callable = torch.nn.utils.clip_grad_norm_,
                    loss_context: Callable[[], ContextManager] = contextlib.nullcontext) -> Trainable:
    """A Trainable for plain PyTorch wrappers; fp16 adds a GradScaler around backward and step."""
    optimizer = make_optimizer(model, train, ctx.device)
    params = [p for p in model.parameters() if p.requires_grad]
    scaler = torch.amp.GradScaler(ctx.device.type) if train.precision == "fp16" and train.grad_scaler else None

    def backward(loss: torch.Tensor) -> None:
        (scaler.scale(loss) if scaler else loss).backward()

    def step() -> None:
        if scaler:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if train.max_grad_norm is not None:
            clip_grad_norm(params, train.max_grad_norm)
        if scaler:
            scaler.step(optimizer)  # skips the step when the gradients overflowed
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Trainable(model, optimizer, backward, step, no_grad_sync, autocast, loss_context)


def autocast_for(train: TrainSpec, device: torch.device) -> Callable[[], ContextManager]:
    if train.precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.float16 if train.precision == "fp16" else torch.bfloat16
    return lambda: torch.autocast(device.type, dtype=dtype)


def data_parallel_rank(train: TrainSpec, ctx: RankContext) -> tuple[int, int]:
    """(rank, size) for feeding data: the ranks of one tensor-parallel group must see the same batch.

    TP groups are tp_size consecutive ranks (tp is the mesh's inner dimension), so they share rank // tp_size.
    """
    return ctx.rank // train.tp_size, ctx.world_size // train.tp_size
