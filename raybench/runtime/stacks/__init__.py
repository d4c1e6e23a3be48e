"""The user's own training stacks as trials (`stack.kind`): each module builds the stack's trainer for one trial
and hooks the probe into it; `measure` runs it and reduces every rank's record into the row, by the same path as
raybench's own loop (`rank_metrics`). One module per in-process kind, named by its descriptor
(raybench.spec.stacks): hf (transformers Trainer, TRL SFTTrainer), lightning. A command-line kind runs out of
process: its executor launches the command and `rank_metrics.combine`s the records the probe wrote
(`drivers/executors/command.py`); torchtune_recipe and torchtitan_train are the launchers torchtune's and
torchtitan's commands run in their own environments.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotation only: torchtune_recipe runs in a stack's own environment, without pydantic
    from raybench.spec.payload import TrialPayload
    from raybench.spec.schema import RankResult


def run(payload: TrialPayload) -> RankResult | None:
    """Run the trial's stack on this rank; rank 0 returns the result, the other ranks None."""
    from raybench.runtime.stacks import measure
    from raybench.spec import stacks
    from raybench.spec.stacks import protocol

    stack = stacks.kind(payload.config.stack.kind)
    if not (stack.in_process and stack.runtime):
        in_process = [k.name for k in stacks.KINDS.values() if k.in_process and k.runtime]
        raise ValueError(f"stack.kind {stack.name!r} does not run inside a raybench worker (in-process stacks: "
                         f"{', '.join(in_process)})")
    module = protocol.checked(importlib.import_module(stack.runtime), protocol.InProcessTrainer, stack.name)
    return measure.measured_run(payload, module.build)
