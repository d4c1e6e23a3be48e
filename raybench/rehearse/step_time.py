"""A step's predicted time: the traced roofline at the fitted efficiency, plus the communication compute does not
hide, at a measured bus bandwidth or that of nominal links."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raybench.rehearse.fitted import COMPILED_BYTE_COST, ROOFLINE_EFFICIENCY
from raybench.rehearse.trace import StepTrace
from raybench.spec.hardware import nominal_link


@dataclass(frozen=True)
class Layout:
    """Where a trial's ranks sit: GPUs per node (the GPUs one NVLink domain joins: 8 in an HGX node, 4 in seed
    001's H100 nodes, 72 in a GB200 NVL72 rack) and the network adapters of such a node."""

    gpus_per_node: int
    nics_per_node: int

    def nodes(self, world_size: int) -> int:
        return math.ceil(world_size / self.gpus_per_node)


def layout_of(gpu: str | None, gpus_per_node: int | None = None, nics_per_node: int | None = None) -> Layout | None:
    """The sweep's layout (estimate.gpus_per_node, estimate.nics_per_node), else the hardware table's NVLink
    domain with one NIC per GPU; None for a GPU the table lacks when the sweep says nothing."""
    link = nominal_link(gpu)
    per_node = gpus_per_node or (link.nvlink_gpus if link else None)
    if per_node is None:
        return None
    return Layout(per_node, nics_per_node or per_node)


def link_busbw_gbps(gpu: str | None, world_size: int, layout: Layout | None = None) -> float | None:
    """Bus bandwidth a ring collective reaches on nominal links (used when the cluster has no stored
    all-reduce probe).

    Within a node (`layout`; default the GPU's NVLink domain): NVLink. Beyond it, each of NCCL's rings leaves the
    node once and NCCL spreads its rings over the node's NICs, so a rank's bus bandwidth is the node's NICs
    together, capped by NVLink (nccl-tests across 8-GPU nodes with 8 NICs reach about 8 x the one-NIC figure)."""
    link = nominal_link(gpu)  # the hardware table's links (spec/hardware.py)
    if link is None or world_size == 1:  # one rank communicates with nobody
        return None
    layout = layout or Layout(link.nvlink_gpus, link.nvlink_gpus)
    if world_size <= layout.gpus_per_node:
        return link.nvlink_gbps
    return min(link.nvlink_gbps, layout.nics_per_node * link.nic_gbps)


# A collective's latency as NCCL's own tuning model prices it (src/graph/tuning.cc, ring algorithm, Simple
# protocol: what messages of FSDP's and DDP's sizes use): a base latency, plus one hop per ring step, over NVLink
# inside a node and over the network between nodes. Microseconds.
NCCL_BASE_LATENCY_US = 8.4
NCCL_HOP_LATENCY_US = {"nvlink": 3.4, "network": 9.6}


def collective_latency_s(collective: str, world_size: int, layout: Layout) -> float:
    """Seconds one call of `collective` waits besides moving its bytes: 2(n-1) ring steps for an all-reduce,
    n-1 for an all-gather or a reduce-scatter, n otherwise; of which those that cross nodes go over the network."""
    n, nodes = world_size, layout.nodes(world_size)
    if n == 1:
        return 0.0
    if _is_all_reduce(collective):
        steps, network_steps = 2 * (n - 1), 2 * (nodes - 1)
    elif "gather" in collective or "scatter" in collective:
        steps, network_steps = n - 1, nodes - 1
    else:
        steps, network_steps = n, nodes
    hops = (steps - network_steps) * NCCL_HOP_LATENCY_US["nvlink"] + network_steps * NCCL_HOP_LATENCY_US["network"]
    return (NCCL_BASE_LATENCY_US + hops) * 1e-6


def _is_all_reduce(collective: str) -> bool:
    return "allreduce" in collective or "all_reduce" in collective


# nccl-tests' bus-bandwidth factors: the share of a collective's buffer that crosses each link of the ring.
def _bus_factor(collective: str, world_size: int) -> float:
    n = world_size
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n if _is_all_reduce(collective) else (n - 1) / n


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # roofline of every operator (or the host's launches, where those take longer: host_s)
    comm_s: float  # every collective: its bytes at the bus bandwidth plus its latency per call
    exposed_comm_s: float  # the part of comm_s not hidden behind compute
    step_time_s: float
    busbw_gbps: float | None
    busbw_source: str  # "set" (estimate.busbw_gbps, --busbw), "probe" (the store's all-reduce measurement of
    # the cluster), "links" (nominal), "none"
    overlap: str  # the assumption, in words
    host_s: float | None = None  # launches x the calibrated launch cost; None where no profile measured it
    comm_latency_s: float = 0.0  # the latency part of comm_s


OVERLAP = ("FSDP all-gathers/reduce-scatters and DDP all-reduces run beside compute (exposed only beyond it), "
           "except the step's first all-gather and its last reduce-scatter or all-reduce, which have no compute "
           "beside them; other collectives (TP) are on the critical path")


def predict_step_time(trace: StepTrace, world_size: int, busbw_gbps: float | None, busbw_source: str,
                      efficiency: float = ROOFLINE_EFFICIENCY, compiled_traffic: float | None = None,
                      launch_s: float | None = None, layout: Layout | None = None) -> StepTime:
    """Roofline compute plus the communication it does not hide.

    efficiency scales the roofline (achieved fraction of peak FLOP/s and bandwidth), a global constant.
    compiled_traffic (compiled trials, `compiled_block_traffic`): the decoder blocks' memory-bound operators
    run as inductor's kernels, which move this share of their bytes at COMPILED_BYTE_COST times the price (the
    trace itself runs them eager).
    launch_s (a calibration profile's launch cost): the host launches each kernel while the GPU runs the ones
    before, so a step takes the longer of the two; small shapes are host-bound. Compiled trials launch inductor's
    fused kernels, which the eager trace does not count: not priced for them.
    layout: where the ranks sit, for each call's latency (`collective_latency_s`); None prices bytes only.
    """
    fused_s = 0.0
    if compiled_traffic is not None:
        fused_s = (1 - COMPILED_BYTE_COST * compiled_traffic) * trace.block_memory_bound_s
    compute_s = (trace.roofline_s - fused_s) / efficiency
    host_s = trace.launches * launch_s if launch_s and compiled_traffic is None else None
    compute_s = max(compute_s, host_s or 0.0)
    overlapped = blocking = edges = latency = 0.0
    for name, nbytes in trace.comm_bytes.items():
        if not busbw_gbps:
            continue
        calls = trace.comm_calls.get(name, 0)
        waits = calls * collective_latency_s(name, world_size, layout) if layout else 0.0
        seconds = nbytes * _bus_factor(name, world_size) / (busbw_gbps * 1e9) + waits
        latency += waits
        if name in trace.overlapped_comm:
            overlapped += seconds
            edges += seconds / calls if calls else 0.0  # the first all-gather; the last reduce-scatter/all-reduce
        else:
            blocking += seconds
    exposed = blocking + edges + max(0.0, overlapped - edges - compute_s)
    return StepTime(compute_s=compute_s, comm_s=overlapped + blocking, exposed_comm_s=exposed,
                    step_time_s=compute_s + exposed, busbw_gbps=busbw_gbps, busbw_source=busbw_source,
                    overlap=OVERLAP, host_s=host_s, comm_latency_s=latency)
