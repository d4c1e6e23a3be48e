"""Selective activation checkpointing's placement: which decoder blocks an sAC ratio checkpoints."""

from __future__ import annotations

from fractions import Fraction
from math import floor


def checkpointed_blocks(ratio: Fraction, num_layers: int) -> list[int]:
    """0-based indices of the decoder blocks sAC ratio p in [0, 1] checkpoints.

    Placement (as in IDRIS's study and IBM fms-fsdp): walking blocks i = 1..L, block i is checkpointed when i*p
    crosses the next cut-off 0.5, 1.5, 2.5, ...; so checkpointed blocks are spread evenly rather than bunched
    at one end, and p=1/2 gives [ac, no, ac, no, ...]. Exact fractions avoid float ties at the cut-offs.
    """
    half = Fraction(1, 2)
    cuts_reached = [floor(i * ratio + half) for i in range(num_layers + 1)]
    return [i - 1 for i in range(1, num_layers + 1) if cuts_reached[i] > cuts_reached[i - 1]]
