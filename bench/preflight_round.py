"""GPU round 11 (the cluster-health issue): the pre-flight on a real GPU machine, and NCCL's own word on it.

    python3 bench/preflight_round.py OUT_DIR          # bench/gpu_truth.sh's `preflight` stage

1. Every GPU of this machine measured by the pre-flight on a local Ray (`raybench cluster check`'s path:
   drivers/preflight.check), each figure against the hardware table: OUT_DIR/preflight.json and the summary lines.
2. One NCCL process group over every GPU of the machine (one process per GPU, one all-reduce), each rank's NCCL
   INIT/NET log captured as a trial captures it (runtime/nccl_log.capture) and read back (its transports and the
   row's verdict): OUT_DIR/nccl-rank*.log and the lines printed. On a machine without CUDA (the CPU twin,
   tests/unit/test_gpu_preflight_round.py) the group is gloo and says "not checked (gloo)".
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raybench.runtime import nccl_log


def preflight_rows(out: Path) -> list[str]:
    from raybench.drivers import preflight
    from raybench.drivers.ray_cluster import ray_cluster

    with ray_cluster(None):
        rows = preflight.check("gpu-round", None)
    (out / "preflight.json").write_text(json.dumps(rows, indent=1))
    return preflight.summary(rows)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(rank)
        nccl_log.capture()
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init, rank=rank, world_size=world)
    tensor = torch.ones(1 << 20, device=f"cuda:{rank}" if on_gpu else "cpu")
    dist.all_reduce(tensor)
    found = nccl_log.transports(nccl_log.logged()) if on_gpu else None
    line = nccl_log.check_text(found, hosts=1) if on_gpu else "not checked (gloo)"
    if on_gpu and nccl_log.log_path():
        shutil.copy(nccl_log.log_path(), Path(out) / f"nccl-rank{rank}.log")
    Path(out, f"nccl-rank{rank}.json").write_text(json.dumps({"transports": found, "check": line}))
    dist.destroy_process_group()


def nccl_lines(out: Path) -> list[str]:
    """One process group over the machine's GPUs (2 CPU ranks without CUDA): each rank's transports and verdict."""
    world = torch.cuda.device_count() if torch.cuda.is_available() else 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, f"file://{tmp}/init", str(out)), nprocs=world)
    return [f"rank {r}: " + (out / f"nccl-rank{r}.json").read_text() for r in range(world)]


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    lines = nccl_lines(out)
    if "--nccl-only" not in sys.argv:
        lines = [*preflight_rows(out), *lines]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
