"""A step's predicted time: the traced roofline at the fitted efficiency, plus the communication compute does not
hide, at a measured bus bandwidth or that of nominal links."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from raybench.rehearse import nccl
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
    comm_algorithms: dict[str, str] | None = None  # per collective, the algorithm NCCL's model picks for its calls


OVERLAP = ("collectives on one stream beside compute, in the trace's order: an FSDP all-gather starts once the one "
           "before it is read (FSDP2 keeps one ahead) and compute waits for the all-gather it reads; a "
           "reduce-scatter or DDP all-reduce starts once backward produced its gradients, and the step ends when it "
           "has; TP's collectives block the operators that read them")
EDGES_OVERLAP = ("FSDP all-gathers/reduce-scatters and DDP all-reduces run beside compute (exposed only beyond it), "
                 "except the step's first all-gather and its last reduce-scatter or all-reduce, which have no "
                 "compute beside them; other collectives (TP) are on the critical path")


def exposed_s(events: list, compute_scale: float, comm_seconds) -> float:
    """Seconds one traced part (`StepTrace.timeline`) runs beyond its compute, its collectives on one stream (one
    communicator: NCCL runs its calls in order) and its operators on another, in the order the trace issued them.

    compute_scale turns the trace's roofline seconds into predicted ones; comm_seconds(name, bytes) prices a call.
    A gather starts when the stream is free and the gather before it has been read: FSDP2 holds one all-gather
    ahead of the block computing (it issues the next while the GPU computes the current one, the CPU running
    ahead). A reduction or a blocking collective starts when the stream is free and the compute issued before it
    (its input) is done. An operator that reads a collective's output starts when that collective ends."""
    compute_t = comm_t = gather_gate = busy = 0.0
    ends, kinds = [], []
    for event in events:
        if event[0] == "compute":
            _, seconds, waits_for, _ = event
            if waits_for >= 0:
                compute_t = max(compute_t, ends[waits_for])
                if kinds[waits_for] == "gather":
                    gather_gate = compute_t
            compute_t += seconds * compute_scale
            busy += seconds * compute_scale
        else:
            _, name, nbytes, kind = event
            start = max(comm_t, gather_gate if kind == "gather" else compute_t)
            comm_t = start + comm_seconds(name, nbytes)
            ends.append(comm_t)
            kinds.append(kind)
    return max(compute_t, comm_t) - busy


def gathered_after_step(trace: StepTrace) -> StepTrace:
    """ZeRO-1/2's step from its FSDP2 twin's trace (rehearsal.zero_twin). DeepSpeed keeps the 16-bit weights whole
    through every micro-batch and all-gathers the updated shards once a step, after the optimizer step, on the
    compute stream (stage_1_and_2.py `step`: all_gather_dp_groups), so nothing runs beside it. The twin gathers
    the same weights in each micro-batch's forward, ahead of the blocks that read them: those gathers leave the
    micro-batches, and one micro-batch's worth runs alone at the step's end."""
    gathers = {e[1] for _, events in trace.timeline for e in events if e[0] == "comm" and e[3] == "gather"}
    if not gathers:
        return trace
    per_step = {name: trace.comm_bytes[name] // trace.grad_accum for name in gathers}
    calls = {name: max(trace.comm_calls.get(name, 0) // trace.grad_accum, 1) for name in gathers}
    timeline = [(weight, _without_gathers(events)) for weight, events in trace.timeline]
    timeline += [(1, [["comm", name, per_step[name], "blocking"]]) for name in sorted(gathers)]
    return dataclasses.replace(trace, timeline=timeline, comm_bytes={**trace.comm_bytes, **per_step},
                               comm_calls={**trace.comm_calls, **calls})


def _without_gathers(events: list) -> list:
    """A timeline part less its FSDP all-gathers; the compute that waited for one waits for nothing, and waits
    for the other collectives keep pointing at them (exposed_s numbers collectives in order)."""
    kept, index, new_index = [], -1, {}
    for event in events:
        if event[0] == "comm":
            index += 1
            if event[3] == "gather":
                continue
            new_index[index] = len(new_index)
            kept.append(event)
        else:
            waits_for = event[2]
            kept.append([event[0], event[1], new_index.get(waits_for, -1) if waits_for >= 0 else -1, event[3]])
    return kept


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
    layout: where the ranks sit, for each call's latency and algorithm (`nccl.call`); None prices bytes only.
    """
    fused_s = 0.0
    if compiled_traffic is not None:
        fused_s = (1 - COMPILED_BYTE_COST * compiled_traffic) * trace.block_memory_bound_s
    compute_s = (trace.roofline_s - fused_s) / efficiency
    host_s = trace.launches * launch_s if launch_s and compiled_traffic is None else None
    compute_s = max(compute_s, host_s or 0.0)
    if not busbw_gbps:
        return StepTime(compute_s=compute_s, comm_s=0.0, exposed_comm_s=0.0, step_time_s=compute_s,
                        busbw_gbps=busbw_gbps, busbw_source=busbw_source, overlap=OVERLAP, host_s=host_s)
    call_s = _call_price(world_size, busbw_gbps, layout)
    calls = trace.comm_calls
    # Summed by name: a trace's collectives can come in a set's order (depth.py), which the hash seed varies per
    # process, and the sums' last bit with it; a worker process (`rehearse --jobs`) must price as this one.
    collectives = sorted(trace.comm_bytes.items())
    comm_s = sum(call_s(name, nbytes, calls.get(name, 0)) for name, nbytes in collectives)
    latency, algorithms = 0.0, None
    if layout:
        priced = {name: _average_call(name, nbytes, calls.get(name, 0), world_size, busbw_gbps, layout)
                  for name, nbytes in collectives}
        latency = sum(calls.get(name, 0) * call.latency_s for name, call in priced.items())
        algorithms = {name: call.algorithm for name, call in priced.items()}
    if trace.timeline:
        scale = compute_s / trace.roofline_s if trace.roofline_s else 0.0
        exposed = max(0.0, sum(weight * exposed_s(events, scale, call_s) for weight, events in trace.timeline))
        overlap = OVERLAP
    else:  # a step stored before the trace kept its timeline (op_policy's input, from an older rehearsal)
        exposed, overlap = _edges_exposed_s(trace, call_s, compute_s), EDGES_OVERLAP
    return StepTime(compute_s=compute_s, comm_s=comm_s, exposed_comm_s=exposed,
                    step_time_s=compute_s + exposed, busbw_gbps=busbw_gbps, busbw_source=busbw_source,
                    overlap=overlap, host_s=host_s, comm_latency_s=latency, comm_algorithms=algorithms)


def _average_call(name: str, nbytes: int, calls: int, world_size: int, busbw_gbps: float,
                  layout: Layout) -> nccl.Call:
    return nccl.call(name, nbytes / max(calls, 1), world_size, layout.nodes(world_size), busbw_gbps)


def _call_price(world_size: int, busbw_gbps: float, layout: Layout | None):
    """Seconds `calls` calls of a collective take to move `nbytes` in all: where the layout is known, each call as
    NCCL's tuning model prices it (latency, and the algorithm it picks: `nccl.call`); else the bytes alone at the
    bus bandwidth of a ring (and so for a step stored without its calls)."""
    def call_s(name: str, nbytes: int, calls: int = 1) -> float:
        if layout is None or not calls:
            return nbytes * nccl.bus_factor(name, world_size) / (busbw_gbps * 1e9)
        return calls * _average_call(name, nbytes, calls, world_size, busbw_gbps, layout).seconds

    return call_s


def _edges_exposed_s(trace: StepTrace, call_s, compute_s: float) -> float:
    """EDGES_OVERLAP: the step's collectives by name alone, without their order."""
    overlapped = blocking = edges = 0.0
    for name, nbytes in trace.comm_bytes.items():
        calls = trace.comm_calls.get(name, 0)
        seconds = call_s(name, nbytes, calls)
        if name in trace.overlapped_comm:
            overlapped += seconds
            edges += seconds / calls if calls else 0.0  # the first all-gather; the last reduce-scatter/all-reduce
        else:
            blocking += seconds
    return blocking + edges + max(0.0, overlapped - edges - compute_s)
