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

With --share-to, the first trace also counts every operator as it costs at the second world size (a second
StepCosts whose roofline scales the operator's seconds on the shards), and builds the second end from it
(`virtual_end`: memory after every operator, costs, timeline, resident storage); that virtual end is compared
field by field with the second world size's own trace, and the line through it (worlds.share) at a third world
size with the line through the two traced ends.

    .venv/bin/python bench/world_line_one_trace.py --model qwen2.5-72b --strategy tp_fsdp2 --grad-accum 4 \
        --worlds 16 64 --share-to 128

A prototype for the grid's rehearsal time (docs/results/grid-rehearsal-2026-11-28.md, last section): it patches
the step tracker in this process only.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from array import array
from fractions import Fraction
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _UpdateType
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from raybench.planning.plan import plan
from raybench.rehearse import rehearsal, step_tracker, trace, worlds
from raybench.rehearse.roofline import _bytes
from raybench.rehearse.step_costs import StepCosts
from raybench.spec.schema import GIB
from raybench.spec.load import load_sweep

SWEEP = Path(__file__).resolve().parent / "sweeps" / "grid-1000.yaml"
FSDP_REDUCE_SCATTER = torch.ops.c10d._reduce_scatter_base_.default
KINDS = (True, False, True, False)  # the shallow model sAC 1/2 traces first: checkpointed, plain, checkpointed, plain


def category(reftype) -> int:
    name = str(getattr(reftype, "value", reftype)).lower().replace(" ", "_")
    return step_tracker.CATEGORIES.index(step_tracker.CATEGORY_OF[name])


def storages(tree) -> list[tuple]:
    return [(st, t) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) for st in get_untyped_storages(t)]


class ScaledRoofline:
    """The tracker's roofline, with the current operator's seconds of bytes on the shards (`shard_s`, set by the
    ledger before each operator) scaled by `scale`: what the operator costs at the other world size."""

    def __init__(self, roofline, scale: float):
        self.inner, self.scale, self.shard_s = roofline, scale, 0.0

    def cost(self, func, args, kwargs, out):
        flops, compute_s, memory_s = self.inner.cost(func, args, kwargs, out)
        return flops, compute_s, memory_s - self.shard_s + self.shard_s * self.scale

    def __getattr__(self, name):
        return getattr(self.inner, name)


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
        self.scale = None  # dp1 / dp2, where the step is counted at a second world size too (`other`)
        self.other: StepCosts | None = None
        self.trainable = None

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
            return 0.0
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
        return on_shards / roofline.bandwidth

    def initial_on_shards(self) -> list[int]:
        """Bytes on the shards by category as the step began."""
        now = [0] * len(step_tracker.CATEGORIES)
        for record, cat, nbytes in self.initial:
            now[cat] += nbytes if id(record) in self.records else 0
        return now

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


def _whole(value: Fraction) -> int:
    assert value.denominator == 1, value
    return int(value)


def _resident_gib(trainable, scale: Fraction) -> dict[str, float]:
    """trace._resident_gib at the other world size: DTensors' local shards scaled, plain tensors as they are."""
    def local_bytes(t) -> Fraction:
        if isinstance(t, DTensor):
            local = t.to_local()
            return local.numel() * local.element_size() * scale
        return Fraction(t.numel() * t.element_size())

    params = sum(local_bytes(p) for p in {id(p): p for p in trainable.model.parameters()}.values())
    states = sum(local_bytes(v) for st in trainable.optimizer.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor))
    return {"parameters": _whole(params) / GIB, "optimizer_state": _whole(states) / GIB}


def virtual_end(step, ledger, dp2: int):
    """The traced `step` (FSDP2 group size step.sharding.dp) at group size dp2, from its own ledger: every part
    on the shards scaled, the operators counted as they cost there (`ledger.other`)."""
    scale = Fraction(step.sharding.dp, dp2)
    events, width = step.memory_events, len(step_tracker.CATEGORIES)
    on_shards = ledger.on_shards_after_each(events.count)
    scaled = worlds.MemoryEvents(events.categories, places=events.places, place_index=events.place_index,
                                 backward_entry=events.backward_entry)
    scaled.initial_bytes = tuple(_whole(x - s + s * scale)
                                 for x, s in zip(events.initial_bytes, ledger.initial_on_shards()))
    scaled.category_bytes = array("q", (_whole(events.category_bytes[i * width + c] - on_shards[i][c]
                                               + on_shards[i][c] * scale)
                                        for i in range(events.count) for c in range(width)))
    memory_gib, place_gib, entry_gib = worlds._replay(scaled)
    times = trace.traced_accumulation(step.grad_accum)[1]
    total = ledger.other.step_total(times)
    *micro_batches, optimizer_step = ledger.other.parts
    return dataclasses.replace(
        step, memory_gib=memory_gib, place_gib=place_gib, backward_entry_gib=entry_gib,
        resident_gib=_resident_gib(ledger.trainable, scale), comm_bytes=dict(total.comm_bytes),
        comm_calls=dict(total.comm_calls), flops=total.flops, roofline_s=total.roofline_s,
        compute_s=total.compute_s, memory_s=total.memory_s, op_s=dict(total.op_s),
        block_memory_bound_s=total.block_memory_bound_s, optimizer_roofline_s=optimizer_step.roofline_s,
        launches=total.launches,
        timeline=[(n, part.events) for part, n in zip(micro_batches, times)] + [(1, optimizer_step.events)],
        memory_events=scaled, sharding=dataclasses.replace(step.sharding, dp=dp2))


def differences(one, other, path: str = "") -> list[str]:
    """Where two traces' fields differ (nested): numbers beyond 1e-9 relative, anything else unequal."""
    if isinstance(one, dict) and isinstance(other, dict):
        if one.keys() != other.keys():
            return [f"{path}: keys differ"]
        return [d for key in one for d in differences(one[key], other[key], f"{path}.{key}")]
    if isinstance(one, (list, tuple)) and isinstance(other, (list, tuple)) and len(one) == len(other):
        return [d for i, (a, b) in enumerate(zip(one, other)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(one, float) and isinstance(other, float):
        return [] if math.isclose(one, other, rel_tol=1e-9, abs_tol=1e-300) else [f"{path}: {one} vs {other}"]
    return [] if one == other else [f"{path}: {one} vs {other}"]


def compared(one, other) -> list[str]:
    fields = [f.name for f in dataclasses.fields(one) if f.name not in ("memory_events", "sharding", "block_ops")]
    return differences({f: getattr(one, f) for f in fields}, {f: getattr(other, f) for f in fields})


def install() -> dict:
    """Give every step tracker of this process a ShardLedger; returns where the last traced step's ledger lands."""
    last: dict = {}
    tracker_cls = step_tracker.StepTracker
    dispatch, snap, enter = tracker_cls.__torch_dispatch__, tracker_cls._update_snap, tracker_cls.__enter__
    track_from_start, step_trace = trace._track_from_start, trace._step_trace
    next_part = tracker_cls.next_part

    def patched_dispatch(self, func, types, args=(), kwargs=None):
        part = len(self.costs.parts) - 1
        out = dispatch(self, func, types, args, kwargs)
        if out is not NotImplemented and not self.propagation.depth and func not in step_tracker._NOTHING_TO_COUNT:
            self.ledger.operator(func, args, kwargs or {}, out)
            shard_s = self.ledger.cost(func, args, kwargs or {}, out)
            other = self.ledger.other
            if other is not None:
                other.roofline.shard_s = shard_s
                other.count(other.parts[part], func, args, kwargs or {}, out, self._mod_tracker.is_bw,
                            self._mod_tracker.parents)
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
        tracker.ledger.trainable = trainable
        tracker.ledger.mark_model(trainable.model, trainable.optimizer)
        if last.get("scale"):
            tracker.ledger.scale = last["scale"]
            tracker.ledger.other = StepCosts(ScaledRoofline(tracker.costs.roofline, last["scale"]))

    def patched_next_part(self):
        next_part(self)
        if self.ledger.other is not None:
            self.ledger.other.next_part()

    def patched_step_trace(tracker, *args):
        last["ledger"] = tracker.ledger
        return step_trace(tracker, *args)

    tracker_cls.__torch_dispatch__, tracker_cls._update_snap = patched_dispatch, patched_snap
    tracker_cls.__enter__ = patched_enter
    tracker_cls.next_part = patched_next_part
    trace._track_from_start, trace._step_trace = patched_track_from_start, patched_step_trace
    return last


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "tp_fsdp2"])
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--worlds", type=int, nargs=2, default=[8, 16], help="traced, then predicted (and traced)")
    parser.add_argument("--share-to", type=int, help="a third world size: the line through the traced step and its "
                        "virtual second end there, against the line through the two traced steps")
    args = parser.parse_args()
    last = install()
    tp = 8 if args.strategy == "tp_fsdp2" else 1
    last["scale"] = Fraction(args.worlds[0], args.worlds[1])  # the first trace counts its operators at both
    points = {t.axis_values["resources.workers"]: t for t in plan(load_sweep(SWEEP))
              if t.axis_values["model.preset"] == args.model and t.axis_values["train.strategy"] == args.strategy
              and t.axis_values["train.grad_accum"] == args.grad_accum and t.axis_values["train.ac_ratio"] == "1/2"}
    traced, steps, ledgers = {}, {}, {}
    for world in args.worlds:
        t = points[world]
        step = rehearsal._trace(t.config, t.shape, 0, "H100 SXM", rehearsal.SHIPPED_CALIBRATION, KINDS,
                                record_events=True)
        traced[world] = (step.memory_events, last["ledger"].on_shards_after_each(step.memory_events.count))
        steps[world] = (step, last["ledger"].costs)
        ledgers[world] = last["ledger"]
        last["scale"] = None
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
    first, second = steps[args.worlds[0]][0], steps[args.worlds[1]][0]
    virtual = virtual_end(first, ledgers[args.worlds[0]], dp2)
    print(f"virtual end at {dp2} against its own trace: fields off {compared(virtual, second)[:5] or 'none'}")
    if args.share_to:
        dp3 = args.share_to // tp
        by_virtual = worlds.share(dp3, {dp1: first, dp2: virtual})
        by_traced = worlds.share(dp3, {dp1: first, dp2: second})
        print(f"shared to {dp3} through the virtual end against through two traced ends: fields off "
              f"{compared(by_virtual, by_traced)[:5] or 'none'}")
    print(f"{args.model} {args.strategy} x{args.grad_accum}: FSDP2 group {dp1} traced, {dp2} predicted; operators "
          f"{one.count} (their twin traced: {two.count}); memory values {one.count * width}, off {len(off)}")


if __name__ == "__main__":
    main()
