"""Executors start a trial's ranks and return rank 0's result: `execute(payload) -> RankResult` (spec.schema: the
metrics, and where and with what they were measured), which `drivers.trial.build_row` makes the row.

- pool:     warm Ray actors that run trial after trial.
- train:    a Ray Train V2 TorchTrainer per trial (new worker processes every trial).
- torchrun: plain `torchrun` on this machine, no Ray (for `raybench trial` and debugging).
- command:  a command-line stack's trial (`command`, `torchtune`, `torchtitan`) under either of them: its command
            line, out of process.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from raybench.spec import stacks
from raybench.spec.payload import TrialPayload
from raybench.spec.schema import RankResult

# Ray starts its worker processes at niceness 15, so that its own daemons win the CPU; a trial's ranks (pool
# actors, Ray Train workers, and torchrun ranks, which inherit their trial driver's niceness) would then lose
# time slices to every other busy process of the node, which a process started from a shell (niceness 0) does
# not (docs/results/warm-fidelity-2026-11-24.md). Every process raybench starts through Ray runs at niceness 0.
RAY_WORKER_ENV = {"RAY_worker_niceness": "0"}


def get(name: str) -> Callable[[TrialPayload], RankResult]:
    """The executor's `execute`; a trial of a kind whose ranks a command line starts (the registry's in_process:
    false; `command`, `torchtune`, `torchtitan`) runs its command instead (executors/command.py):
    in a Ray task holding its resources under `train`, on this machine under `torchrun`."""
    execute = importlib.import_module(f"raybench.drivers.executors.{name}").execute

    def run(payload: TrialPayload) -> RankResult:
        if stacks.kind(payload.config.stack.kind).in_process:
            return execute(payload)
        command = importlib.import_module("raybench.drivers.executors.command")
        return command.execute(payload) if name == "torchrun" else command.execute_on_ray(payload)

    return run
