"""What the all-reduce probe (raybench/runtime/allreduce.py) measures and costs per message size on this machine's
device: bus bandwidth and seconds per size, on 2 gloo ranks (CPU) or 2 NCCL ranks (--device cuda), over rounds.

    .venv/bin/python bench/busbw_sizes.py [--rounds 3] [--device cpu]

Prints one JSON line per round and a summary: per size, the median bus bandwidth (GB/s) and the median seconds
the probe spends on that size (its warm-up and timed all-reduces, the buffer's allocation included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raybench.runtime import allreduce


def _rank(rank: int, world: int, init: str, device: str, rounds: int, out: str) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    results = []
    for _ in range(rounds):
        for mib in allreduce.SIZES_MIB:
            t0 = time.perf_counter()
            busbw = allreduce.measure(dev, world, sizes_mib=(mib,))[str(mib)]
            results.append({"mib": mib, "busbw_gbps": busbw, "seconds": time.perf_counter() - t0})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(2, f"file://{tmp}/init", args.device, args.rounds, out), nprocs=2)
        with open(out) as f:
            results = json.load(f)
    for r in results:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    summary = {str(mib): {"busbw_gbps": round(statistics.median(r["busbw_gbps"] for r in results if r["mib"] == mib),
                                              3),
                          "seconds": round(statistics.median(r["seconds"] for r in results if r["mib"] == mib), 3)}
               for mib in allreduce.SIZES_MIB}
    print(json.dumps({"bench": "busbw_sizes", "device": args.device, "rounds": args.rounds, "by_mib": summary}))


if __name__ == "__main__":
    main()
