"""raybench's instrumented loop (phase clock, per-step sync, utilization sampler) vs a bare PyTorch loop.

Both drive the same DDP model, optimizer and batches, interleaved in rounds so machine noise hits both alike:
on CPU 2 gloo ranks (tiny preset, fp32); with --device cuda one GPU (default preset llama-3.2-1b, bf16, NCCL):
    .venv/bin/python bench/harness_overhead.py [--rounds 30] [--steps 8] [--seq-len 256] [--micro-batch 4]
    python3 bench/harness_overhead.py --device cuda --seq-len 2048 --micro-batch 4
Prints a table, then one JSON line: value = the median over rounds of (instrumented p50 step / bare p50
step) in that round. Goal <= 1.02.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def bare_loop(trainable, batches, steps: int, sync) -> list[float]:
    """The loop a user would write by hand: no phase marks, no sampler; on GPU one sync per step to time it."""
    model, optimizer = trainable.model, trainable.optimizer
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with trainable.autocast():
            loss = model(**next(batches), use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
    return times


def instrumented_loop(trainable, batches, train, device) -> list[float]:
    from raybench.runtime import bench
    from raybench.runtime.sampler import Sampler

    return bench.timed_loop(trainable, batches, train, device, Sampler(None)).step_times_s


def run_rank(args) -> None:
    import torch
    import torch.distributed as dist

    from raybench.runtime import data, strategies
    from raybench.runtime.build import build_model
    from raybench.runtime.strategies import RankContext
    from raybench.spec.presets import model_shape
    from raybench.spec.sweep_spec import TrialConfig

    gpu = args.device == "cuda"
    dist.init_process_group("nccl" if gpu else "gloo")
    if gpu:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    config = TrialConfig.model_validate({
        "model": {"preset": args.preset or ("llama-3.2-1b" if gpu else "tiny")},
        "train": {"steps": args.steps, "warmup_steps": 0, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                  "precision": "bf16" if gpu else "fp32", "max_grad_norm": None, "strategy": "ddp"},
        "resources": {"workers": dist.get_world_size(), "gpus_per_worker": int(gpu)},
    })
    ctx = RankContext(dist.get_rank(), dist.get_world_size(), 0, torch.device(args.device, 0 if gpu else None))
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    trainable = strategies.setup("ddp", build_model(config.model, ctx.device, 0)[0], config.train, ctx)
    batches = data.batches(config, model_shape(config), ctx.rank, ctx.world_size)
    bare_loop(trainable, batches, 3, sync)  # warm both paths' allocator and DDP buckets once
    bare, ours, round_ratios = [], [], []
    for round_index in range(args.rounds):
        # Alternate which loop goes first, so that neither always inherits the other's allocator/cache state.
        if round_index % 2:
            ours_round = instrumented_loop(trainable, batches, config.train, ctx.device)
            bare_round = bare_loop(trainable, batches, args.steps, sync)
        else:
            bare_round = bare_loop(trainable, batches, args.steps, sync)
            ours_round = instrumented_loop(trainable, batches, config.train, ctx.device)
        bare += bare_round
        ours += ours_round
        # Paired per round: a slow drift of the shared machine hits both loops of a round alike.
        round_ratios.append(statistics.median(ours_round) / statistics.median(bare_round))
    if ctx.rank == 0:
        rows = [("bare PyTorch", bare), ("raybench loop", ours)]
        print(f"{'loop':<16}{'steps':>7}{'p50 ms':>10}{'p90 ms':>10}{'mean ms':>10}")
        for name, times in rows:
            q = statistics.quantiles(times, n=10)
            print(f"{name:<16}{len(times):>7}{statistics.median(times) * 1e3:>10.2f}{q[8] * 1e3:>10.2f}"
                  f"{statistics.fmean(times) * 1e3:>10.2f}")
        ratio = statistics.median(round_ratios)
        print(f"per-round ratio (raybench / bare): median {ratio:.4f}, quartiles "
              f"{', '.join(f'{q:.4f}' for q in statistics.quantiles(round_ratios, n=4))}")
        print(json.dumps({"bench": "harness_overhead",
                          "metric": "median over rounds of (raybench loop p50 / bare loop p50) step time",
                          "value": round(ratio, 4), "goal": "<= 1.02",
                          "pooled_ratio": round(statistics.median(ours) / statistics.median(bare), 4),
                          "bare_p50_ms": round(statistics.median(bare) * 1e3, 3),
                          "raybench_p50_ms": round(statistics.median(ours) * 1e3, 3), "steps_each": len(bare),
                          "world_size": ctx.world_size, "device": torch.cuda.get_device_name() if gpu else "cpu",
                          "config": vars(args)}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", help="model preset (default: tiny on CPU, llama-3.2-1b on CUDA)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return
    ranks = 1 if args.device == "cuda" else 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", __file__,
           *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)


if __name__ == "__main__":
    main()
