"""Executors start a trial's ranks and return rank 0's metrics: `execute(payload) -> dict`.

- train:    a Ray Train V2 TorchTrainer per trial (new worker processes every trial).
- torchrun: plain `torchrun` on this machine, no Ray (for `raybench trial` and debugging).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def get(name: str) -> Callable[[dict], dict]:
    return importlib.import_module(f"raybench.executors.{name}").execute
