"""A deep model's traced step from a few shallow ones.

Every decoder block of one kind (checkpointed or not) runs the same operators on the same shapes, allocates the
same tensors and issues the same collectives, wherever it sits. A deep model's step is therefore its shallow
twin's plus, per extra block, what one more block of that kind adds. The rehearsal traces shallow models that keep
the deep one's ends as they are (its bottom block, and its top ones: `ends`) with zero or one middle block
of each kind, and extrapolates every count linearly to the deep model's middle:

- operator costs, FLOPs, collectives (bytes and calls) and resident storage add up per block, and so does the
  time collectives add beyond compute (each block of a kind overlaps its collectives alike): the deep model's
  timeline is the shallow models' timelines in the same linear combination;
- the memory at each place of the step (`step_tracker.place_of`: a part, forward or backward, an end block or
  outside the blocks) holds every block's saved activations and gradients, so it adds up too; the peak is the highest
  place of the deep model, and it is taken only when the shallow models show it cannot be a middle block's:
  no shallow model peaks in a middle block, and backward never grows memory across the middle blocks (each
  block frees at least what it leaves behind). A middle block then sits below the place that peaks by what
  every other block adds to both alike.

Where a kind of block peaks depends on what runs above it: the top block's backward starts with no gradient in
flight, a lower block's with the gradients of the block above being reduced (FSDP2), so a checkpointed block
recomputing under the top one can hold more than the top block does. The top end therefore reaches down to the
highest block of each kind below the top block (`ends`): the deep model's highest block of each kind is an end
block, and every middle block of that kind sits below it. Where backward grows memory down the blocks (gradient
shards larger than what a block frees: TP x FSDP2 over few ranks), the peak of a kind sits at its lowest block
instead: the rehearsal then tries a bottom end reaching up to the lowest block of each kind as well
(`reach_bottom`), and takes it where memory grows across every kind of block (or across none).

A further shallow model with one more block checks the line exactly before it is used; anything that does not
hold (DDP's gradient buckets, whose count is not per block; gradients that grow memory in backward) gets the
full trace, and the row says why.
"""

from __future__ import annotations

import math
from collections import Counter

from raybench.rehearse.trace import StepTrace

# Below this depth a full trace costs about what the shallow ones would.
MIN_LAYERS = 8
_SCALARS = ("flops", "roofline_s", "compute_s", "memory_s", "block_memory_bound_s", "optimizer_roofline_s",
            "launches")
_TABLES = ("comm_bytes", "comm_calls", "op_s", "resident_gib")
_REL_TOL = 1e-6  # float sums in another order; byte counts compare exactly


def ends(kinds: tuple[bool, ...], reach_bottom: bool = False) -> tuple[int, int]:
    """How many bottom and top blocks of the deep model `kinds` the shallow models keep as it has them. The top
    end: the top block, and down to the highest block of each kind (checkpointed or not) below it; at least two.
    The bottom end: the bottom block, or with reach_bottom (for backward that grows memory down the blocks) up to
    the lowest block of each kind above it."""
    inner = range(1, len(kinds) - 1)
    highest = [max(i for i in inner if kinds[i] == kind) for kind in {kinds[i] for i in inner}]
    lowest = [min(i for i in inner if kinds[i] == kind) for kind in {kinds[i] for i in inner}]
    bottom = max(lowest, default=0) + 1 if reach_bottom else 1
    return bottom, len(kinds) - min(highest + [len(kinds) - 2])


def shallow_layouts(kinds: tuple[bool, ...], reach_bottom: bool = False) -> dict[str, tuple[bool, ...]] | None:
    """The shallow models the deep model `kinds` (per block, checkpointed or not) is extrapolated from: "base"
    (the ends alone, `ends`), one per middle kind (the ends and one block of that kind), and "check" (one more
    block); None where the model is too shallow to gain from it (the check model would be as deep)."""
    bottom_count, top_count = ends(kinds, reach_bottom)
    if len(kinds) < MIN_LAYERS or bottom_count + 2 + top_count >= len(kinds):
        return None
    bottom, middle, top = kinds[:bottom_count], kinds[bottom_count:-top_count], kinds[-top_count:]
    present = sorted(set(middle))
    layouts = {"base": bottom + top}
    layouts.update({_name(kind): bottom + (kind,) + top for kind in present})
    layouts["check"] = bottom + (tuple(present) if len(present) > 1 else (present[0],) * 2) + top
    return layouts


def _name(kind: bool) -> str:
    return "checkpointed" if kind else "plain"


def extrapolate(kinds: tuple[bool, ...], shallow: dict[str, StepTrace], reach_bottom: bool = False) -> StepTrace | str:
    """The deep model's StepTrace from its shallow models' (keyed as shallow_layouts(kinds, reach_bottom) names
    them), or why the line does not hold for it."""
    bottom, top = ends(kinds, reach_bottom)
    layouts = shallow_layouts(kinds, reach_bottom)
    middle = Counter(kinds[bottom:-top])
    counts = {_name(kind): n for kind, n in middle.items()}
    check_counts = {name: 1 for name in counts} if len(counts) > 1 else {name: 2 for name in counts}
    growth = {name: _middle_growth_gib(trace, len(layouts[name]), bottom, top) for name, trace in shallow.items()}
    why = _grows(growth, reach_bottom)
    if why:
        return why
    for name, trace in shallow.items():
        if _end_place(_peak_place(trace), len(layouts[name]), bottom, top) is None:
            return f"depth not extrapolated (the {name} shallow model peaks in a middle block)"
    values = {name: _values(trace, len(layouts[name]), bottom, top) for name, trace in shallow.items()}
    base = shallow["base"]
    steps = {name: _combine(values[name], values["base"], -1) for name in counts}
    expected = _line(values["base"], steps, check_counts)
    mismatch = _first_mismatch(expected, values["check"])
    if mismatch:
        return f"depth not extrapolated ({mismatch} is not linear in the number of blocks)"
    deep = _line(values["base"], steps, counts)
    place = max(deep["place_gib"], key=lambda p: (sum(deep["place_gib"][p].values()), p))
    return StepTrace(
        memory_gib=deep["place_gib"][place], resident_gib=deep["resident_gib"], comm_bytes=deep["comm_bytes"],
        comm_calls=deep["comm_calls"], overlapped_comm=base.overlapped_comm, flops=deep["flops"],
        roofline_s=deep["roofline_s"], compute_s=deep["compute_s"], memory_s=deep["memory_s"], op_s=deep["op_s"],
        block_memory_bound_s=deep["block_memory_bound_s"], grad_accum=base.grad_accum,
        traced_micro_batches=base.traced_micro_batches, optimizer_roofline_s=deep["optimizer_roofline_s"],
        launches=deep["launches"],
        place_gib=deep["place_gib"], timeline=_timeline(base, shallow, counts))


def _timeline(base: StepTrace, shallow: dict[str, StepTrace], counts: dict[str, int]) -> list:
    """The deep model's timeline as the same line: base + n x (one middle block of each kind - base), each
    shallow model's parts weighted accordingly (step_time.exposed_s is then extrapolated like the rest)."""
    base_weight = 1 - sum(counts.values())
    timeline = [(weight * base_weight, events) for weight, events in base.timeline]
    for name, n in counts.items():
        timeline += [(weight * n, events) for weight, events in shallow[name].timeline]
    return timeline


def _grows(growth: dict[str, dict[int, float]], reach_bottom: bool) -> str | None:
    """Why the memory entering each middle block's backward (`growth`: from the highest middle block's to the
    bottom end's, by shallow model and micro-batch) does not keep the deep model's peak at an end, if it does not:
    in each micro-batch it must not grow down the blocks, or with the bottom end reaching up (a middle block of
    each kind then sits above an end block of its kind) change alike across every kind: never grow, or never
    shrink."""
    for part in sorted({part for by_part in growth.values() for part in by_part}):
        in_part = {name: by_part.get(part, math.inf) for name, by_part in growth.items()}
        grows = {name: gib for name, gib in in_part.items() if gib > 0}
        if not grows:
            continue
        name, gib = max(grows.items(), key=lambda item: item[1])
        why = f"backward grows memory by {gib * 1024:.1f} MiB across a {name} block"
        shrinks = [other for other, other_gib in in_part.items() if other_gib < 0]
        if shrinks:
            return f"depth not extrapolated ({why}, and shrinks it across a {shrinks[0]} block)"
        if not reach_bottom or math.isinf(gib):
            return f"depth not extrapolated ({why}: the peak could sit at any depth)"
    return None


def worth_reaching_bottom(why: str) -> bool:
    """Whether shallow models with a bottom end reaching up could extrapolate what `why` refused: memory grew
    down the blocks, and no kind shrank it."""
    return "grows memory" in why and "shrinks" not in why and "inf MiB" not in why


def _peak_place(trace: StepTrace) -> str:
    totals = {place: sum(gib.values()) for place, gib in trace.place_gib.items()}
    return max(totals, key=totals.get)


def _middle_growth_gib(trace: StepTrace, layers: int, bottom: int, top: int) -> dict[int, float]:
    """How much memory grew, in each micro-batch's backward, from entering the highest middle block (the first
    one backward reaches) to entering the bottom end: 0 without middle blocks, infinite where a part's backward
    was not seen entering both."""
    entry = trace.backward_entry_gib
    highest_middle, bottom_end = layers - top - 1, bottom - 1
    parts = {part for part, _ in entry} or {0}
    if highest_middle <= bottom_end:
        return dict.fromkeys(parts, 0.0)
    return {p: entry[(p, bottom_end)] - entry[(p, highest_middle)]
            if (p, bottom_end) in entry and (p, highest_middle) in entry else math.inf for p in parts}


def _end_place(place: str, layers: int, bottom: int, top: int) -> str | None:
    """A shallow model's place (`step_tracker.place_of`) as the deep model has it too: outside the blocks, or in
    an end block (bottom, bottom+1, ..., top-1, top), by its distance from its end; None for a middle block's."""
    part, direction, where = place.split(":")
    if where == "outside":
        return place
    block = int(where)
    if block < bottom:
        return f"{part}:{direction}:bottom" + (f"+{block}" if block else "")
    if block >= layers - top:
        return f"{part}:{direction}:top" + (f"-{layers - 1 - block}" if block < layers - 1 else "")
    return None


def _values(trace: StepTrace, layers: int, bottom: int, top: int) -> dict:
    """What extrapolates, as plain numbers and tables of numbers; the memory at the places every model has."""
    values = {name: getattr(trace, name) for name in _SCALARS}
    values.update({name: dict(getattr(trace, name)) for name in _TABLES})
    named = {place: _end_place(place, layers, bottom, top) for place in trace.place_gib}
    values["place_gib"] = {name: dict(trace.place_gib[place]) for place, name in named.items() if name}
    return values


def _line(base: dict, steps: dict[str, dict], counts: dict[str, int]) -> dict:
    values = base
    for name, n in counts.items():
        values = _combine(values, steps[name], n)
    return values


def _combine(a, b, times: int):
    """a + times * b, through nested dicts (a key one of them lacks counts 0)."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a or {}, b or {}
        return {key: _combine(a.get(key, 0), b.get(key, 0), times) for key in a.keys() | b.keys()}
    return a + times * b


def _first_mismatch(expected, traced, path: str = "") -> str | None:
    """The first value where the line and the traced check model differ, by name; None where all agree."""
    if isinstance(expected, dict) or isinstance(traced, dict):
        expected, traced = expected or {}, traced or {}
        for key in sorted(expected.keys() | traced.keys()):
            found = _first_mismatch(expected.get(key, 0), traced.get(key, 0), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(expected, int) and isinstance(traced, int):
        return None if expected == traced else path
    return None if math.isclose(expected, traced, rel_tol=_REL_TOL, abs_tol=1e-12) else path
