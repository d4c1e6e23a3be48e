"""Activation offloading (train.offload_activations): what each decoder block's forward saves for backward waits
in pinned host memory instead of on the GPU, and comes back as backward reaches the block (torchtune's
activation offloading, for long sequences whose activations do not fit).

Every tensor autograd saves inside a block's forward passes through saved-tensor hooks (`_pack`, `_unpack`):
a CUDA tensor of at least MIN_BYTES that is not a parameter (the weights a matmul saves stay where they are) is
copied to a pinned host buffer and dropped from the GPU; backward copies it back. The copies run on the compute
stream, in order with the kernels around them: that keeps their buffers safe without events, and puts their
time on the step (the rehearsal prices them so: 2 x the bytes over the GPU's host link). A checkpointed block
saves nothing through these hooks (its checkpoint keeps its input itself and recomputes the rest), so offloading
helps the blocks that are not checkpointed.

Applied after compile in build's order (spec/options.py), but refused with compile by the plan: torch.compile
traces a block's forward hooks into its graph, where these hooks must run eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

from raybench.runtime.model import decoder_blocks
from raybench.spec.sweep_spec import TrainSpec

# The rehearsal traces the step without it (a fake tensor never leaves its device) and prices what it moves
# from one block's count (rehearse/rehearsal.py).
TRACED = False
# Smaller saved tensors stay on the GPU: a copy's fixed cost outweighs what they hold (torchtune's default too).
MIN_BYTES = 1 << 20


def wanted(train: TrainSpec) -> bool:
    return train.offload_activations


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    for block in decoder_blocks(model):
        scope = _BlockScope()
        block.register_forward_pre_hook(scope.enter)
        block.register_forward_hook(scope.exit)
    return model


def offloads(t: torch.Tensor) -> bool:
    """Whether a saved tensor goes to host memory (the rehearsal counts with this too, on any device): not a
    parameter, nor a view of one (a matmul saves its weight transposed), and not small."""
    base = t._base if t._base is not None else t
    return not isinstance(base, nn.Parameter) and t.untyped_storage().nbytes() >= MIN_BYTES


def _pack(t: torch.Tensor):
    if t.device.type != "cuda" or not offloads(t):
        return t
    host = torch.empty_like(t, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    return t.device, host


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


class _BlockScope:
    """The saved-tensor hooks around one block's forward: entered before it, left after it."""

    def __init__(self):
        self._open: list = []

    def enter(self, module: nn.Module, args) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        hooks.__enter__()
        self._open.append(hooks)

    def exit(self, module: nn.Module, args, output) -> None:
        self._open.pop().__exit__(None, None, None)
