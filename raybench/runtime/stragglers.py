"""Whether a trial's ranks ran alike. In a synchronous step every rank waits for the slowest inside the step's
collectives, so each rank's step time is the same and cannot name the slow one. What differs is each rank's local
work: the parts of a step in which no collective waits, loading its batch (`data`) and the optimizer step on its
own parameters or shard (`optimizer`). A rank whose local work is well beyond the other ranks' median, by a share
of the step that matters, is a straggler; the row names it and its node.

What this misses: a rank slow only in what collectives overlap (its forward and backward compute, under FSDP2, TP
or ZeRO, where gathers and reductions interleave with it). A LoRA step's optimizer is tiny, so a slow GPU there
shows in the pre-flight (`raybench cluster check`) rather than here."""

from __future__ import annotations

import statistics



LOCAL_PHASES = ("data", "optimizer")
# A rank is a straggler when its local work takes longer than the other ranks' median by more than 1/TOLERANCE ...
TOLERANCE = 0.8
# ... and the excess is at least this share of the step: a few milliseconds of a data loader's jitter are not one.
MIN_STEP_SHARE = 0.05


def local_times_s(phase_times_s: dict[str, list[float]]) -> list[float] | None:
    """One rank's local work per step (LOCAL_PHASES summed); None when the rank's loop has no phases (a user's
    stack)."""
    if not all(p in phase_times_s for p in LOCAL_PHASES):
        return None
    return [sum(step) for step in zip(*(phase_times_s[p] for p in LOCAL_PHASES))]


def columns(local_p50_s_by_rank: list[float] | None, nodes_by_rank: list[str | None], step_p50_s: float) -> dict:
    """The row's straggler columns from each rank's median local work (None: not measured)."""
    if local_p50_s_by_rank is None:
        return {"local_time_p50_s_by_rank": None, "slowest_rank": None, "slowest_rank_node": None,
                "straggler": None, "straggler_why": None}
    slowest = max(range(len(local_p50_s_by_rank)), key=local_p50_s_by_rank.__getitem__)
    others = [t for rank, t in enumerate(local_p50_s_by_rank) if rank != slowest]
    worst, median = local_p50_s_by_rank[slowest], statistics.median(others) if others else None
    straggler = median is not None and worst * TOLERANCE > median and worst - median > MIN_STEP_SHARE * step_p50_s
    node = nodes_by_rank[slowest]
    why = (f"rank {slowest}" + (f" on {node}" if node else "") + f": its data and optimizer work took "
           f"{worst * 1000:.1f} ms a step at the median, {worst / median if median else float('inf'):.1f}x the other "
           f"ranks' median {median * 1000:.1f} ms ({(worst - median) / step_p50_s:.0%} of the step); every rank waits "
           "for it") if straggler else None
    return {"local_time_p50_s_by_rank": local_p50_s_by_rank, "slowest_rank": slowest, "slowest_rank_node": node,
            "straggler": straggler, "straggler_why": why}
