"""The user's own training stacks as trials (`stack.kind`): each module builds the stack's trainer for one trial
and hooks the probe into it; `measure` runs it and reduces every rank's record into the row, by the same path as
raybench's own loop (`rank_metrics`). One module per stack: hf (transformers Trainer, TRL SFTTrainer), lightning.
A `command` stack runs out of process: its executor launches the command and `rank_metrics.combine`s the records
the probe wrote (`drivers/executors/command.py`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotation only: torchtune_recipe runs in a stack's own environment, without pydantic
    from raybench.planning.payload import TrialPayload
    from raybench.spec.schema import RankResult

IN_PROCESS = ("hf", "lightning")


def run(payload: TrialPayload) -> RankResult | None:
    """Run the trial's stack on this rank; rank 0 returns the result, the other ranks None."""
    from raybench.runtime.stacks import measure

    kind = payload.config.stack.kind
    if kind not in IN_PROCESS:
        raise ValueError(f"stack.kind {kind!r} does not run inside a raybench worker (in-process stacks: "
                         f"{', '.join(IN_PROCESS)})")
    stack = importlib.import_module(f"raybench.runtime.stacks.{kind}")
    return measure.measured_run(payload, stack.build)
