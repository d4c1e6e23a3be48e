"""All-reduce bus bandwidth across a trial's ranks, measured as nccl-tests does and cached per cluster.

busbw = algbw * 2(n-1)/n with algbw = bytes / time: the ring all-reduce moves 2(n-1)/n of the buffer over each
link, so busbw is comparable across world sizes and with the links' rated bandwidth. The result is cached in
the store (keyed by the ranks' hostnames, world size and device type) so a sweep measures it once.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

SIZES_MIB = (1, 4, 16, 64, 256)
# gloo on the host reaches its bandwidth by 16 MiB, and its 64 and 256 MiB all-reduces took 2 of the probe's 2.2 s
# on 2 CPU ranks (docs/results/busbw-sizes-2026-12-07.md): CPU trials probe up to 16 MiB.
CPU_SIZES_MIB = (1, 4, 16)
WARMUP_ITERS, TIMED_ITERS = 2, 5


def bus_bandwidth_gbps(size_bytes: int, seconds: float, world_size: int) -> float:
    return size_bytes / seconds * 2 * (world_size - 1) / world_size / 1e9


def measure(device: torch.device, world_size: int, sizes_mib=None) -> dict[str, float]:
    """Bus bandwidth per message size in GB/s: the mean time of TIMED_ITERS all-reduces after warm-up, over
    `sizes_mib` (default: SIZES_MIB on a GPU, CPU_SIZES_MIB on the host)."""
    results = {}
    for mib in sizes_mib or (SIZES_MIB if device.type == "cuda" else CPU_SIZES_MIB):
        buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
        for _ in range(WARMUP_ITERS):
            dist.all_reduce(buf)
        _sync(device)
        start = time.perf_counter()
        for _ in range(TIMED_ITERS):
            dist.all_reduce(buf)
        _sync(device)
        seconds = (time.perf_counter() - start) / TIMED_ITERS
        results[str(mib)] = bus_bandwidth_gbps(buf.numel() * 4, seconds, world_size)
        del buf
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_path(cache_dir: str, hostnames: list[str], world_size: int, device_type: str) -> Path:
    key = json.dumps([sorted(hostnames), world_size, device_type])
    return Path(cache_dir) / f"busbw-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cached_measure(device: torch.device, rank: int, world_size: int, hostnames: list[str],
                   cache_dir: str) -> dict[str, float]:
    """Bus bandwidth by message size (MiB -> GB/s); every rank calls this, rank 0 decides and broadcasts."""
    path = cache_path(cache_dir, hostnames, world_size, device.type)
    decision = [None]
    if rank == 0 and path.exists():
        decision = [json.loads(path.read_text())]
    dist.broadcast_object_list(decision, src=0)
    if decision[0] is not None:
        return decision[0]
    results = measure(device, world_size)
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(results))
        tmp.replace(path)
    return results
