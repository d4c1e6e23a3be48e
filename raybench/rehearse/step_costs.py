"""What a traced step's operators and collectives cost, part by part (each micro-batch, then the optimizer step):
every operator's roofline seconds, every collective's bytes, and the order the rank issued them in, for the
overlap of collectives with compute (step_time.exposed_s). The step tracker (`step_tracker`) feeds it every
operator this rank runs.

Imports torch's memory-tracker package (its storage helper), which loads slowly: only `step_tracker` imports
this module, and the trace imports that one when it traces.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.utils._pytree as pytree
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils.weak import WeakIdKeyDictionary

from raybench.rehearse.fake_world import collective_ops, comm_bytes
from raybench.rehearse.roofline import OpCost, Roofline, fusable

# A decoder block's module name as torch's module tracker reports it (model.model.layers.7, or inside wrappers).
BLOCK_NAME = re.compile(r"\.layers\.\d+(\.|$)")


@cache  # asked of every module running, at every fusable operator: a model's few hundred names, searched once each
def in_block(module_name: str) -> bool:
    """Whether `module_name` is a decoder block or a module inside one."""
    return BLOCK_NAME.search(module_name) is not None


@dataclass
class PartCosts:
    """What one part of the step (a micro-batch, or the optimizer step) ran: operator costs and collectives."""

    flops: float = 0.0
    roofline_s: float = 0.0
    compute_s: float = 0.0
    memory_s: float = 0.0
    block_memory_bound_s: float = 0.0
    launches: int = 0
    op_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    comm_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    comm_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # In the order the rank issued them: ["compute", roofline seconds, index of the collective it waits for or -1,
    # in backward] (consecutive operators of one pass that wait for nothing merged into one) and ["comm", name,
    # bytes, kind], kind as `comm_kind` says. Not added up by `add`: the trace keeps each part's own
    # (StepTrace.timeline).
    events: list[list] = field(default_factory=list)
    collectives: int = 0  # "comm" events so far: the next one's index

    def add(self, other: PartCosts, times: int = 1) -> None:
        for name in ("flops", "roofline_s", "compute_s", "memory_s", "block_memory_bound_s", "launches"):
            setattr(self, name, getattr(self, name) + times * getattr(other, name))
        for name in ("op_s", "comm_bytes", "comm_calls"):
            mine = getattr(self, name)
            for key, value in getattr(other, name).items():
                mine[key] += times * value

    def computed(self, seconds: float, waits_for: int, backward: bool) -> None:
        last = self.events[-1] if self.events else None
        if waits_for < 0 and last is not None and last[0] == "compute" and last[3] == backward:
            last[1] += seconds
        else:
            self.events.append(["compute", seconds, waits_for, backward])

    def communicated(self, name: str, nbytes: int, kind: str) -> int:
        self.events.append(["comm", name, nbytes, kind])
        self.collectives += 1
        return self.collectives - 1


def comm_kind(name: str, overlapped: bool) -> str:
    """How a collective sits beside compute (step_time.exposed_s): "gather", FSDP's all-gathers, issued ahead of
    the compute that reads them; "reduce", FSDP's reduce-scatters and DDP's all-reduces, which nothing in the
    step reads until it ends (they run on the collectives' stream, their own copies too); "blocking", the rest
    (TP's), whose result the next operators wait for."""
    if not overlapped:
        return "blocking"
    return "gather" if "gather" in name else "reduce"


def _storages(tree) -> list:
    """The untyped storages of every tensor in a pytree (args and kwargs, or an operator's output)."""
    return [st for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) for st in get_untyped_storages(t)]


class StepCosts:
    """The parts of a traced step so far, and what each operator and collective this rank runs adds to them."""

    def __init__(self, roofline: Roofline):
        self.roofline = roofline
        self.collectives, self.overlapped = collective_ops()
        self.parts = [PartCosts()]  # the micro-batches traced so far, then the optimizer step (`next_part`)
        self.overlapped_names: set[str] = set()
        self.awaited = WeakIdKeyDictionary()  # storage a gather or blocking collective wrote -> its index

    def next_part(self) -> None:
        """Count what follows as the step's next part (the next micro-batch, or the optimizer step)."""
        self.parts.append(PartCosts())
        self.awaited = WeakIdKeyDictionary()  # each part's timeline starts with its streams idle

    def step_total(self, times: list[int]) -> PartCosts:
        """The whole step: each traced micro-batch counted `times` times (`trace.traced_accumulation`), then the
        optimizer step once."""
        *micro_batches, optimizer_step = self.parts
        total = PartCosts()
        for part, count in zip(micro_batches, times):
            total.add(part, count)
        total.add(optimizer_step)
        return total

    def count(self, part: PartCosts, func, args, kwargs: dict, out, backward: bool,
              modules: Collection[str], cost: OpCost | None = None) -> OpCost | None:
        """Add one operator that ran inside `modules` (torch's module tracker's names) to `part`; its cost (None:
        a collective). `cost`: the operator priced already (shards.py counts it again at another size)."""
        if func in self.collectives:
            self._count_collective(part, func, args, kwargs, out)
            return None
        cost = cost or self.roofline.op_cost(func, args, kwargs, out)
        seconds = self._count_operator(part, func, cost, modules)
        part.computed(seconds, self._waits_for(args, kwargs) if self.awaited else -1, backward)
        return cost

    def _count_collective(self, part: PartCosts, func, args, kwargs: dict, out) -> None:
        name = func._overloadpacket.__name__.strip("_")
        nbytes = comm_bytes(func, out, args, kwargs)
        part.comm_bytes[name] += nbytes
        part.comm_calls[name] += 1
        if func in self.overlapped:
            self.overlapped_names.add(name)
        kind = comm_kind(name, func in self.overlapped)
        index = part.communicated(name, nbytes, kind)
        if kind != "reduce":  # what it wrote is waited for by the first operator that reads it
            for st in _storages(out):
                self.awaited[st] = index

    @staticmethod
    def _count_operator(part: PartCosts, func, cost: OpCost, modules: Collection[str]) -> float:
        """Add the operator's roofline cost to `part`; its roofline seconds."""
        flops, compute_s, memory_s, launches = cost
        part.flops += flops
        part.compute_s += compute_s
        part.memory_s += memory_s
        part.roofline_s += max(compute_s, memory_s)
        part.op_s[func._overloadpacket.__name__] += max(compute_s, memory_s)
        part.launches += launches
        if fusable(func, flops) and any(map(in_block, modules)):
            part.block_memory_bound_s += memory_s
        return max(compute_s, memory_s)

    def _waits_for(self, args, kwargs) -> int:
        """The latest collective whose output this operator is the first to read (-1: none)."""
        waits_for = -1
        for st in _storages((args, kwargs)):
            index = self.awaited.pop(st, -1)
            waits_for = max(waits_for, index)
        return waits_for
