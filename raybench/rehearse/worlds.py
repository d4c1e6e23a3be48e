"""One FSDP2 (or TP x FSDP2) step's traces shared across world sizes, exactly.

A rank's traced step depends on the world size only through FSDP2's shards: its sharded parameters and gradients
and the optimizer state on them, the copy into the all-gather's input and the reduce-scatter's output, and the
optimizer's and clipping's operators on the shards. The operators run, the activations, the unsharded parameters
and gradients, the all-gather and reduce-scatter buffers (the padded whole) and every collective's call are the
same at every world size, as long as FSDP2 pads nothing: every sharded dimension divides by the FSDP2 group's size
`dp` (then each shard is n / dp; a padded shard is not). Every number the trace records, at each operator, is then
a + b / dp: fixed storage and work plus what sits on the shards.

So two ends give both parts of every number (two world sizes traced, or one traced and its part on the shards
scaled to another: shards.py), and any third world size whose shards divide evenly is their line evaluated there
(`share`): each operator's memory by category, from which the step's peak and each
place's (`step_tracker.place_of`) are found again as the tracker finds them (the first operator at the highest
total: where the peak sits can move with the world size, so it is not the traced peak scaled), the memory as each
block's backward began, the resident storage, every operator cost and collective's bytes, and the timeline the
overlap is priced on. Bytes are solved exactly (rationals: the result must be a whole number of bytes), times in
floats. What the line cannot stand for, the rehearsal traces itself, and the row says why: FSDP2 on one rank
(`dp` 1: no all-gather or reduce-scatter), padding, or two traced steps that do not run the same operators in the
same places.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import cached_property


@dataclass
class MemoryEvents:
    """The tracker's memory after every operator of a traced step (what `step_tracker` records where asked): its
    bytes by category (`categories` names them) and the place it ran in; the memory the tracker started from;
    and, per (part, block), the operator after which that block's backward began (-1: none before it)."""

    categories: tuple[str, ...]
    initial_bytes: tuple[int, ...] = ()
    places: list[str] = field(default_factory=list)
    place_index: array = field(default_factory=lambda: array("i"))
    category_bytes: array = field(default_factory=lambda: array("q"))  # len(categories) a operator, flat
    backward_entry: dict[tuple[int, int], int] = field(default_factory=dict)
    lost: str | None = None  # why the record cannot stand for the step (several devices, a total off its parts)
    _place_ids: dict[str, int] = field(default_factory=dict)

    def record(self, place: str, category_bytes: list[int]) -> None:
        index = self._place_ids.get(place)
        if index is None:
            index = self._place_ids[place] = len(self.places)
            self.places.append(place)
        self.place_index.append(index)
        self.category_bytes.extend(category_bytes)

    @property
    def count(self) -> int:
        return len(self.place_index)


@dataclass(frozen=True)
class Sharding:
    """How FSDP2 sharded a traced model: its group's size, and each parameter's sharded dimension before FSDP2
    (after TP's split), which decides whether a world size pads."""

    dp: int
    sharded_dims: tuple[int, ...]

    def pads(self, dp: int) -> list[int]:
        return sorted({n for n in self.sharded_dims if n % dp})


def fsdp_sharding(model) -> Sharding | None:
    """The Sharding of a model FSDP2 wrapped (None: no FSDP2 parameter)."""
    from torch.distributed.fsdp import FSDPModule

    dims, dps = [], set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for param in group.fsdp_params if group else ():
            dims.append(param._orig_size[param.fsdp_placement.dim])
            dps.add(param.mesh_info.shard_mesh_size)
    if not dims or len(dps) != 1:
        return None
    return Sharding(dps.pop(), tuple(sorted(set(dims))))


def why_not_recorded(trace) -> str | None:
    """Why a traced step cannot be one end of the line (None: it can)."""
    events, sharding = trace.memory_events, trace.sharding
    if events is None or sharding is None:
        return "no FSDP2 shards recorded"
    if events.lost:
        return events.lost
    if sharding.dp < 2:
        return "FSDP2 over one rank skips its all-gathers and reduce-scatters"
    if sharding.pads(sharding.dp):
        return f"FSDP2 pads dimensions {sharding.pads(sharding.dp)} over {sharding.dp} ranks"
    return None


def share(dp: int, traced: dict[int, object]):
    """The step at FSDP2 group size `dp` from two steps traced at others (`traced`: by group size, StepTraces
    that `why_not_recorded` accepts): a StepTrace, or why it cannot be (a string), or None where fewer than two
    are traced yet."""
    others = [(n, t) for n, t in traced.items() if n != dp]
    if len(others) < 2:
        return None
    (dp1, one), (dp2, two) = others[:2]
    if dp < 2:
        return "FSDP2 over one rank skips its all-gathers and reduce-scatters"
    padded = one.sharding.pads(dp)
    if padded:
        return f"FSDP2 pads dimensions {padded} over {dp} ranks"
    mismatch = _structure_mismatch(one, two)
    if mismatch:
        return f"the steps traced at {dp1} and {dp2} FSDP2 ranks differ in {mismatch}"
    line = _Line(dp1, dp2, dp)
    try:
        return _shared(one, two, line)
    except _NotWhole as err:
        return f"{err} is not a whole number of bytes on the line through {dp1} and {dp2} FSDP2 ranks"


def compact(traced: dict[int, object]) -> None:
    """Keep, of the memory after every operator of the line's two ends (`traced`, by FSDP2 group size), only the
    operators whose memory can be their place's highest at some group size of 2 or more (and those the blocks'
    backward began after): an operator holding no more than another of its place at both ends of that range
    (group sizes 2 and infinity, between which every total is a line), and not more than an earlier one, never
    is. A few per place remain of thousands, the replay (`replay`) finds the same peaks. Ends that do not run
    the same operators in the same places are left whole (`share` says how they differ)."""
    (dp1, one), (dp2, two) = sorted(traced.items())
    if _structure_mismatch(one, two):
        return
    a, b = one.memory_events, two.memory_events
    width = len(a.categories)
    kept, frontier = set(), {}  # place -> [(total at dp 2, total as dp grows without end, operator)]
    for i in range(a.count):
        t1, t2 = sum(a.category_bytes[i * width:(i + 1) * width]), sum(b.category_bytes[i * width:(i + 1) * width])
        # The totals at dp 2 and as dp grows, each scaled by one positive constant: order is all that counts.
        at_two, at_infinity = 2 * t1 * (dp2 - dp1) + (t1 - t2) * (dp1 - 2) * dp2, t2 * dp2 - t1 * dp1
        place = frontier.setdefault(a.place_index[i], [])
        if any(k2 >= at_two and kinf >= at_infinity for k2, kinf, _ in place):
            continue
        place[:] = [k for k in place if not (at_two > k[0] and at_infinity >= k[1])]
        place.append((at_two, at_infinity, i))
    kept = {i for place in frontier.values() for _, _, i in place}
    kept |= {i for i in a.backward_entry.values() if i >= 0}
    order = sorted(kept)
    one.memory_events, two.memory_events = _keeping(a, order), _keeping(b, order)


def _keeping(events: MemoryEvents, order: list[int]) -> MemoryEvents:
    width = len(events.categories)
    position = {i: n for n, i in enumerate(order)}
    kept = MemoryEvents(events.categories, events.initial_bytes, events.places,
                        array("i", (events.place_index[i] for i in order)),
                        backward_entry={key: position.get(i, -1) for key, i in events.backward_entry.items()})
    for i in order:
        kept.category_bytes.extend(events.category_bytes[i * width:(i + 1) * width])
    return kept


class _NotWhole(ValueError):
    pass


@dataclass(frozen=True)
class _Line:
    """a + b / dp through the values at dp1 and dp2, evaluated at dp."""

    dp1: int
    dp2: int
    dp: int

    @cached_property
    def factor(self) -> Fraction:
        """(1/dp - 1/dp1) / (1/dp1 - 1/dp2): the value at dp is one + (one - two) x this."""
        return Fraction(self.dp2 * (self.dp1 - self.dp), (self.dp2 - self.dp1) * self.dp)

    def bytes(self, one: int, two: int, name: str) -> int:
        if one == two:
            return one
        shift, remainder = divmod((one - two) * self.factor.numerator, self.factor.denominator)
        if remainder or one + shift < 0:
            raise _NotWhole(name)
        return one + shift

    def seconds(self, one: float, two: float) -> float:
        if one == two:  # nothing on the shards: exactly the traced value
            return one
        return one + (one - two) * float(self.factor)


def _structure_mismatch(one, two) -> str | None:
    """What two traced steps do differently beyond their sizes (None: the same operators, places and calls)."""
    a, b = one.memory_events, two.memory_events
    checks = {
        "operators' places": (a.places, a.place_index, a.backward_entry) != (b.places, b.place_index, b.backward_entry),
        "collectives' calls": one.comm_calls != two.comm_calls or one.comm_bytes.keys() != two.comm_bytes.keys(),
        "operators": one.op_s.keys() != two.op_s.keys() or one.launches != two.launches,
        "micro-batches": (one.grad_accum, one.traced_micro_batches) != (two.grad_accum, two.traced_micro_batches),
        "timeline": _timeline_shape(one.timeline) != _timeline_shape(two.timeline),
        "places": one.place_gib.keys() != two.place_gib.keys() or one.overlapped_comm != two.overlapped_comm,
        "sharded dimensions": one.sharding.sharded_dims != two.sharding.sharded_dims,
    }
    return next((name for name, differs in checks.items() if differs), None)


def _timeline_shape(timeline: list) -> list:
    """A timeline without its sizes: each part's weight, and each event's kind, collective and what it waits for."""
    return [(weight, [tuple(e[2:]) if e[0] == "compute" else (e[0], e[1], e[3]) for e in events])
            for weight, events in timeline]


GIB = 2**30


def _shared(one, two, line: _Line):
    """The StepTrace at line.dp: every size and cost on the line through `one` and `two`."""
    events = _memory_at(one.memory_events, two.memory_events, line)
    memory_gib, place_gib, entry_gib = replay(events)
    return replace(
        one, memory_gib=memory_gib, place_gib=place_gib, backward_entry_gib=entry_gib,
        resident_gib={name: line.bytes(round(gib * GIB), round(two.resident_gib[name] * GIB), name) / GIB
                      for name, gib in one.resident_gib.items()},
        comm_bytes={name: line.bytes(n, two.comm_bytes[name], name) for name, n in one.comm_bytes.items()},
        **{name: line.seconds(getattr(one, name), getattr(two, name))
           for name in ("flops", "roofline_s", "compute_s", "memory_s", "block_memory_bound_s",
                        "optimizer_roofline_s")},
        op_s={name: line.seconds(s, two.op_s[name]) for name, s in one.op_s.items()},
        timeline=[(weight, [_event_at(e, f, line) for e, f in zip(events_one, events_two)])
                  for (weight, events_one), (_, events_two) in zip(one.timeline, two.timeline)],
        block_ops=None, memory_events=None, sharding=replace(one.sharding, dp=line.dp), second=None)


def _event_at(one: list, two: list, line: _Line) -> list:
    if one[0] == "compute":
        return ["compute", line.seconds(one[1], two[1]), one[2], one[3]]
    return ["comm", one[1], line.bytes(one[2], two[2], one[1]), one[3]]


def _memory_at(one: MemoryEvents, two: MemoryEvents, line: _Line) -> MemoryEvents:
    at = MemoryEvents(one.categories, places=one.places, place_index=one.place_index,
                      backward_entry=one.backward_entry)
    names = one.categories
    at.initial_bytes = tuple(line.bytes(a, b, names[i]) for i, (a, b) in
                             enumerate(zip(one.initial_bytes, two.initial_bytes)))
    width = len(names)
    at.category_bytes = array("q", (line.bytes(a, b, names[i % width])
                                    for i, (a, b) in enumerate(zip(one.category_bytes, two.category_bytes))))
    return at


def replay(events: MemoryEvents) -> tuple[dict, dict, dict]:
    """The step's peak and each place's, by category, and the memory as each block's backward began, from the
    memory after every operator, found as the step tracker finds them: the peak starts at the tracker's initial
    memory and moves to an operator's only where that is higher; a place's peak is its first highest operator."""
    names, width = events.categories, len(events.categories)
    values = events.category_bytes
    totals = [sum(values[i * width:(i + 1) * width]) for i in range(events.count)]
    peak, peak_total = None, sum(events.initial_bytes)
    place_peaks: dict[int, int] = {}
    for i, total in enumerate(totals):
        if peak_total < total:
            peak, peak_total = i, total
        place = events.place_index[i]
        if place not in place_peaks or total > totals[place_peaks[place]]:
            place_peaks[place] = i

    def gib(i: int | None) -> dict[str, float]:
        parts = events.initial_bytes if i is None else values[i * width:(i + 1) * width]
        return {name: n / GIB for name, n in zip(names, parts)}

    place_gib = {events.places[place]: gib(i) for place, i in place_peaks.items()}
    entry_gib = {key: (totals[i] if i >= 0 else 0) / GIB for key, i in events.backward_entry.items()}
    return gib(peak), place_gib, entry_gib
