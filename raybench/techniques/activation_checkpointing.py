"""Layer-level selective activation checkpointing (sAC): checkpoint a ratio p of the decoder blocks.

Placement (as in IDRIS's study and IBM fms-fsdp): walking blocks i = 1..L, block i is checkpointed when i*p
crosses the next cut-off 0.5, 1.5, 2.5, ...; so checkpointed blocks are spread evenly rather than bunched at
one end, and p=1/2 gives [ac, no, ac, no, ...]. Exact fractions avoid float ties at the cut-offs.
"""

from __future__ import annotations

from fractions import Fraction
from math import floor


def checkpointed_blocks(ratio: Fraction, num_layers: int) -> list[int]:
    """0-based indices of the decoder blocks to checkpoint for ratio p in [0, 1]."""
    half = Fraction(1, 2)
    cuts_reached = [floor(i * ratio + half) for i in range(num_layers + 1)]
    return [i - 1 for i in range(1, num_layers + 1) if cuts_reached[i] > cuts_reached[i - 1]]


def apply(blocks, indices: list[int], mode: str = "block") -> None:
    """Wrap the chosen blocks (a torch ModuleList, modified in place) with non-reentrant checkpointing.

    mode "block" recomputes a whole block in backward; "op" recomputes only what `op_policy` does not save.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    extra = {"context_fn": op_policy_contexts} if mode == "op" else {}
    for i in indices:
        # Non-reentrant checkpointing composes with FSDP2, DDP and torch.compile; the reentrant variant does not.
        blocks[i] = checkpoint_wrapper(blocks[i], **extra)


def _saved_ops() -> set:
    """Ops whose outputs op-level AC keeps: matmuls, attention kernels and reduce-scatters (torchtitan's list).

    These are the expensive ops to recompute; everything else (norms, activations, elementwise) is cheap
    compute on large tensors and is recomputed instead.
    """
    import torch

    aten = torch.ops.aten
    ops = {aten.mm.default, aten.max.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           torch.ops._c10d_functional.reduce_scatter_tensor.default}
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        ops.add(aten._scaled_dot_product_cudnn_attention.default)
    return ops


def op_policy_contexts():
    """Fresh (forward, recompute) contexts for one checkpointed call, with torchtitan's "op" SAC policy.

    Every second matmul is recomputed rather than saved, as torchtitan does, so that the saved activations
    shrink by about half of the matmul outputs while the most expensive kernels (attention) are never rerun.
    The mm counters live per call and per pass so the forward and the recompute make the same decisions.
    """
    from collections import defaultdict

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()
    mm_counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func == torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            mm_counts[key] += 1
            if mm_counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
