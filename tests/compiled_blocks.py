"""One decoder block really compiled: what it keeps for backward eager and under inductor, generating and
running its kernels, on CPU (tests/unit) or CUDA (tests/gpu). The rehearsal's fake-tensor counts are checked
against it."""

from __future__ import annotations

import contextlib

import torch

from raybench.rehearse import compiled


def saved_by_real_inductor(trial, op_policy: bool = False, device: str = "cpu") -> tuple[int, int, int]:
    """(eager, compiled, input) bytes one block of `trial` keeps for backward: the hooks see what its compiled
    autograd function saves; input: the block's input, on this rank. A TP block's collectives run on a fake
    group, on real tensors. op_policy: the block checkpointed with the trial's op-level policy (eager, its
    cache reported by the policy)."""
    real, train = contextlib.nullcontext(), trial.config.train
    with compiled.block_world(train, device) as mesh:
        block = compiled.block_and_inputs(trial.config, trial.shape, real, mesh, torch.device(device))
        with torch.no_grad():
            for tensor in block.module.parameters():
                compiled._local(tensor).normal_(std=0.02)
        kept_by_policy = {}
        eager_block = compiled._policy_block(block.module, train, kept_by_policy) if op_policy else block.module
        eager = compiled._saved_bytes(lambda: block.forward(eager_block), block.module, real, kept_by_policy)
        torch._dynamo.reset()
        try:
            run = torch.compile(compiled._policy_block(block.module, train, None) if op_policy else block.module)
            kept = compiled._saved_bytes(lambda: block.forward(run), block.module, real)
        finally:
            torch._dynamo.reset()
    return eager, kept, sum(compiled._storages(block.hidden).values())
