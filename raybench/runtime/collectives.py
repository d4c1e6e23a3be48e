"""What a trial's collectives moved in its timed steps, read from torch's flight recorder: the ring buffer of the
latest collectives of every process group that c10d keeps by default (TORCH_FR_BUFFER_SIZE entries, 2000), with
each one's sizes and dtypes. Reading it costs a fraction of a millisecond and nothing in the steps.

Each collective's bytes are sized and weighted as nccl-tests does for its bus bandwidth (an all-reduce's buffer
times 2(n-1)/n, an all-gather's whole output or a reduce-scatter's whole input times (n-1)/n), so that these bus
bytes over a time compare with the all-reduce probe's busbw and with the link's nominal rate: over the profiled
steps' collective time, the bandwidth they achieved; over the whole step, the least bandwidth the step needs from
its links (above what the probe measured, the step cannot have hidden its communication)."""

from __future__ import annotations

import math
import pickle

import torch
import torch.distributed as dist

# nccl-tests' bus factor by collective (n: the group's ranks); the flight recorder names them `backend:op`.
_BUS_FACTORS = (("reduce_scatter", lambda n: (n - 1) / n), ("all_reduce", lambda n: 2 * (n - 1) / n),
                ("allreduce", lambda n: 2 * (n - 1) / n), ("gather", lambda n: (n - 1) / n),
                ("all_to_all", lambda n: (n - 1) / n), ("alltoall", lambda n: (n - 1) / n),
                ("broadcast", lambda n: 1.0))
# c10d's scalar type names that are not torch attributes of the same name in lower case.
_DTYPES = {"Byte": torch.uint8, "Char": torch.int8}


def _trace() -> dict:
    """The recorder's entries, without their stack traces; none when it is off or this torch cannot dump it."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        return pickle.loads(_dump_fr_trace(True, False, False))
    except (ImportError, RuntimeError):
        return {}


def marks() -> dict[str, int]:
    """Each process group's latest collective sequence number now (this rank's), to bound a window of steps."""
    return _latest(_trace().get("entries", [])) if dist.is_initialized() else {}


def _latest(entries: list[dict]) -> dict[str, int]:
    latest: dict[str, int] = {}
    for entry in entries:
        name = entry["process_group"][0]
        latest[name] = max(latest.get(name, 0), entry["collective_seq_id"])
    return latest


def bus_gb_per_step(before: dict[str, int], steps: int) -> float | None:
    """This rank's collectives' bus bytes per step, in GB, since `before` (`marks`); None when it ran none or the
    recorder is off. The buffer keeps the latest entries only: a window longer than it is counted from the
    entries left, scaled to the window's count of collectives per group."""
    entries = _trace().get("entries", []) if dist.is_initialized() and steps > 0 else []
    after = _latest(entries)
    sizes = {name: group.size() for group, name in dist.distributed_c10d._world.pg_names.items()}
    seen: dict[str, list[float]] = {}
    for entry in entries:
        name, seq = entry["process_group"][0], entry["collective_seq_id"]
        if seq > before.get(name, 0) and not entry.get("is_p2p"):
            seen.setdefault(name, []).append(_bus_bytes(entry, sizes.get(name, 1)))
    if not seen:
        return None
    total = sum(sum(found) * (after[name] - before.get(name, 0)) / len(found) for name, found in seen.items())
    return total / steps / 1e9


def _bus_bytes(entry: dict, ranks: int) -> float:
    """One collective's bytes as nccl-tests sizes them, times its bus factor; 0 for what it does not count."""
    op = entry["profiling_name"].split(":")[-1]
    factor = next((f(ranks) for key, f in _BUS_FACTORS if key in op), 0.0)
    # An all-gather's size is its whole output, a reduce-scatter's and an all-reduce's their whole input.
    shapes, dtypes = (entry["output_sizes"], entry["output_dtypes"]) if "gather" in op else (
        entry["input_sizes"], entry["input_dtypes"])
    return factor * sum(math.prod(shape) * _itemsize(dtype) for shape, dtype in zip(shapes, dtypes))


def _itemsize(name: str) -> int:
    dtype = _DTYPES.get(name) or getattr(torch, name.lower(), None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 0


def columns(bus_gb_per_step: float | None, step_p50_s: float, profile_comm_s: float | None,
            probe_gbps: float | None, link_gbps: float | None) -> dict[str, float | None]:
    """The row's collective columns: the bus bytes per step; their bandwidth over the whole step (the least the
    step needs); over the profiled steps' collective time (what they achieved), and that against the trial's
    all-reduce probe and the link's nominal rate."""
    achieved = bus_gb_per_step / profile_comm_s if bus_gb_per_step and profile_comm_s else None
    return {"comm_bus_gb_per_step": bus_gb_per_step,
            "comm_busbw_over_step_gbps": bus_gb_per_step / step_p50_s if bus_gb_per_step is not None else None,
            "comm_busbw_gbps": achieved,
            "comm_busbw_of_probe": achieved / probe_gbps if achieved and probe_gbps else None,
            "comm_busbw_of_link": achieved / link_gbps if achieved and link_gbps else None}
