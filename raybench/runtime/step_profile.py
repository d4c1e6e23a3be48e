"""Where a step's time goes: a few more training steps under torch.profiler, reduced to seconds per category.

Runs after the timed window (train.profile_steps), so the row's timings never include the profiler. Every event
the profiler records gets one category, its own or the first one an enclosing event has, in this order:
- comm: collectives (c10d, functional collectives, NCCL or gloo), their waits included;
- optimizer: everything inside torch.optim's `Optimizer.step#...` and `Optimizer.zero_grad#...` ranges;
- attention: scaled-dot-product attention (flash, efficient, math) and its kernels;
- matmul: mm, addmm, bmm, baddbmm, _scaled_mm, matmul, linear and their backward nodes; GEMM kernels;
- elementwise: every other op or kernel that ran (norms, activations, casts, copies, the loss).
The order settles nesting: a matmul inside attention (the math backend) is attention, a collective inside the
optimizer (ZeRO) is communication. Each event counts with its self time, so nothing is counted twice.

On CUDA the times are the device's: each kernel, memcpy or memset is one interval, categorized by its name and
the op that launched it; idle is the step's wall time minus the union of those intervals (the device busy with
anything). Kernels that overlap (communication on its own stream next to compute) each count in full, so there
the categories and idle add up to more than the wall time, by the overlap. On CPU the times are the ops' self
times on the thread that runs the step; idle is the wall time they leave: Python between ops, the profiler's
own recording, waits outside any op. There the categories and idle add up to the wall time exactly.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from raybench.runtime import bench
from raybench.runtime.strategies import Trainable
from raybench.spec.sweep_spec import TrainSpec

# One range per profiled step: its start and end bound the step's wall time and which events belong to it.
STEP_RANGE = "raybench.profile_step"
# Busy categories by precedence: an event takes the first category that it or any enclosing event matches.
_PATTERNS = (
    ("comm", re.compile(r"c10d|nccl|gloo|record_param_comms", re.IGNORECASE)),
    ("optimizer", re.compile(r"^Optimizer\.(step|zero_grad)#")),
    ("attention", re.compile(r"scaled_?dot_?product|attention|flash|fmha|sdpa", re.IGNORECASE)),
    # Kernels by library: cuBLAS (gemm, nvjet on Hopper), CUTLASS, xmma; inductor's matmul templates.
    ("matmul", re.compile(r"aten::(mm|addmm|bmm|baddbmm|_scaled_mm|matmul|linear|addmv|mv)\b"
                          r"|\b(mm|addmm|bmm|baddbmm)backward|gemm|cutlass|xmma|nvjet|cublas|triton_tem_fused_\w*mm",
                          re.IGNORECASE)),
)
BUSY = tuple(name for name, _ in _PATTERNS) + ("elementwise",)
_ELEMENTWISE = len(_PATTERNS)  # the precedence of "everything else": last
# Device activities that occupy the GPU (its annotations only mirror the CPU's ranges).
_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
# The row's columns, seconds per profiled step; `profile_step_s` is the profiled step's wall time.
COLUMNS = ("profile_matmul_s", "profile_attention_s", "profile_elementwise_s", "profile_optimizer_s",
           "profile_comm_s", "profile_idle_s", "profile_step_s")


def profile_training(trainable: Trainable, batches: Iterator[dict], train: TrainSpec, device: torch.device,
                     reduce: bool = True) -> dict[str, float]:
    """train.profile_steps more training steps of the trial, profiled: the row's COLUMNS (empty when off, or
    when not `reduce`)."""
    if train.profile_steps == 0:
        return {}
    clock = bench.PhaseClock(device)
    return profile_steps(lambda: bench.train_step(trainable, batches, train, device, clock), train.profile_steps,
                         device, reduce)


def profile_steps(step: Callable[[], object], steps: int, device: torch.device,
                  reduce: bool = True) -> dict[str, float]:
    """Run `step` `steps` times under the profiler; seconds per step by category (COLUMNS).

    Every rank of a trial runs its steps profiled, so that all ranks pay the profiler alike and wait on each
    other as they would; only the rank that reports reduces the events (`reduce`): reading them is the slow
    part (torch's own parsing takes seconds for the tens of thousands of events of a few steps)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    bench.synchronize(device)  # no earlier work runs into the first step
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                step()
                # Inside the range: the step's device work ends before its wall time does.
                bench.synchronize(device)
    if not reduce:
        return {}
    events = list(prof.events())
    _link_device_events(prof.profiler.kineto_results, events)
    return breakdown(events, steps, cuda)


def _link_device_events(results, events: list) -> None:
    """Give each event the id of the op that launched it (`linked_correlation_id`, 0 for an op itself) where
    torch's FunctionEvent lacks it (torch 2.11 keeps it only on the profiler's raw events). The raw event
    an event was built from has its correlation id, device type and trace-relative times, computed as torch
    computes them; an event whose raw twins disagree stays unlinked."""
    if all(hasattr(e, "linked_correlation_id") for e in events):
        return
    start_ns = results.trace_start_ns()
    links: dict[tuple, set[int]] = {}
    for raw in results.events():
        key = (raw.correlation_id(), raw.device_type(), (raw.start_ns() - start_ns) / 1000,
               (raw.end_ns() - start_ns) / 1000)
        links.setdefault(key, set()).add(raw.linked_correlation_id())
    for event in events:
        if not hasattr(event, "linked_correlation_id"):
            found = links.get((event.id, event.device_type, event.time_range.start, event.time_range.end), set())
            event.linked_correlation_id = found.pop() if len(found) == 1 else 0


def breakdown(events: list, steps: int, cuda: bool) -> dict[str, float]:
    """The profiler's events as seconds per step by category: the device's kernels on CUDA, the step thread's
    ops on CPU."""
    events = sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end))  # parents before children
    marks = [e for e in events if e.name == STEP_RANGE and e.device_type == DeviceType.CPU]
    if len(marks) != steps:
        raise RuntimeError(f"the profiler recorded {len(marks)} of {steps} profiled step(s)")
    categories = _categories(events)
    wall_us = sum(m.time_range.elapsed_us() for m in marks)
    if cuda:
        busy_us, union_us = _device_busy_us(events, marks, categories)
    else:
        busy_us = _host_busy_us(events, marks[0].thread, categories, _inside_steps(events))
        union_us = sum(busy_us.values())  # one thread: its ops never overlap
    per_step_s = {f"profile_{name}_s": us / steps / 1e6 for name, us in busy_us.items()}
    return {**per_step_s, "profile_idle_s": (wall_us - union_us) / steps / 1e6, "profile_step_s": wall_us / steps / 1e6}


def category(name: str) -> str:
    """The category an op or kernel name alone gets (an enclosing op's can take precedence)."""
    return BUSY[_own_precedence(name)]


@functools.cache  # a step runs the same few hundred op and kernel names over and over
def _own_precedence(name: str) -> int:
    return next((i for i, (_, pattern) in enumerate(_PATTERNS) if pattern.search(name)), _ELEMENTWISE)


def _categories(events: list) -> dict[int, int]:
    """id(event) -> the precedence of its category, for the host events: the first category it or any enclosing
    event matches (events come parents first, so each parent is settled before its children)."""
    found = {}
    for event in events:
        if event.device_type != DeviceType.CPU:
            continue
        parent = event.cpu_parent
        inherited = found.get(id(parent), _ELEMENTWISE) if parent is not None else _ELEMENTWISE
        found[id(event)] = min(_own_precedence(event.name), inherited)
    return found


def _in_step(event, marks: list) -> int | None:
    """The index of the profiled step whose range holds the event's start; None outside every step."""
    start = event.time_range.start
    return next((i for i, m in enumerate(marks) if m.time_range.start <= start < m.time_range.end), None)


def _inside_steps(events: list) -> set[int]:
    """id(event) of the host events enclosed by a step's range (events come parents first)."""
    inside = set()
    for event in events:
        parent = event.cpu_parent if event.device_type == DeviceType.CPU else None
        if parent is not None and (parent.name == STEP_RANGE or id(parent) in inside):
            inside.add(id(event))
    return inside


def _host_busy_us(events: list, thread: int, categories: dict[int, int], inside: set[int]) -> dict[str, float]:
    """Self time of the step thread's events inside the steps, by category. A range a library opened around
    Python code (a user annotation) counts where it is a category's own (the optimizer step's Python is the
    optimizer's); elsewhere its self time is host time between ops: idle."""
    busy_us = dict.fromkeys(BUSY, 0.0)
    for event in events:
        if event.device_type != DeviceType.CPU or event.thread != thread or event.is_async:
            continue
        if id(event) not in inside:
            continue
        precedence = categories[id(event)]
        if event.is_user_annotation and precedence == _ELEMENTWISE:
            continue
        busy_us[BUSY[precedence]] += event.self_cpu_time_total
    return busy_us


def _device_busy_us(events: list, marks: list, categories: dict[int, int]) -> tuple[dict[str, float], float]:
    """Device time inside the steps by category, and the union of the device's busy intervals (kernels on
    several streams overlap), each clipped to its step's range."""
    launched_by = {e.id: e for e in events if e.device_type == DeviceType.CPU and e.linked_correlation_id == 0}
    busy_us = dict.fromkeys(BUSY, 0.0)
    intervals = [[] for _ in marks]
    for event in events:
        if event.device_type != DeviceType.CUDA or not _device_work(event):
            continue
        step = _in_step(event, marks)
        if step is None:
            continue
        # A kernel inductor or a library launched outside any op has only its name to go by.
        op = launched_by.get(event.linked_correlation_id)
        inherited = categories[id(op)] if op is not None else _ELEMENTWISE
        precedence = min(_own_precedence(event.name), inherited)
        busy_us[BUSY[precedence]] += event.time_range.elapsed_us()
        end = min(event.time_range.end, marks[step].time_range.end)
        intervals[step].append((event.time_range.start, end))
    return busy_us, sum(_union_us(step_intervals) for step_intervals in intervals)


def _device_work(event) -> bool:
    """A kernel, copy or fill, not the device's copy of a host range. torch 2.11 names no activity type:
    there every device event but those copies is work."""
    kind = getattr(event, "activity_type", None)
    return kind in _DEVICE_WORK if kind is not None else not event.is_user_annotation


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total = 0.0
    covered_to = float("-inf")
    for start, end in sorted(intervals):
        start = max(start, covered_to)
        if end > start:
            total += end - start
            covered_to = end
    return total
