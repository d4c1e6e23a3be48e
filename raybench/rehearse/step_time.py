"""A step's predicted time: the traced roofline at the fitted efficiency, plus the communication compute does not
hide, at a measured bus bandwidth or that of nominal links."""

from __future__ import annotations

from dataclasses import dataclass

from raybench.rehearse.fitted import COMPILED_BYTE_COST, ROOFLINE_EFFICIENCY
from raybench.rehearse.trace import StepTrace


@dataclass(frozen=True)
class Link:
    """Nominal links of one GPU, GB/s in each direction (vendor data sheets)."""

    nvlink_gbps: float  # NVLink, between the GPUs of one NVLink domain
    nic_gbps: float  # its network adapter (one per GPU) to the GPUs beyond the domain
    nvlink_gpus: int  # GPUs in one NVLink domain: 8 in an HGX node, 72 in a GB200 NVL72 rack


# Used when the cluster has no stored all-reduce probe. H100/H200 SXM: NVLink 4, 900 GB/s bidirectional (450
# each way), one 400 Gb/s NDR NIC per GPU (50 GB/s). A100 SXM: NVLink 3, 600 GB/s (300 each way), one 200 Gb/s
# HDR NIC per GPU (25 GB/s). B200: NVLink 5, 1.8 TB/s (900 each way), 400 Gb/s per GPU. Eight GPUs to an NVLink
# domain, except GB200 NVL72, whose NVLink switches join the 72 GPUs of a rack (18 trays of 4). First match
# wins, so GB200 comes before B200.
LINKS = {"GB200": Link(900.0, 50.0, 72), "B200": Link(900.0, 50.0, 8), "H100": Link(450.0, 50.0, 8),
         "H200": Link(450.0, 50.0, 8), "A100": Link(300.0, 25.0, 8)}


def link_busbw_gbps(gpu: str | None, world_size: int) -> float | None:
    """Bus bandwidth a ring collective reaches on nominal links.

    Within an NVLink domain: NVLink. Beyond it, each of NCCL's rings leaves the domain once and NCCL spreads its
    rings over the domain's NICs, so a rank's bus bandwidth is the domain's NICs together, capped by NVLink
    (nccl-tests across 8-GPU nodes with 8 NICs reach about 8 x the one-NIC figure)."""
    link = next((v for k, v in LINKS.items() if gpu and k.lower() in gpu.lower()), None)
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

