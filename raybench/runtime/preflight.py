"""What one device of a node delivers, measured in a few seconds before any trial trusts it: its matmul rate,
its memory's copy bandwidth, and (GPUs) the host-to-device copy rate. `raybench cluster check` runs this on every
GPU of every node at once (on CPU nodes, one worker's cores) and compares the nodes (drivers/preflight.py). Then
the links: the all-reduce bus bandwidth among a node's GPUs, and across each pair of nodes (`link_bus_bandwidth`).

Each figure is a sustained rate: the work done over a window of WINDOW_S seconds after a warm-up, not the best of a
few short repetitions. A GPU held at lower clocks is slow in every repetition, but a device that loses time in
slices (a CPU quota, cores shared with other work, a GPU throttled by power or heat after a burst) runs some short
repetitions at full speed: only the rate over many of its slices shows it.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import time

import torch
import torch.distributed as dist

from raybench.runtime import allreduce

WINDOW_S = 1.0
# Sizes whose one repetition takes milliseconds on the slowest device measured (one CPU core) and is still large
# enough on an H200 to run at its rate.
GPU_MATMUL_N, CPU_MATMUL_N = 8192, 512
GPU_COPY_MIB, CPU_COPY_MIB = 1024, 64


def _rate(run, work: float, device: torch.device, window_s: float = WINDOW_S) -> float:
    """`work` units per second, sustained: calls of `run` (each `work` units) over at least `window_s` seconds,
    after one untimed call (allocation, kernel selection)."""
    run()
    _sync(device)
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < window_s:
        run()
        _sync(device)
        calls += 1
    return calls * work / elapsed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device) -> float:
    """Dense matmul rate in TFLOP/s: bf16 on a GPU (what training runs), fp32 on CPU."""
    n = GPU_MATMUL_N if device.type == "cuda" else CPU_MATMUL_N
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return _rate(lambda: torch.mm(a, b), 2 * n**3, device) / 1e12


def memory_gb_per_s(device: torch.device) -> float:
    """Copy bandwidth of the device's memory in GB/s: bytes read plus bytes written per second."""
    mib = GPU_COPY_MIB if device.type == "cuda" else CPU_COPY_MIB
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return _rate(lambda: dst.copy_(src), 2 * src.numel() * 4, device) / 1e9


def host_to_device_gb_per_s(device: torch.device) -> float | None:
    """Pinned host memory to the GPU in GB/s (the PCIe or C2C link); None on CPU."""
    if device.type != "cuda":
        return None
    host = torch.ones(GPU_COPY_MIB * 2**20 // 4).pin_memory()
    on_device = torch.empty(host.shape, device=device)
    return _rate(lambda: on_device.copy_(host, non_blocking=True), host.numel() * 4, device) / 1e9


def measure(device: torch.device) -> dict:
    """The device's figures, with where they were measured."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"hostname": socket.gethostname(), "device": name, "device_index": device.index,
            "torch_threads": torch.get_num_threads(), "matmul_tflops": matmul_tflops(device),
            "memory_gb_per_s": memory_gb_per_s(device), "host_to_device_gb_per_s": host_to_device_gb_per_s(device)}


# A link's measurement gives up after this long: a peer that never joins (a firewall between two nodes) is a
# link that does not work, said as such, not a pre-flight that hangs.
LINK_TIMEOUT_S = 120


def link_bus_bandwidth(rank: int, world_size: int, init_method: str, gpu: int | None,
                       node_gpus: list[int] | None = None) -> float:
    """The best all-reduce bus bandwidth in GB/s (nccl-tests' definition, over allreduce's message sizes) among
    `world_size` processes meeting at `init_method`: NCCL on GPU `gpu`, gloo on the host (None). `node_gpus`: every
    GPU this process's node lends to the measurement, made visible to it as Ray Train does for its workers, so
    that NCCL can reach its peers over NVLink rather than through the host."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in node_gpus or [gpu])
    device = torch.device("cuda", (node_gpus or [gpu]).index(gpu)) if gpu is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=dt.timedelta(seconds=LINK_TIMEOUT_S))
    try:
        return max(allreduce.measure(device, world_size).values())
    finally:
        dist.destroy_process_group()


def rendezvous(host: str) -> str:
    """A TCP address for a link's processes to meet at, on `host` (this node's address as its peers reach it): a
    port free now (the OS's choice)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"tcp://{host}:{port}"
