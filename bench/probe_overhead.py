"""What the probe costs a training loop: the same loop timed with and without `StepProbe`, on this machine.

    .venv/bin/python bench/probe_overhead.py [--rounds 10] [--steps 20] [--micro-batch 4] [--seq-len 128]
        [--threads 1] [--device cpu|cuda]

A tiny Llama (the 'tiny' preset's shape, random weights, transformers, fp32) trains in this one process, on
the CPU or a GPU. Each
round runs `--steps` steps without the probe (A) and with it (B), in the order A B B A, so that a drift of the
machine's speed over the round cancels out of B - A. A loop without the probe still reads its loss each step,
as training loops do for logging: the probe's own work is what B adds. A block's step time is the median of its
steps (robust to a step the machine's other load preempted). Prints per-round step times, the probe's cost per
step as a fraction of the step time (median over rounds, with the spread), the bare cost of one `probe.step`
call, then one JSON line.

On CPU the probe's device synchronization is a no-op; on CUDA it is one torch.cuda.synchronize per optimizer
step, which a loop that reads its loss each step (loss.item()) already pays.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from raybench.runtime.fingerprint import cpu_model
from raybench.runtime.probe import StepProbe
from raybench.spec.presets import PRESETS


def build(device: torch.device, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**PRESETS["tiny"].hf_config_kwargs())).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def run_block(model, optimizer, batch: torch.Tensor, steps: int, probe: StepProbe | None) -> float:
    """The median step time in seconds over `steps` steps (each from the previous step's end to this one's, the
    probe's call included when given): a median, so that a step the machine's other load preempted counts once."""
    if probe is not None:
        probe.start()
    times, last = [], time.perf_counter()
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if probe is not None:
            probe.step(tokens=batch.numel(), loss=loss.detach())
        else:
            float(loss.detach())  # what a loop without the probe reads anyway: its loss
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return statistics.median(times)


def bare_step_cost_s(device: torch.device, calls: int = 100_000) -> float:
    """One probe.step call with no training around it: the probe's own bookkeeping (and, on CUDA, an idle
    device's synchronization)."""
    probe = StepProbe(device)
    loss = torch.tensor(1.0, device=device)
    probe.start()
    start = time.perf_counter()
    for _ in range(calls):
        probe.step(tokens=512, loss=loss)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, optimizer = build(device)
    vocab = PRESETS["tiny"].vocab_size
    batch = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    run_block(model, optimizer, batch, 5, None)  # warm-up: allocator, optimizer state
    fractions, plain_s, probed_s = [], [], []
    for i in range(args.rounds):
        a1 = run_block(model, optimizer, batch, args.steps, None)
        b1 = run_block(model, optimizer, batch, args.steps, StepProbe(device))
        b2 = run_block(model, optimizer, batch, args.steps, StepProbe(device))
        a2 = run_block(model, optimizer, batch, args.steps, None)
        a, b = (a1 + a2) / 2, (b1 + b2) / 2
        fractions.append((b - a) / a)
        plain_s.append(a)
        probed_s.append(b)
        print(f"round {i}: without probe {a * 1000:.2f} ms/step, with {b * 1000:.2f} ms/step, "
              f"cost {100 * (b - a) / a:+.2f}%")
    bare = bare_step_cost_s(device)
    median, step_s = statistics.median(fractions), statistics.median(plain_s)
    print(f"probe cost per step: median {100 * median:+.2f}% of the step time (rounds: "
          f"{min(fractions) * 100:+.2f}% .. {max(fractions) * 100:+.2f}%); one probe.step call alone "
          f"{bare * 1e6:.2f} us = {100 * bare / step_s:.4f}% of a {1000 * step_s:.1f} ms step")
    print(json.dumps({"metric": "probe_cost_fraction_of_step", "value": median, "rounds": fractions,
                      "step_s_without": step_s, "step_s_with": statistics.median(probed_s),
                      "bare_step_call_s": bare, "steps_per_block": args.steps, "micro_batch": args.micro_batch,
                      "seq_len": args.seq_len, "device": str(device), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "cpu": cpu_model(), "python": platform.python_version()}))


if __name__ == "__main__":
    main()
