"""What one NCCL collective call costs, and which algorithm NCCL runs it with, as NCCL's own tuning model prices
it: `src/graph/tuning.cc` of NCCL 2.30.7, the release torch 2.13's CUDA wheels ship (Simple protocol, the one
messages of FSDP's, DDP's and TP's sizes use).

For every call NCCL computes each enabled algorithm's time, latency plus bytes over that algorithm's bandwidth,
and runs the quickest. For an all-reduce that is a ring or a tree: the ring moves the fewest bytes (bandwidth
optimal), its latency grows with the ranks; the tree sends the buffer up and down a tree of nodes (half the
algorithm bandwidth), its latency grows with the log of the nodes. So trees win small and medium all-reduces
across many nodes (DDP's 25 MB buckets on 8 nodes), rings win large ones and everything inside one node.
All-gathers and reduce-scatters run on rings.

Not priced: NVLS (NVLink SHARP, which needs NVSwitch multicast), CollNet (SHARP switches), PAT (one GPU a
node), the LL and LL128 protocols (they win only messages of a few hundred KB or less), and the per-channel caps
(they do not bind at the bus bandwidths of the hardware table)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Microseconds, Simple protocol (tuning.cc: baseLatencies, hwLatencies).
BASE_LATENCY_US = 8.4  # ring and tree alike
RING_HOP_US = {"nvlink": 3.4, "network": 14.0}
TREE_HOP_US = {"nvlink": 4.0, "network": 14.0}
# A multi-node ring's hops inside a node cost at least the network's posting overhead three times over (Simple);
# the overhead is 1 us on Intel hosts and 2 us on AMD ones (getNetOverhead; NCCL_NET_OVERHEAD sets it). Intel's.
NET_OVERHEAD_US = 1.0
RING_PLATEAU = 1.4  # a multi-node ring all-reduce's latency on GPUs of compute capability 8.0 or more
PLATEAU_CHANNELS = 32  # the plateau applies from 64 bytes a channel a rank: counted at NCCL's most channels
TREE_BANDWIDTH = 0.92  # a tree all-reduce's bus bandwidth against the ring's
# Trees miss their model on medium sizes: NCCL's correction of a tree all-reduce's bandwidth, Simple protocol, by
# log2(bytes / 64) from 0 (64 B) to 22 (256 MB); none from 512 MB.
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)


@dataclass(frozen=True)
class Call:
    seconds: float  # the call's time: latency plus its bytes at the algorithm's bandwidth
    latency_s: float
    algorithm: str  # "ring" or "tree"; "none" on one rank


def _is_all_reduce(collective: str) -> bool:
    return "allreduce" in collective or "all_reduce" in collective


def _is_gather_or_scatter(collective: str) -> bool:
    return "gather" in collective or "scatter" in collective


def _ring_steps(collective: str, ranks: int, nodes: int) -> tuple[int, int]:
    """The ring's steps for one call, and those of them that cross nodes: 2(n-1) for an all-reduce, n-1 for an
    all-gather or a reduce-scatter, n otherwise."""
    if _is_all_reduce(collective):
        return 2 * (ranks - 1), 2 * (nodes - 1)
    if _is_gather_or_scatter(collective):
        return ranks - 1, nodes - 1
    return ranks, nodes


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: the share of a call's buffer that crosses each link of the ring."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks if _is_all_reduce(collective) else (ranks - 1) / ranks


def ring_call(collective: str, nbytes: float, ranks: int, nodes: int, busbw_gbps: float) -> Call:
    steps, network_steps = _ring_steps(collective, ranks, nodes)
    hop = RING_HOP_US["nvlink"]
    if nodes > 1:
        hop = max(hop, 3 * NET_OVERHEAD_US)
    latency_us = BASE_LATENCY_US + (steps - network_steps) * hop + network_steps * RING_HOP_US["network"]
    if nodes > 1 and _is_all_reduce(collective) and nbytes / (PLATEAU_CHANNELS * ranks) >= 64:
        latency_us *= RING_PLATEAU
    latency_s = latency_us * 1e-6
    return Call(latency_s + nbytes * bus_factor(collective, ranks) / (busbw_gbps * 1e9), latency_s, "ring")


def tree_all_reduce(nbytes: float, ranks: int, nodes: int, busbw_gbps: float) -> Call:
    """A chain through each node's GPUs, a tree across the nodes, the buffer up it and back down."""
    per_node = ranks // nodes
    latency_s = (BASE_LATENCY_US + 2 * ((per_node - 1) * TREE_HOP_US["nvlink"]
                                        + _log2i(nodes) * TREE_HOP_US["network"])) * 1e-6
    bandwidth = busbw_gbps * 1e9 * TREE_BANDWIDTH * 0.5
    size_class = _log2i(int(nbytes) >> 6)
    if 0 <= size_class < len(TREE_CORRECTION):
        bandwidth *= TREE_CORRECTION[size_class]
    return Call(latency_s + nbytes / bandwidth, latency_s, "tree")


def call(collective: str, nbytes: float, ranks: int, nodes: int, busbw_gbps: float) -> Call:
    """One call moving `nbytes` (an all-gather's output, a reduce-scatter's input) among `ranks` ranks on `nodes`
    nodes, at a ring's bus bandwidth `busbw_gbps`: the algorithm NCCL picks, and its time."""
    if ranks == 1:
        return Call(0.0, 0.0, "none")
    ring = ring_call(collective, nbytes, ranks, nodes, busbw_gbps)
    if not _is_all_reduce(collective):
        return ring
    return min(ring, tree_all_reduce(nbytes, ranks, nodes, busbw_gbps), key=lambda c: c.seconds)


def _log2i(n: int) -> int:
    """NCCL's log2i: the floor of log2, -1 for 0."""
    return int(math.log2(n)) if n > 0 else -1
