"""The timed training loop: every step timed between device synchronizations, warm-up reported apart.

Each step is also split into phases — data (host wait for the batch and its copy), forward, backward (which
includes the gradient reduction that DDP/FSDP overlap with it), optimizer (clipping, step, zeroing). On GPU the
boundaries are CUDA events, read after the step's closing synchronization, so measuring adds no sync inside
the step; on CPU, where ops run synchronously, they are host clock readings.

Timing is per rank; the worker combines ranks afterwards (a step is as slow as its slowest rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from raybench.runtime.data import IGNORE_INDEX, NONPAD_TOKENS
from raybench.runtime.probe import PHASES, LoopRecord
from raybench.runtime.sampler import Sampler
from raybench.runtime.strategies import Trainable
from raybench.spec.sweep_spec import TrainSpec

class PhaseClock:
    """Accumulates time per phase within one step: `mark(phase)` closes the interval since the last mark."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks = [("", self._now())]

    def mark(self, phase: str) -> None:
        self.marks.append((phase, self._now()))

    def totals_s(self) -> dict[str, float]:
        """Seconds per phase for the step; call after the step's closing synchronization."""
        totals = dict.fromkeys(PHASES, 0.0)
        for (_, before), (phase, after) in zip(self.marks, self.marks[1:]):
            totals[phase] += before.elapsed_time(after) / 1000 if self.cuda else after - before
        return totals


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: computed on vocabulary-split logits (loss_parallel) it is a replicated DTensor,
    whose local value is the whole loss on every rank."""
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _to_device(batch: dict, device: torch.device) -> dict:
    # Not every entry is a tensor: flash attention's varlen arguments include the longest sequence, an int.
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _nonpad_tokens(batch: dict) -> int:
    """A batch's non-padding tokens, counted on the host (no device sync), and taken out of the batch: hf data
    says how many it holds (its packed rows' padded tails carry no mask); padded data masks its padding; data
    without padding carries no mask, and every token counts."""
    given = batch.pop(NONPAD_TOKENS, None)
    if given is not None:
        return int(given)
    mask = batch.get("attention_mask")
    return batch["input_ids"].numel() if mask is None else int(mask.sum())


def _label_tokens(batch: dict) -> int | None:
    """A batch's label tokens (those the loss counts), counted on the host before the batch moves (no sync); None
    for labels that are not a plain host tensor (the rehearsal's fake batches: no values to count)."""
    labels = batch["labels"]
    if type(labels) is not torch.Tensor or labels.device.type != "cpu":
        return None
    return int((labels != IGNORE_INDEX).sum())


@dataclass
class StepCounts:
    """One step's tokens on this rank: all of them, the non-padding ones, the labels (None: not counted) and the
    micro-batches with none."""

    tokens: int = 0
    nonpad: int = 0
    labels: int | None = 0
    unlabelled: int = 0


def train_step(trainable: Trainable, batches: Iterator[dict], train: TrainSpec, device: torch.device,
               clock: PhaseClock, sync: bool = True) -> tuple[torch.Tensor, StepCounts]:
    """One optimizer step over grad_accum micro-batches; returns (loss tensor, its counts).

    sync=False skips the gradient reduction of the last micro-batch too (see `backward_with_and_without_sync`).
    """
    total_loss = torch.zeros((), device=device)
    counts = StepCounts()
    clock.start()
    for micro in range(train.grad_accum):
        host_batch = next(batches)
        counts.tokens += host_batch["input_ids"].numel()
        counts.nonpad += _nonpad_tokens(host_batch)
        labels = _label_tokens(host_batch)
        counts.labels = None if labels is None or counts.labels is None else counts.labels + labels
        counts.unlabelled += labels == 0
        batch = _to_device(host_batch, device)
        clock.mark("data")
        last = micro == train.grad_accum - 1
        sync_ctx = torch.enable_grad() if last and sync else trainable.no_grad_sync()
        with sync_ctx, trainable.loss_context():
            with trainable.autocast():
                loss = _plain(trainable.model(**batch, use_cache=False).loss) / train.grad_accum
            clock.mark("forward")
            trainable.backward(loss)
            clock.mark("backward")
        total_loss += loss.detach()
    trainable.step()
    clock.mark("optimizer")
    return total_loss, counts


def timed_loop(trainable: Trainable, batches: Iterator[dict], train: TrainSpec, device: torch.device,
               sampler: Sampler | None = None, on_step: Callable[[float], None] | None = None) -> LoopRecord:
    """train.steps timed steps; `on_step` gets each one's seconds between steps (the rank's progress marks)."""
    record = LoopRecord(phase_times_s={p: [] for p in PHASES})
    clock = PhaseClock(device)
    losses = []
    synchronize(device)
    for _ in range(train.steps):
        start = time.perf_counter()
        record.step_starts.append(start)
        loss, counts = train_step(trainable, batches, train, device, clock)
        synchronize(device)
        record.step_times_s.append(time.perf_counter() - start)
        for phase, seconds in clock.totals_s().items():
            record.phase_times_s[phase].append(seconds)
        losses.append(loss)
        record.tokens.append(counts.tokens)
        record.nonpad_tokens.append(counts.nonpad)
        if counts.labels is not None:
            record.label_tokens.append(counts.labels)
            record.unlabelled_micro_batches.append(counts.unlabelled)
        if sampler is not None:
            sampler.tick()
        if on_step is not None:
            on_step(record.step_times_s[-1])
    # Losses stay on the device until the end so reading them never adds a sync inside the timed steps.
    record.losses = torch.stack(losses).float().cpu().tolist()
    return record


def backward_without_sync(trainable: Trainable, batches: Iterator[dict], train: TrainSpec, device: torch.device,
                          steps: int) -> list[float]:
    """Backward seconds of `steps` steps that do not reduce gradients, for the exposed communication.

    The timed window's steps are the same steps with the reduction, so only these need to run: the reduction
    DDP overlaps with backward shows in the backward phase only where it is not hidden, and the difference of
    the two medians is the exposed communication. Run after the timed window: the steps without reduction
    leave the ranks' weights slightly apart, which no later measurement reads.
    """
    clock = PhaseClock(device)
    local = []
    for _ in range(steps):
        train_step(trainable, batches, train, device, clock, sync=False)
        synchronize(device)
        local.append(clock.totals_s()["backward"])
    return local
