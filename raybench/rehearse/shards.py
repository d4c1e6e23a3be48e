"""One traced FSDP2 step at a second FSDP2 group size, from the same trace: its part on the shards told apart.

worlds.py shares a step across world sizes on the line a + b / dp through two ends. Here one trace gives both ends:
the `ShardLedger` beside the step tracker tells, by provenance, which storages are on the shards (their sizes go
as 1 / dp) for their whole life, and which bytes each operator reads and writes of them:
- a sharded parameter's local tensor, and an optimizer state of its size;
- the output of FSDP2's reduce-scatter (c10d._reduce_scatter_base_; TP's functional reduce-scatter runs over the TP
  group, not FSDP2's);
- what an operator returns, or an in-place operator writes, of the same size as one of its inputs on the shards
  (the all-gather's input buffer filled from the shards; the optimizer's and clipping's temporaries); for an
  operator's bytes also an output of all its shards' size together (FSDP2's all-gather input, a view of its whole
  output buffer, whose storage is not on the shards).
The trace counts every operator a second time as it costs at the other group size (a second StepCosts, given the
operator's cost with its seconds of bytes on the shards scaled), and `second_end` builds that group size's StepTrace:
the memory after every operator with its part on the shards scaled (its peaks replayed as worlds.py does), the
costs, the timeline and the resident storage. Checked equal, field by field, to that group size's own trace on ten
steps of 1B to 72B under FSDP2 and TP x FSDP2 (docs/results/grid-rehearsal-2026-11-28.md).
"""

from __future__ import annotations

import dataclasses
from array import array
from fractions import Fraction

import torch
import torch.utils._pytree as pytree
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _UpdateType
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from raybench.rehearse import worlds
from raybench.rehearse.roofline import OpCost, tensor_bytes
from raybench.rehearse.step_costs import StepCosts
from raybench.rehearse.step_tracker import CATEGORIES, CATEGORY_OF
from raybench.spec.schema import GIB

FSDP_REDUCE_SCATTER = torch.ops.c10d._reduce_scatter_base_.default
_REDUCE_SCATTER_NAME = "reduce_scatter_base"  # its name among the step's collectives (step_costs)


def _category(reftype) -> int:
    return CATEGORIES.index(CATEGORY_OF[str(getattr(reftype, "value", reftype)).lower().replace(" ", "_")])


def _storages(tree) -> list[tuple]:
    return [(st, t) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) for st in get_untyped_storages(t)]


class ShardLedger:
    """Beside one step tracker (`tracker.ledger`): which storages are on the shards, every change of the tracker's
    memory while it records (operator index, the storage's record, category, bytes), and the step counted again
    at group size dp / scale (`other`)."""

    def __init__(self, tracker, trainable, scale: Fraction):
        self.tracker, self.trainable, self.scale = tracker, trainable, scale
        self.scale_float = float(scale)
        self.on_shards = WeakIdKeyDictionary()  # storage -> True
        self.records: dict[int, object] = {}  # id -> the tracker's record of a storage on the shards
        self.initial: list[tuple] = []  # (record, category, bytes) of what the tracker held as it entered
        self.changes: list[tuple] = []  # they hold every record they name, so no record's id is reused meanwhile
        self.entered = False  # what the tracker registers as it enters is in `initial`, not a change
        self.reduce_scatters = 0  # FSDP2's, recognised (`second_end` checks them against the step's)
        self.other = StepCosts(tracker.costs.roofline)
        for p in trainable.model.parameters():
            if isinstance(p, DTensor):
                self._mark_with_states(p._local_tensor, trainable.optimizer.state.get(p, {}).values())

    def _mark_with_states(self, local: torch.Tensor, states) -> None:
        states = [v._local_tensor if isinstance(v, DTensor) else v for v in states]
        for t in [local] + [v for v in states if isinstance(v, torch.Tensor) and v.numel() == local.numel() > 1]:
            for st in get_untyped_storages(t):
                self._mark(st)

    def _mark(self, st) -> None:
        self.on_shards[st] = True
        record = self.tracker._WINFO.get(st, (None, None))[0]
        if record is not None:
            self.records[id(record)] = record

    def entered_tracker(self) -> None:
        """The tracker entered: its records of the model and optimizer exist now."""
        self.initial = [(r, _category(r.reftype), r.mem_consumed) for r, _ in self.tracker._WINFO.values()]
        for st in list(self.on_shards.keys()):
            self._mark(st)
        self.entered = True

    def changed(self, kind, record, old_bytes, old_reftype) -> None:
        """One change of the tracker's memory (MemTracker._update_snap's)."""
        if not self.entered:
            return
        at = self.tracker.events.count
        if kind == _UpdateType.ADD:
            self.changes.append((at, record, _category(record.reftype), record.mem_consumed))
        elif kind == _UpdateType.DEL:
            self.changes.append((at, record, _category(record.reftype), -record.mem_consumed))
        elif kind == _UpdateType.REF:
            self.changes += [(at, record, _category(old_reftype), -record.mem_consumed),
                             (at, record, _category(record.reftype), record.mem_consumed)]
        elif kind == _UpdateType.SIZE:
            self.changes.append((at, record, _category(record.reftype), record.mem_consumed - old_bytes))

    def operator(self, part: int, func, args, kwargs: dict, out, backward: bool, modules,
                 cost: OpCost | None) -> None:
        """One operator the tracker counted in part `part` at `cost` (None: a collective): mark what it made on the
        shards, and count it again as it costs at the other group size."""
        read = _storages((args, kwargs))
        shards = [t.numel() for st, t in read if st in self.on_shards]
        if func is FSDP_REDUCE_SCATTER:
            self.reduce_scatters += 1
            for st, _ in _storages(out):
                self._mark(st)
        elif shards:
            written = _storages(out)
            if func._schema.is_mutable:
                written += [pair for i, a in enumerate(func._schema.arguments) if a.is_write and i < len(args)
                            for pair in _storages(args[i])]
            for st, t in written:
                if t.numel() in shards and t.numel() > 1 and st not in self.on_shards:
                    self._mark(st)
        bandwidth = self.other.roofline.bandwidth
        if cost is not None and shards and bandwidth and cost.launches:
            # its seconds of bytes on the shards scaled: what the operator costs at the other group size
            whole = set(shards) | {sum(shards)}
            nbytes = sum(tensor_bytes(t) for st, t in read if st in self.on_shards) + sum(
                tensor_bytes(t) for st, t in _storages(out) if st in self.on_shards or t.numel() in whole)
            shard_s = nbytes / bandwidth
            cost = cost._replace(memory_s=cost.memory_s - shard_s + shard_s * self.scale_float)
        self.other.count(self.other.parts[part], func, args, kwargs, out, backward, modules, cost)

    def _on_shards_initially(self) -> list[int]:
        now = [0] * len(CATEGORIES)
        for record, cat, nbytes in self.initial:
            now[cat] += nbytes if id(record) in self.records else 0
        return now

    def _on_shards_after_each(self, count: int) -> list[list[int]]:
        """Bytes on the shards by category after each of the first `count` recorded operators."""
        now, found, j = self._on_shards_initially(), [], 0
        for i in range(count):
            while j < len(self.changes) and self.changes[j][0] <= i:
                _, record, cat, nbytes = self.changes[j]
                now[cat] += nbytes if id(record) in self.records else 0
                j += 1
            found.append(list(now))
        return found

    def _resident_gib(self) -> dict[str, float]:
        """trace._resident_gib at the other group size: the DTensors' local shards scaled."""
        def local_bytes(t: torch.Tensor) -> Fraction:
            local = t.to_local() if isinstance(t, DTensor) else t
            return local.numel() * local.element_size() * (self.scale if isinstance(t, DTensor) else 1)

        model, optimizer = self.trainable.model, self.trainable.optimizer
        params = sum(local_bytes(p) for p in {id(p): p for p in model.parameters()}.values())
        states = sum(local_bytes(v) for state in optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor))
        return {"parameters": _whole(params, "parameters") / GIB, "optimizer_state": _whole(states, "states") / GIB}


class NotSplit(ValueError):
    """The part on the shards does not scale to whole bytes at the other group size."""


def _whole(value: Fraction, name: str) -> int:
    if value.denominator != 1 or value < 0:
        raise NotSplit(name)
    return int(value)


def _scaled(nbytes: int, on_shards: int, scale: Fraction, name: str) -> int:
    """`nbytes` with its part `on_shards` scaled by `scale`, in whole bytes (NotSplit if not): integer arithmetic,
    as this runs for every category after every operator."""
    if not on_shards and nbytes >= 0:
        return nbytes
    value, rest = divmod((nbytes - on_shards) * scale.denominator + on_shards * scale.numerator, scale.denominator)
    if rest or value < 0:
        raise NotSplit(name)
    return value


def second_end(step, ledger: ShardLedger, dp: int, times: list[int]):
    """The traced `step` (a StepTrace whose memory_events and sharding are recorded) at FSDP2 group size `dp`
    (= its own / ledger.scale), each traced micro-batch counted `times` times; NotSplit where a size does not come
    out whole, or where the step reduce-scattered without the ledger recognising FSDP2's reduce-scatter (another
    torch's FSDP2 calling another operator: its gradient shards would go uncounted)."""
    if step.comm_calls.get(_REDUCE_SCATTER_NAME) and not ledger.reduce_scatters:
        raise NotSplit("FSDP2's reduce-scatter not recognised")
    events, width = step.memory_events, len(CATEGORIES)
    on_shards = ledger._on_shards_after_each(events.count)
    scaled = worlds.MemoryEvents(events.categories, places=events.places, place_index=events.place_index,
                                 backward_entry=events.backward_entry)
    scaled.initial_bytes = tuple(_scaled(x, s, ledger.scale, CATEGORIES[c]) for c, (x, s) in
                                 enumerate(zip(events.initial_bytes, ledger._on_shards_initially())))
    scaled.category_bytes = array("q", (
        _scaled(events.category_bytes[i * width + c], on_shards[i][c], ledger.scale, CATEGORIES[c])
        for i in range(events.count) for c in range(width)))
    memory_gib, place_gib, entry_gib = worlds.replay(scaled)
    total = ledger.other.step_total(times)
    *micro_batches, optimizer_step = ledger.other.parts
    return dataclasses.replace(
        step, memory_gib=memory_gib, place_gib=place_gib, backward_entry_gib=entry_gib,
        resident_gib=ledger._resident_gib(), comm_bytes=dict(total.comm_bytes), comm_calls=dict(total.comm_calls),
        flops=total.flops, roofline_s=total.roofline_s, compute_s=total.compute_s, memory_s=total.memory_s,
        op_s=dict(total.op_s), block_memory_bound_s=total.block_memory_bound_s,
        optimizer_roofline_s=optimizer_step.roofline_s, launches=total.launches,
        timeline=[(n, part.events) for part, n in zip(micro_batches, times)] + [(1, optimizer_step.events)],
        memory_events=scaled, sharding=dataclasses.replace(step.sharding, dp=dp), second=None)
