"""What held a trial's GPU memory at its peak: torch's CUDA allocator history, recorded on request.

Set RAYBENCH_CUDA_MEMORY_SNAPSHOT to a directory and every CUDA rank of a trial records the allocator's history
(`torch.cuda.memory._record_memory_history`, with the Python stack of each allocation) from before its model
is built to the end of its timed steps, then writes there:
- `<trial_id>-<host>-gpu<n>.pickle`: torch's snapshot, for https://pytorch.org/memory_viz;
- `<trial_id>-<host>-gpu<n>-peak.json`: the most bytes live at once in the training window (the one the row's
  peak_alloc_gib covers: from the end of the build to the end of the steps) and the tensors live then, grouped by
  where they were allocated (`live_at_peak`); `recording_peak_gib` is the peak of the whole recording (warm-up
  and build included).

Recording costs host time at every allocation: a recorded trial's timings are not the configuration's, only
its memory is (its row says so through env_json). Diagnoses a row whose peak the rehearsal or the estimate
misses (docs/rehearse.md, gaps).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from raybench.spec.errors import ConfigError, Problem
from raybench.spec.schema import GIB

ENV = "RAYBENCH_CUDA_MEMORY_SNAPSHOT"
# Allocator events kept. Past it the oldest go, and with them what the model's build allocated: the peak file
# then says its history is incomplete (keep such a trial's steps few).
MAX_ENTRIES = 200_000
# Frames that say who allocated, most telling first: a live allocation is grouped under the innermost frame of
# the first of these packages on its stack (a model's line over the nn.Module call under it, which every layer
# shares; raybench's own frames, such as the step's backward call, when nothing else names it).
_OWNERS = ("transformers/", "peft/", "liger_kernel/", "deepspeed/", "torch/nn/parallel/", "torch/distributed/",
           "torch/optim/", "torch/utils/checkpoint", "raybench/")
_GROUPS_KEPT = 25
# CUDA device index -> allocator events recorded before its training window opened (mark_training_start); an
# entry exists while that device records.
_training_starts: dict[int, int] = {}


def requested() -> Path | None:
    directory = os.environ.get(ENV)
    return Path(directory) if directory else None


def check(trials: list, source: str) -> None:
    """Refuse a recording request for planned trials that run on CPU, before anything starts (ConfigError)."""
    directory = requested()
    on_cpu = [t.trial_id for t in trials if t.config.resources.gpus_per_worker == 0]
    if directory and on_cpu:
        raise ConfigError(source, [Problem(ENV, str(directory), f"records the CUDA allocator's history, and "
                                           f"{len(on_cpu)} trial(s) run on CPU ({on_cpu[0]} first); unset "
                                           f"{ENV}, or give the trials GPUs (resources.gpus_per_worker: 1)")])


@contextlib.contextmanager
def recording(directory: Path, device, name: str) -> Iterator[None]:
    """Record the allocator's history on `device` (a torch.device) for the duration of the block; write
    `name`.pickle and `name`-peak.json into `directory` at its end (also when the block fails: an OOM's history
    is the one wanted)."""
    import torch  # the CLI imports this module to check a request; torch only when a rank records

    if device.type != "cuda":
        raise ValueError(f"{ENV}={directory}: the CUDA allocator's history needs a CUDA device, this rank runs on "
                         f"{device.type}; unset {ENV} for CPU trials")
    directory.mkdir(parents=True, exist_ok=True)
    # Python stacks only: unwinding C++ stacks at every allocation would slow the steps far more.
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=MAX_ENTRIES, device=device)
    index = device.index or 0
    _training_starts[index] = 0
    try:
        yield
    finally:
        snapshot = torch.cuda.memory._snapshot(device)
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
        with open(directory / f"{name}.pickle", "wb") as f:
            pickle.dump(snapshot, f)
        events = snapshot["device_traces"][index]
        start = _training_starts.pop(index)
        complete = len(events) < MAX_ENTRIES
        if not complete:  # a full history lost its oldest events, and with them the mark's position
            start = 0
        peak = {**live_at_peak(events, since=start), "window": "training" if start else "recording",
                "recording_peak_gib": live_at_peak(events)["peak_gib"], "history_complete": complete}
        (directory / f"{name}-peak.json").write_text(json.dumps(peak, indent=1))


def mark_training_start(device) -> None:
    """Open the training window where the worker resets CUDA's peak counter before the steps, so that the peak
    file's peak is the row's peak_alloc_gib (a build or warm-up that peaked higher is not it). No-op unless
    `device` is recording."""
    index = device.index or 0
    if device.type == "cuda" and index in _training_starts:
        import torch

        _training_starts[index] = len(torch.cuda.memory._snapshot(device)["device_traces"][index])


def live_at_peak(events: list[dict], since: int = 0) -> dict:
    """Replay one device's allocator events: the most bytes live at once from event `since` on, and the
    allocations live then, grouped by allocation site (`_owner`) with their sizes summed, largest first. The
    window opens with what is live at `since` (as CUDA's peak counter does when reset). What was allocated before
    the recording began is not in the events and not counted: a worker records from before its model's build."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for i, event in enumerate(events):
        if i == since:
            peak, at_peak = total, list(live.values())
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak and i >= since:
                peak, at_peak = total, list(live.values())
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    if since >= len(events):  # the window opened after the last event: what was live then
        peak, at_peak = total, list(live.values())
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in at_peak:
        group = groups[_owner(event.get("frames", []))]
        group[0] += event["size"]
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_gib": peak / GIB, "allocations": len(at_peak),
            "groups": [{"allocated_at": where, "gib": size / GIB, "allocations": count}
                       for where, (size, count) in ranked[:_GROUPS_KEPT]],
            "other_gib": sum(size for _, (size, _) in ranked[_GROUPS_KEPT:]) / GIB}


def _owner(frames: list[dict]) -> str:
    """`file:line:function` of the innermost frame (frames come innermost first) in the first of _OWNERS found."""
    python = [f for f in frames if f["filename"].endswith(".py")]
    for owner in _OWNERS:
        for frame in python:
            if owner in frame["filename"]:
                short = frame["filename"].rsplit("site-packages/", 1)[-1]
                return f"{short}:{frame['line']}:{frame['name']}"
    return "(no Python frame)"
