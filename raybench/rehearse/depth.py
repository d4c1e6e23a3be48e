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
  place of the deep model. Where the shallow models show it cannot be a middle block's (no shallow model peaks in a
  middle block, and backward never grows memory across the middle blocks: a middle block then sits below the place
  that peaks by what every other block adds to both alike), the ends' places alone are taken. Otherwise each middle
  block's places are extrapolated too (`_middle_places`): its own, in the shallow model of its kind, plus what
  each block below adds (as it adds to the top block's places) and each block above (as to the bottom block's),
  checked on the check model's middle blocks before use.

Where a kind of block peaks depends on what runs above it: the top block's backward starts with no gradient in
flight, a lower block's with the gradients of the block above being reduced (FSDP2), so a checkpointed block
recomputing under the top one can hold more than the top block does. The top end therefore reaches down to the
highest block of each kind below the top block (`ends`): the deep model's highest block of each kind is an end
block, and every middle block of that kind sits below it, in the same company as in the shallow model of its kind.

A further shallow model with one more block checks the line exactly before it is used; anything that does not
hold (DDP's gradient buckets, whose count is not per block) gets the full trace, and the row says why.
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


def ends(kinds: tuple[bool, ...]) -> tuple[int, int]:
    """How many bottom and top blocks of the deep model `kinds` the shallow models keep as it has them: the bottom
    block; the top block, and down to the highest block of each kind (checkpointed or not) below it (at least
    two)."""
    inner = range(1, len(kinds) - 1)
    highest = [max(i for i in inner if kinds[i] == kind) for kind in {kinds[i] for i in inner}]
    return 1, len(kinds) - min(highest + [len(kinds) - 2])


def shallow_layouts(kinds: tuple[bool, ...]) -> dict[str, tuple[bool, ...]] | None:
    """The shallow models the deep model `kinds` (per block, checkpointed or not) is extrapolated from: "base"
    (the ends alone, `ends`), one per middle kind (the ends and one block of that kind), and "check" (one more
    block); None where the model is too shallow to gain from it (the check model would be as deep)."""
    bottom_count, top_count = ends(kinds)
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


def extrapolate(kinds: tuple[bool, ...], shallow: dict[str, StepTrace]) -> StepTrace | str:
    """The deep model's StepTrace from its shallow models' (keyed as shallow_layouts names them), or why the line
    does not hold for it."""
    bottom, top = ends(kinds)
    layouts = shallow_layouts(kinds)
    middle = Counter(kinds[bottom:-top])
    counts = {_name(kind): n for kind, n in middle.items()}
    check_counts = {name: 1 for name in counts} if len(counts) > 1 else {name: 2 for name in counts}
    growth = {name: _middle_growth_gib(trace, len(layouts[name]), bottom, top) for name, trace in shallow.items()}
    why = _grows(growth)
    for name, trace in shallow.items():
        if not why and _end_place(_peak_place(trace), len(layouts[name]), bottom, top) is None:
            why = f"depth not extrapolated (the {name} shallow model peaks in a middle block)"
    values = {name: _values(trace, len(layouts[name]), bottom, top) for name, trace in shallow.items()}
    base = shallow["base"]
    steps = {name: _combine(values[name], values["base"], -1) for name in counts}
    expected = _line(values["base"], steps, check_counts)
    mismatch = _first_mismatch(expected, values["check"])
    if mismatch:
        return f"depth not extrapolated ({mismatch} is not linear in the number of blocks)"
    deep = _line(values["base"], steps, counts)
    if why:  # the ends may not hold the peak: every middle block's places too, where the check model bears them out
        own = {name: _own_places(shallow[name], bottom) for name in counts}
        middle_places = _middle_places(kinds[bottom:-top], own, steps)
        checked = _middle_places(layouts["check"][bottom:-top], own, steps)
        traced = _own_places(shallow["check"], bottom, len(layouts["check"]) - top - bottom)
        if middle_places is None or checked is None or _first_mismatch(checked, traced):
            return why
        deep["place_gib"].update(middle_places)
    place = max(deep["place_gib"], key=lambda p: (sum(deep["place_gib"][p].values()), p))
    return StepTrace(
        memory_gib=deep["place_gib"][place], resident_gib=deep["resident_gib"], comm_bytes=deep["comm_bytes"],
        comm_calls=deep["comm_calls"], overlapped_comm=base.overlapped_comm, flops=deep["flops"],
        roofline_s=deep["roofline_s"], compute_s=deep["compute_s"], memory_s=deep["memory_s"], op_s=deep["op_s"],
        block_memory_bound_s=deep["block_memory_bound_s"], grad_accum=base.grad_accum,
        traced_micro_batches=base.traced_micro_batches, optimizer_roofline_s=deep["optimizer_roofline_s"],
        launches=deep["launches"],
        place_gib=deep["place_gib"], timeline=_timeline(base, shallow, counts))


def _own_places(trace: StepTrace, bottom: int, blocks: int = 1) -> dict[str, dict[str, float]]:
    """The places of a shallow model's middle blocks (`blocks` of them, from index `bottom`), by "part:pass" and
    the middle block's position from the bottom of the middle ("0:backward:middle+1")."""
    places = {}
    for place, gib in trace.place_gib.items():
        part, direction, where = place.split(":")
        if where != "outside" and bottom <= int(where) < bottom + blocks:
            places[f"{part}:{direction}:middle+{int(where) - bottom}"] = dict(gib)
    return places


def _middle_places(middle: tuple[bool, ...], own: dict[str, dict], steps: dict[str, dict]) -> dict | None:
    """Each block's places in a middle of kinds `middle` (bottom to top): a block's own places in the shallow
    model of its kind (`own`), plus what each other middle block adds there: a block below, what it adds to the
    top block's place of the same part and pass (its saved activations, its shards); a block above, what it
    adds to the bottom block's (what it leaves once it ran: gradient shards, or unsharded gradients that are not
    reduced yet). None where a shallow model lacks its middle block's places or one of those end places."""
    found = {}
    for position, kind in enumerate(middle):
        blocks_own = {key: gib for key, gib in own[_name(kind)].items() if key.endswith(":middle+0")}
        if not blocks_own:
            return None
        for key, gib in blocks_own.items():
            part_pass = key.rsplit(":", 1)[0]
            total = gib
            for other, other_kind in enumerate(middle):
                end = "top" if other < position else "bottom" if other > position else None
                if end is None:
                    continue
                added = steps[_name(other_kind)]["place_gib"].get(f"{part_pass}:{end}")
                if added is None:
                    return None
                total = _combine(total, added, 1)
            found[f"{part_pass}:middle+{position}"] = total
    return found


def _timeline(base: StepTrace, shallow: dict[str, StepTrace], counts: dict[str, int]) -> list:
    """The deep model's timeline as the same line: base + n x (one middle block of each kind - base), each
    shallow model's parts weighted accordingly (step_time.exposed_s is then extrapolated like the rest)."""
    base_weight = 1 - sum(counts.values())
    timeline = [(weight * base_weight, events) for weight, events in base.timeline]
    for name, n in counts.items():
        timeline += [(weight * n, events) for weight, events in shallow[name].timeline]
    return timeline


def _grows(growth: dict[str, dict[int, float]]) -> str | None:
    """Why the ends may not hold the deep model's peak, by how the memory entering each middle block's backward
    changes (`growth`: from the highest middle block's to the bottom end's, by shallow model and micro-batch):
    where it grows down the blocks, a lower middle block can hold more than the ends."""
    grown = [(gib, name) for name, by_part in growth.items() for gib in by_part.values() if gib > 0]
    if not grown:
        return None
    gib, name = max(grown)
    return f"depth not extrapolated (backward grows memory by {gib * 1024:.1f} MiB across a {name} block)"


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
