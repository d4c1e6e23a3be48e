"""train.loss chunked against full on CPU: a rank's peak memory and step time, runs in the order A B B A.

    .venv/bin/python bench/chunked_loss.py [--steps 3] [--seq-len 2048] [--micro-batch 2] [--precision fp32]

The model is a 32,000-entry vocabulary (Llama-2's) on a narrow 2-block decoder (hidden 256), so that the head and
the loss dominate the step as the logits dominate an 8B step's temporaries; full fine-tune, ddp on one gloo rank,
built and wrapped as the worker does (build.build_and_wrap with a shape) and stepped with the worker's own step
(bench.train_step) on random tokens. Each run is a fresh process: after one untimed step its peak resident
memory is reset (/proc/self/clear_refs), and the timed steps' peak over the resident memory before them is the
step's own peak (the logits, their gradient and the activations; the weights, gradients and optimizer state
exist before). Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

ORDER = ("chunked", "full", "full", "chunked")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def one_run(loss: str, steps: int, seq_len: int, micro_batch: int, precision: str) -> dict:
    """In this process: one trial's step peak (MiB over the resident memory before it) and step times."""
    import torch
    import torch.distributed as dist

    from raybench.planning.plan import plan
    from raybench.runtime import bench, build
    from raybench.runtime.strategies import RankContext
    from raybench.spec.load import parse_sweep
    from raybench.spec.presets import ModelShape

    torch.set_num_threads(1)
    shape = ModelShape("llama", 256, 2, 4, 2, 512, 32000, 4096, False)
    spec = parse_sweep({"name": "chunked-loss", "model": {"preset": "tiny"}, "train": {
        "loss": loss, "precision": precision, "steps": steps + 1, "warmup_steps": 1, "seq_len": seq_len,
        "micro_batch": micro_batch, "optimizer": "adamw_foreach"}})
    (trial,) = plan(spec)
    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)

    def batches():
        while True:
            ids = torch.randint(0, shape.vocab_size, (micro_batch, seq_len), generator=generator)
            yield {"input_ids": ids, "labels": ids}

    data = batches()
    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group("gloo", init_method=f"file://{directory}/init", rank=0, world_size=1)
        try:
            trainable = build.build_and_wrap(trial.payload, RankContext(0, 1, 0, cpu), shape).trainable
            clock = bench.PhaseClock(cpu)
            bench.train_step(trainable, data, trial.config.train, cpu, clock)  # optimizer state exists after it
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # peak resident memory := resident memory now
            before_kib = _status_kib("VmRSS:")
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                bench.train_step(trainable, data, trial.config.train, cpu, clock)
                times.append(time.perf_counter() - start)
            peak_kib = _status_kib("VmHWM:")
        finally:
            dist.destroy_process_group()
    return {"loss": loss, "step_peak_mib": (peak_kib - before_kib) / 1024, "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=2048)  # 4096 tokens: 4 chunks of 1024
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: run this loss and print its JSON
    args = parser.parse_args()
    settings = (args.steps, args.seq_len, args.micro_batch, args.precision)
    if args.one:
        print(json.dumps(one_run(args.one, *settings)))
        return
    runs = []
    for loss in ORDER:
        out = subprocess.run([sys.executable, __file__, "--one", loss, "--steps", str(args.steps), "--seq-len",
                              str(args.seq_len), "--micro-batch", str(args.micro_batch), "--precision",
                              args.precision], check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    print(f"| run | loss | step peak MiB | step s (median of {args.steps}) |\n|---|---|---|---|")
    for i, run in enumerate(runs):
        print(f"| {i + 1} | {run['loss']} | {run['step_peak_mib']:.0f} | {run['step_s']:.3f} |")
    print(json.dumps({"settings": dict(zip(("steps", "seq_len", "micro_batch", "precision"), settings)),
                      "runs": runs}))


if __name__ == "__main__":
    main()
