"""Step timing for any training loop: the per-rank record raybench's own loop writes, from someone else's loop.

A user's training stack (a transformers Trainer, Lightning, torchtune, a script of their own) calls the probe
once per optimizer step; the trial then reduces every rank's record into the same columns as raybench's own loop
(`rank_metrics`): tok/s/device over the timed window, step p50/p90 with warm-up excluded, losses, peaks.

    from raybench.runtime.probe import StepProbe

    probe = StepProbe()                       # this rank's device: the current CUDA device, else the CPU
    probe.count_params(model)                 # total and trainable parameters (a LoRA script: its adapters train)
    probe.start()                             # right before the first step
    for batch in loader:
        loss = train_step(batch)
        probe.step(tokens=batch["input_ids"].numel(), nonpad_tokens=int(batch["attention_mask"].sum()), loss=loss)
    probe.finish()                            # under a raybench `command` trial: writes this rank's record

Each `step` call ends the step that began at the previous call (or at `start`) and synchronizes the device first,
so that a step's end is when its kernels finished, as raybench's own loop times it. That one synchronization per
optimizer step is the probe's only cost inside the loop (bench/probe_overhead.py measures it). A stack whose loop
raybench hooks (hf, lightning, torchtune, torchtitan) adds each micro-batch to a `StepCounter`, which ends the
probe's step at each optimizer step.

Imports torch lazily and nothing else outside the standard library, so a stack's own environment needs only
raybench's source on its path (docs/stacks/command.md).
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("data", "forward", "backward", "optimizer")

# Set by raybench for a `command` trial's processes: where each rank's record goes (`finish`).
RECORD_DIR_ENV = "RAYBENCH_PROBE_DIR"
# KiB: ru_maxrss's unit on Linux.
_KIB = 1024


@dataclass
class LoopRecord:
    """One rank's steps, as raybench's loop (`bench.timed_loop`) and the probe record them."""

    step_times_s: list[float] = field(default_factory=list)  # every step, warm-up included
    step_starts: list[float] = field(default_factory=list)  # perf_counter() at each step's start
    losses: list[float | None] = field(default_factory=list)  # None: not known (nan: the loss was nan)
    # raybench's own loop: this rank's label tokens per step, and its micro-batches with none (a user's loop: empty).
    label_tokens: list[int] = field(default_factory=list)
    unlabelled_micro_batches: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # this rank's tokens per step, padding included
    nonpad_tokens: list[int] = field(default_factory=list)  # this rank's non-padding tokens per step
    # Per phase, seconds per step: raybench's own loop only (a user's loop has no phase boundaries: empty).
    phase_times_s: dict[str, list[float]] = field(default_factory=dict)


class StepProbe:
    def __init__(self, device=None):
        self.device = device if device is not None else _default_device()
        self.record = LoopRecord()
        self.on_step = None  # called after each step's record (raybench's utilization sampler ticks here)
        self.params: dict[str, int] | None = None  # {"total", "trainable"} as the script reported them
        self._last: float | None = None

    def count_params(self, model) -> None:
        """Report the model this rank trains: its parameters and those that train (`requires_grad`), as built,
        before or after a wrapper (DDP, FSDP2's DTensors count whole). The row's params_trainable and, from it, its
        FLOPs per token: trainable below total is a frozen base (LoRA: 4 FLOPs a weight a token plus 2 per trainable
        one), equal is a full fine-tune (6)."""
        total, trainable = param_counts(model)
        self.set_params(total=total, trainable=trainable)

    def set_params(self, total: int, trainable: int) -> None:
        """`count_params` for a script that counts its parameters itself."""
        if not 0 < int(trainable) <= int(total):
            raise ValueError(f"StepProbe.set_params(total={total}, trainable={trainable}): trainable parameters "
                             "must be at least 1 and at most the total")
        self.params = {"total": int(total), "trainable": int(trainable)}

    def start(self) -> None:
        """Mark the start of the first step (after the model, the optimizer and the data are ready)."""
        self._sync()
        self._last = time.perf_counter()

    def step(self, tokens: int, nonpad_tokens: int | None = None, loss=None) -> None:
        """End one optimizer step: `tokens` this rank processed in it (padding included), `nonpad_tokens` the
        real ones among them (None: all), and the step's loss (a number or a tensor; None: not known)."""
        self._sync()
        now = time.perf_counter()
        if self._last is None:
            raise RuntimeError("StepProbe.step() before start(): call start() right before the first step")
        self.record.step_starts.append(self._last)
        self.record.step_times_s.append(now - self._last)
        self.record.tokens.append(int(tokens))
        self.record.nonpad_tokens.append(int(tokens if nonpad_tokens is None else nonpad_tokens))
        self.record.losses.append(None if loss is None else float(loss))
        if self.on_step is not None:
            self.on_step()
        self._last = time.perf_counter()

    def peaks_gib(self) -> dict:
        """This process's peak host RSS (its whole life: the probe did not see the process start) and the device
        allocator's peaks (None on CPU)."""
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KIB / 2**30
        alloc = reserved = None
        if self.device.type == "cuda":
            import torch

            alloc = torch.cuda.max_memory_allocated(self.device) / 2**30
            reserved = torch.cuda.max_memory_reserved(self.device) / 2**30
        return {"rss_gib": rss, "alloc_gib": alloc, "reserved_gib": reserved}

    def to_dict(self) -> dict:
        """This rank's record as plain data, step starts on the wall clock (comparable across processes)."""
        offset = time.time() - time.perf_counter()
        return {"rank": int(os.environ.get("RANK", "0")), "step_times_s": self.record.step_times_s,
                "step_starts_wall": [s + offset for s in self.record.step_starts],
                "tokens": self.record.tokens, "nonpad_tokens": self.record.nonpad_tokens,
                "losses": self.record.losses, "peaks": self.peaks_gib(), "device_type": self.device.type,
                "params": self.params}

    def finish(self) -> Path | None:
        """Write this rank's record where a raybench `command` trial reads it; outside one, do nothing."""
        directory = os.environ.get(RECORD_DIR_ENV)
        if not directory:
            return None
        data = self.to_dict()
        path = Path(directory) / f"rank-{data['rank']}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
        return path

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


class StepCounter:
    """One optimizer step's micro-batches, added up as a stack's loop goes through them, until the step ends: the
    tokens (padding included), the real ones and the loss. Counts and losses may stay device tensors: the probe
    reads them after its synchronization at the step's end, so counting adds none. Every stack that hooks the probe
    into its own loop counts with it (hf, lightning, the torchtune and torchtitan launchers).

    loss_per_token: each added loss is a sum over its micro-batch's real tokens (the micro-batch's mean loss times
    its count), and the step's loss is their sum over the step's real tokens: the token-weighted mean torchtune and
    torchtitan normalize by. Otherwise each added loss is already its part of the step's loss (the Trainer's and
    Lightning's, divided over the accumulation steps), and the step's loss is their sum.
    empty_step_error: a step that ends with no micro-batch counted raises this (a loop the stack's hooks do not
    see); None: such a step is recorded as it is."""

    def __init__(self, loss_per_token: bool = False, empty_step_error: str | None = None):
        self.loss_per_token = loss_per_token
        self.empty_step_error = empty_step_error
        self._reset()

    def _reset(self) -> None:
        self.tokens = 0
        self.nonpad_tokens = 0  # a tensor once counted: read after the probe's device sync
        self.last_nonpad_tokens = 0  # the last micro-batch's, for a loss weighted by them
        self.loss = None  # None: no loss seen this step (not known)

    def add(self, tokens: int, nonpad_tokens) -> None:
        """One micro-batch: its tokens, padding included, and the real ones among them (an int or a tensor)."""
        self.tokens += tokens
        self.nonpad_tokens = self.nonpad_tokens + nonpad_tokens
        self.last_nonpad_tokens = nonpad_tokens

    def add_loss(self, loss) -> None:
        """One micro-batch's loss (see loss_per_token), a number or a detached tensor."""
        self.loss = loss if self.loss is None else self.loss + loss

    def end_step(self, probe: StepProbe) -> None:
        """End the probe's step with what was counted since the last one, and start counting the next."""
        if self.tokens == 0 and self.empty_step_error is not None:
            raise RuntimeError(self.empty_step_error)
        loss = self.loss
        if loss is not None and self.loss_per_token:
            loss = loss / self.nonpad_tokens  # no token with a label: nan, as the stacks' own division
        probe.step(tokens=self.tokens, nonpad_tokens=self.nonpad_tokens, loss=loss)
        self._reset()


def param_counts(model) -> tuple[int, int]:
    """(total, trainable) parameters of a torch module; a parameter DeepSpeed ZeRO-3 partitioned counts whole (its
    ds_numel)."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return sum(n for n, _ in sizes), sum(n for n, trainable in sizes if trainable)


def _default_device():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
