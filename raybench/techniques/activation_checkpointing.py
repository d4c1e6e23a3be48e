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


def apply(blocks, indices: list[int]) -> None:
    """Wrap the chosen blocks (a torch ModuleList, modified in place) with non-reentrant checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i in indices:
        # Non-reentrant checkpointing composes with FSDP2, DDP and torch.compile; the reentrant variant does not.
        blocks[i] = checkpoint_wrapper(blocks[i])
