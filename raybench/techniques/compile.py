"""torch.compile each decoder block in place.

Per-block compilation (as torchtitan does) keeps graphs small, compiles one block shape once and reuses it
for every layer, and composes with FSDP2's per-block hooks; compiling the whole model would graph-break at
every FSDP2 hook. The HF forward must run with use_cache=False or each layer recompiles.
"""

from __future__ import annotations

from torch import nn


def apply(blocks: nn.ModuleList) -> None:
    for block in blocks:
        block.compile()
