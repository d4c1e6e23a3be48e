"""The timed training loop: every step timed between device synchronizations, warm-up reported apart.

Timing is per rank; the worker combines ranks afterwards (a step is as slow as its slowest rank).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from raybench.config import TrainSpec
from raybench.strategies import Trainable


@dataclass
class LoopRecord:
    step_times_s: list[float] = field(default_factory=list)  # every step, warm-up included
    losses: list[float] = field(default_factory=list)
    nonpad_tokens: list[int] = field(default_factory=list)  # this rank's non-padding tokens per step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_step(trainable: Trainable, batches: Iterator[dict], train: TrainSpec, device: torch.device) -> tuple:
    """One optimizer step over grad_accum micro-batches; returns (loss tensor, non-padding tokens)."""
    total_loss = torch.zeros((), device=device)
    nonpad = 0
    for micro in range(train.grad_accum):
        host_batch = next(batches)
        nonpad += int(host_batch["attention_mask"].sum())  # counted on the host: no device sync
        batch = _to_device(host_batch, device)
        last = micro == train.grad_accum - 1
        sync_ctx = torch.enable_grad() if last else trainable.no_grad_sync()
        with sync_ctx:
            with trainable.autocast():
                loss = trainable.model(**batch, use_cache=False).loss / train.grad_accum
            trainable.backward(loss)
        total_loss += loss.detach()
    trainable.step()
    return total_loss, nonpad


def timed_loop(trainable: Trainable, batches: Iterator[dict], train: TrainSpec, device: torch.device) -> LoopRecord:
    record = LoopRecord()
    losses = []
    synchronize(device)
    for _ in range(train.steps):
        start = time.perf_counter()
        loss, nonpad = train_step(trainable, batches, train, device)
        synchronize(device)
        record.step_times_s.append(time.perf_counter() - start)
        losses.append(loss)
        record.nonpad_tokens.append(nonpad)
    # Losses stay on the device until the end so reading them never adds a sync inside the timed steps.
    record.losses = torch.stack(losses).float().cpu().tolist()
    return record
