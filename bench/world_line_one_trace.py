"""Whether ONE traced world size could give the FSDP2 world-size line (rehearse/worlds.py), memory first.

Today two traced world sizes give every number's fixed part and its part on the shards (a + b / dp). Here one
trace tells the parts apart by provenance. A storage is on the shards (its size in 1/dp) when it is
- a sharded parameter's local tensor, or an optimizer state of the same size;
- the output of FSDP2's reduce-scatter (c10d._reduce_scatter_base_; TP's functional reduce-scatter runs over the
  TP group, not FSDP2's);
- an operator's output, or an in-place operator's written argument, of the same size as one of its inputs on the
  shards (the all-gather's input buffer filled from the shards; the optimizer's and clipping's temporaries);
and it is so for its whole life (its bytes count from its allocation). The memory after every operator at a
second world size is predicted as the traced one with its part on the shards scaled by dp1 / dp2, and compared,
exactly, with that world size's own trace of the same shallow model (sAC 1/2's bottom-and-top blocks, 'cpcp').

    .venv/bin/python bench/world_line_one_trace.py --model llama-3.1-8b --strategy fsdp2 --grad-accum 4 \
        --worlds 8 16

Each operator's roofline cost is split the same way: the bytes it reads and writes of tensors on the shards (an
output of a shard's size, or of all the shards' together, counts so whatever its storage: FSDP2's all-gather input
is a view of its whole output buffer), scaled, against the same operator's in the other trace.

A prototype for the grid's rehearsal time (docs/results/grid-rehearsal-2026-11-28.md, last section): it patches
the step tracker in this process only; the timeline, resident storage and the virtual second end for
rehearse/worlds.py are not built yet.
"""

from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _UpdateType
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from raybench.planning.plan import plan
from raybench.rehearse import rehearsal, step_tracker, trace
from raybench.rehearse.roofline import _bytes
from raybench.spec.load import load_sweep

SWEEP = Path(__file__).resolve().parent / "sweeps" / "grid-1000.yaml"
FSDP_REDUCE_SCATTER = torch.ops.c10d._reduce_scatter_base_.default
KINDS = (True, False, True, False)  # the shallow model sAC 1/2 traces first: checkpointed, plain, checkpointed, plain


def category(reftype) -> int:
    name = str(getattr(reftype, "value", reftype)).lower().replace(" ", "_")
    return step_tracker.CATEGORIES.index(step_tracker.CATEGORY_OF[name])


def storages(tree) -> list[tuple]:
    return [(st, t) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) for st in get_untyped_storages(t)]


class ShardLedger:
    """Beside one tracker: which storages are on the shards, and every change of the tracker's memory while it
    records events (operator index, the storage's record, category, bytes), to sum the part on the shards after
    every operator once the step is traced."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.on_shards = WeakIdKeyDictionary()  # storage -> True
        self.records: dict[int, object] = {}  # id -> the tracker's record of a storage on the shards
        self.initial: list[tuple] = []
        self.changes: list[tuple] = []
        self.kept: list = []  # every record seen, alive, so that no id is reused
        self.started_at_enter = False  # what the tracker registers as it enters is in `initial`, not a change
        self.costs: list[tuple[float, float, float]] = []  # per operator: compute s, memory s, memory s on the shards

    def mark(self, st) -> None:
        self.on_shards[st] = True
        record = self.tracker._WINFO.get(st, (None, None))[0]
        if record is not None:
            self.records[id(record)] = record

    def mark_model(self, model, optimizer) -> None:
        for p in model.parameters():
            if not isinstance(p, DTensor):
                continue
            local = p._local_tensor
            states = [v._local_tensor if isinstance(v, DTensor) else v for v in optimizer.state.get(p, {}).values()]
            for t in [local] + [v for v in states if isinstance(v, torch.Tensor) and v.numel() == local.numel() > 1]:
                for st in get_untyped_storages(t):
                    self.mark(st)

    def started(self) -> None:
        """The tracker entered: its records of the model and optimizer exist now."""
        self.initial = [(r, category(r.reftype), r.mem_consumed) for r, _ in self.tracker._WINFO.values()]
        self.kept = [r for r, _, _ in self.initial]
        for st in list(self.on_shards.keys()):
            self.mark(st)
        self.started_at_enter = True

    def changed(self, kind, record, old_bytes, old_reftype) -> None:
        if not self.started_at_enter:
            return
        at = self.tracker.events.count
        self.kept.append(record)
        if kind == _UpdateType.ADD:
            self.changes.append((at, record, category(record.reftype), record.mem_consumed))
        elif kind == _UpdateType.DEL:
            self.changes.append((at, record, category(record.reftype), -record.mem_consumed))
        elif kind == _UpdateType.REF:
            self.changes += [(at, record, category(old_reftype), -record.mem_consumed),
                             (at, record, category(record.reftype), record.mem_consumed)]
        elif kind == _UpdateType.SIZE:
            self.changes.append((at, record, category(record.reftype), record.mem_consumed - old_bytes))

    def operator(self, func, args, kwargs, out) -> None:
        if func is FSDP_REDUCE_SCATTER:
            for st, _ in storages(out):
                self.mark(st)
            return
        sizes = {t.numel() for st, t in storages((args, kwargs)) if st in self.on_shards}
        if not sizes:
            return
        written = storages(out)
        if func._schema.is_mutable:
            written += [pair for i, a in enumerate(func._schema.arguments) if a.is_write and i < len(args)
                        for pair in storages(args[i])]
        for st, t in written:
            if t.numel() in sizes and t.numel() > 1 and st not in self.on_shards:
                self.mark(st)

    def cost(self, func, args, kwargs, out) -> None:
        """The operator's roofline seconds, and the part of its bytes' seconds that sits on the shards."""
        roofline = self.tracker.costs.roofline
        if func in self.tracker.costs.collectives or not roofline.bandwidth:
            return
        _, compute_s, memory_s = roofline.cost(func, args, kwargs, out)
        on_shards = 0
        if roofline.launches_kernel(func, out):
            read = [(st, t) for st, t in storages((args, kwargs))]
            shards = [t.numel() for st, t in read if st in self.on_shards]
            # An output of a shard's size, or of all of them together (FSDP2's all-gather input, a view of its
            # whole output buffer), is on the shards whatever its storage.
            sizes = set(shards) | {sum(shards)} if shards else set()
            on_shards = sum(_bytes(t) for st, t in read if st in self.on_shards) + sum(
                _bytes(t) for st, t in storages(out) if st in self.on_shards or t.numel() in sizes)
        self.costs.append((compute_s, memory_s, on_shards / roofline.bandwidth))

    def on_shards_after_each(self, count: int) -> list[list[int]]:
        """Bytes on the shards by category after each of the first `count` recorded operators."""
        now = [0] * len(step_tracker.CATEGORIES)
        for record, cat, nbytes in self.initial:
            now[cat] += nbytes if id(record) in self.records else 0
        found, j = [], 0
        for i in range(count):
            while j < len(self.changes) and self.changes[j][0] <= i:
                _, record, cat, nbytes = self.changes[j]
                now[cat] += nbytes if id(record) in self.records else 0
                j += 1
            found.append(list(now))
        return found


def install() -> dict:
    """Give every step tracker of this process a ShardLedger; returns where the last traced step's ledger lands."""
    last: dict = {}
    tracker_cls = step_tracker.StepTracker
    dispatch, snap, enter = tracker_cls.__torch_dispatch__, tracker_cls._update_snap, tracker_cls.__enter__
    track_from_start, step_trace = trace._track_from_start, trace._step_trace

    def patched_dispatch(self, func, types, args=(), kwargs=None):
        out = dispatch(self, func, types, args, kwargs)
        if out is not NotImplemented and not self.propagation.depth and func not in step_tracker._NOTHING_TO_COUNT:
            self.ledger.operator(func, args, kwargs or {}, out)
            self.ledger.cost(func, args, kwargs or {}, out)
        return out

    def patched_snap(self, kind, record, old_mem_consumed=None, old_reftype=None):
        snap(self, kind, record, old_mem_consumed, old_reftype)
        if hasattr(self, "ledger"):
            self.ledger.changed(kind, record, old_mem_consumed, old_reftype)

    def patched_enter(self):
        entered = enter(self)
        self.ledger.started()
        return entered

    def patched_track_from_start(tracker, trainable, train):
        track_from_start(tracker, trainable, train)
        tracker.ledger = ShardLedger(tracker)
        tracker.ledger.mark_model(trainable.model, trainable.optimizer)

    def patched_step_trace(tracker, *args):
        last["ledger"] = tracker.ledger
        return step_trace(tracker, *args)

    tracker_cls.__torch_dispatch__, tracker_cls._update_snap = patched_dispatch, patched_snap
    tracker_cls.__enter__ = patched_enter
    trace._track_from_start, trace._step_trace = patched_track_from_start, patched_step_trace
    return last


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "tp_fsdp2"])
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--worlds", type=int, nargs=2, default=[8, 16], help="traced, then predicted (and traced)")
    args = parser.parse_args()
    last = install()
    points = {t.axis_values["resources.workers"]: t for t in plan(load_sweep(SWEEP))
              if t.axis_values["model.preset"] == args.model and t.axis_values["train.strategy"] == args.strategy
              and t.axis_values["train.grad_accum"] == args.grad_accum and t.axis_values["train.ac_ratio"] == "1/2"}
    traced, steps = {}, {}
    for world in args.worlds:
        t = points[world]
        step = rehearsal._trace(t.config, t.shape, 0, "H100 SXM", rehearsal.SHIPPED_CALIBRATION, KINDS,
                                record_events=True)
        traced[world] = (step.memory_events, last["ledger"].on_shards_after_each(step.memory_events.count))
        steps[world] = (step, last["ledger"].costs)
    tp = 8 if args.strategy == "tp_fsdp2" else 1
    (one, on_shards), (two, _) = traced[args.worlds[0]], traced[args.worlds[1]]
    dp1, dp2 = args.worlds[0] // tp, args.worlds[1] // tp
    width = len(step_tracker.CATEGORIES)
    off = [(i, c) for i in range(one.count) for c in range(width)
           if Fraction(one.category_bytes[i * width + c] - on_shards[i][c]) + Fraction(on_shards[i][c] * dp1, dp2)
           != two.category_bytes[i * width + c]]
    (_, costs1), (_, costs2) = steps[args.worlds[0]], steps[args.worlds[1]]
    # Each operator's memory seconds, its part on the shards scaled, against the same operator's in the other trace.
    predicted = [(c, m - s + s * dp1 / dp2) for c, m, s in costs1]
    worst = max((abs(m - m2) / m2 for (_, m), (_, m2, _) in zip(predicted, costs2) if m2), default=0.0)
    roofline_s = [sum(max(c, m) for c, m in predicted), sum(max(c, m) for c, m, _ in costs2)]
    alike = steps[args.worlds[0]][0].comm_bytes == steps[args.worlds[1]][0].comm_bytes
    print(f"costs: operators {len(costs1)} (their twin: {len(costs2)}); memory seconds, largest relative difference "
          f"{worst:.1e}; roofline seconds (all micro-batches once) predicted {roofline_s[0]:.9g}, traced "
          f"{roofline_s[1]:.9g}; collectives' bytes alike: {alike}")
    print(f"{args.model} {args.strategy} x{args.grad_accum}: FSDP2 group {dp1} traced, {dp2} predicted; operators "
          f"{one.count} (their twin traced: {two.count}); memory values {one.count * width}, off {len(off)}")


if __name__ == "__main__":
    main()
