"""torch.compile each decoder block in place.

Per-block compilation (as torchtitan does) keeps graphs small, compiles one block shape once and reuses it
for every layer, and composes with FSDP2's per-block hooks; compiling the whole model would graph-break at
every FSDP2 hook. The HF forward must run with use_cache=False or each layer recompiles.
"""

from __future__ import annotations

import torch
from torch import nn

from raybench.config import TrainSpec
from raybench.model import decoder_blocks


def wanted(train: TrainSpec) -> bool:
    return train.compile


def apply(model: nn.Module, train: TrainSpec) -> nn.Module:
    # Past dynamo's recompile limit a "compiled" block would silently run eager: fail the trial instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for block in decoder_blocks(model):
        block.compile()
    return model
