"""A step's predicted time: the traced roofline at the fitted efficiency, plus the communication compute does not
hide, at a measured bus bandwidth or that of nominal links."""

from __future__ import annotations

from dataclasses import dataclass

from raybench.rehearse.fitted import COMPILED_BYTE_COST, ROOFLINE_EFFICIENCY
from raybench.rehearse.trace import StepTrace
from raybench.spec.hardware import nominal_link


def link_busbw_gbps(gpu: str | None, world_size: int) -> float | None:
    """Bus bandwidth a ring collective reaches on nominal links (used when the cluster has no stored
    all-reduce probe).

    Within an NVLink domain: NVLink. Beyond it, each of NCCL's rings leaves the domain once and NCCL spreads its
    rings over the domain's NICs, so a rank's bus bandwidth is the domain's NICs together, capped by NVLink
    (nccl-tests across 8-GPU nodes with 8 NICs reach about 8 x the one-NIC figure)."""
    link = nominal_link(gpu)  # the hardware table's links (spec/hardware.py)
    if link is None or world_size == 1:  # one rank communicates with nobody
        return None
    if world_size <= link.nvlink_gpus:
        return link.nvlink_gbps
    return min(link.nvlink_gbps, link.nvlink_gpus * link.nic_gbps)


# nccl-tests' bus-bandwidth factors: the share of a collective's buffer that crosses each link of the ring.
def _bus_factor(collective: str, world_size: int) -> float:
    n = world_size
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n if "allreduce" in collective or "all_reduce" in collective else (n - 1) / n


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # roofline of every operator
    comm_s: float  # every collective at the bus bandwidth
    exposed_comm_s: float  # the part of comm_s not hidden behind compute
    step_time_s: float
    busbw_gbps: float | None
    busbw_source: str  # "set" (estimate.busbw_gbps, --busbw), "probe" (the store's all-reduce measurement of
    # the cluster), "links" (nominal), "none"
    overlap: str  # the assumption, in words


def predict_step_time(trace: StepTrace, world_size: int, busbw_gbps: float | None, busbw_source: str,
                      efficiency: float = ROOFLINE_EFFICIENCY, compiled_traffic: float | None = None) -> StepTime:
    """Roofline compute plus communication; FSDP/DDP collectives overlap compute, the others (TP) do not.

    efficiency scales the roofline (achieved fraction of peak FLOP/s and bandwidth), a global constant.
    compiled_traffic (compiled trials, `compiled_block_traffic`): the decoder blocks' memory-bound operators
    run as inductor's kernels, which move this share of their bytes at COMPILED_BYTE_COST times the price (the
    trace itself runs them eager).
    """
    fused_s = 0.0
    if compiled_traffic is not None:
        fused_s = (1 - COMPILED_BYTE_COST * compiled_traffic) * trace.block_memory_bound_s
    compute_s = (trace.roofline_s - fused_s) / efficiency
    overlapped = blocking = 0.0
    for name, nbytes in trace.comm_bytes.items():
        if busbw_gbps:
            seconds = nbytes * _bus_factor(name, world_size) / (busbw_gbps * 1e9)
            if name in trace.overlapped_comm:
                overlapped += seconds
            else:
                blocking += seconds
    exposed = blocking + max(0.0, overlapped - compute_s)
    return StepTime(compute_s=compute_s, comm_s=overlapped + blocking, exposed_comm_s=exposed,
                    step_time_s=compute_s + exposed, busbw_gbps=busbw_gbps, busbw_source=busbw_source,
                    overlap="FSDP all-gathers/reduce-scatters and DDP all-reduces run beside compute (exposed only "
                            "beyond it); other collectives (TP) are on the critical path")

