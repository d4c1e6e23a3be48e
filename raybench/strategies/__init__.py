"""Distributed strategies. Each module has one function, `setup(model, train, ctx) -> Trainable`.

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

from raybench.config import TrainSpec


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


def setup(name: str, model: nn.Module, train: TrainSpec, ctx: RankContext) -> Trainable:
    return importlib.import_module(f"raybench.strategies.{name}").setup(model, train, ctx)


def make_optimizer(model: nn.Module, train: TrainSpec, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # Fused AdamW is CUDA-only; foreach is the fast path elsewhere.
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay, fused=fused, foreach=not fused)


def torch_trainable(model: nn.Module, train: TrainSpec, ctx: RankContext, no_grad_sync, autocast) -> Trainable:
    optimizer = make_optimizer(model, train, ctx.device)
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        if train.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Trainable(model, optimizer, lambda loss: loss.backward(), step, no_grad_sync, autocast)


def autocast_for(train: TrainSpec, device: torch.device) -> Callable[[], ContextManager]:
    if train.precision == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
