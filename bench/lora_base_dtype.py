"""Loss trajectory of a LoRA run with its frozen base in bf16 (train.lora.base_dtype auto under bf16 compute)
against the same run with an fp32 base, on CPU.

    .venv/bin/python bench/lora_base_dtype.py [--steps 20] [--strategy ddp --strategy fsdp2]

The tiny preset with LoRA r16 on attention and MLP (the default targets), bf16, micro-batch 2 x seq 32, lr 1e-2,
on one gloo rank in this process, built and wrapped as the worker does (build.build_and_wrap) and stepped with
the worker's own step (bench.train_step). The batches are two fixed random-token batches in turn, so that the
adapters can learn them and the loss falls. Prints a Markdown table of the per-step losses, the bytes of the
parameters each run holds, and one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile

import torch
import torch.distributed as dist

from raybench.planning.plan import plan
from raybench.runtime import bench, build
from raybench.runtime.strategies import RankContext
from raybench.spec.load import parse_sweep
from raybench.spec.presets import PRESETS

CPU = torch.device("cpu")
BASES = ("fp32", "auto")


def run(strategy: str, base_dtype: str, steps: int) -> dict:
    """Per-step losses and held parameter bytes of one run."""
    spec = parse_sweep({"name": "lora-base-dtype", "model": {"preset": "tiny"}, "train": {
        "strategy": strategy, "finetune": "lora", "precision": "bf16", "steps": steps, "warmup_steps": 1,
        "seq_len": 32, "micro_batch": 2, "lr": 1e-2, "lora": {"base_dtype": base_dtype}}})
    (trial,) = plan(spec)
    generator = torch.Generator().manual_seed(0)
    fixed = [torch.randint(0, PRESETS["tiny"].vocab_size, (2, 32), generator=generator) for _ in range(2)]
    batches = ({"input_ids": ids, "labels": ids} for ids in itertools.cycle(fixed))
    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group("gloo", init_method=f"file://{directory}/init", rank=0, world_size=1)
        try:
            built = build.build_and_wrap(trial.payload, RankContext(0, 1, 0, CPU))
            clock = bench.PhaseClock(CPU)
            losses = [bench.train_step(built.trainable, batches, trial.config.train, CPU, clock)[0].item()
                      for _ in range(steps)]
            params = list(built.trainable.model.parameters())
        finally:
            dist.destroy_process_group()

    def held(trainable: bool) -> int:
        return sum(_local(p).numel() * p.element_size() for p in params if p.requires_grad == trainable)

    return {"losses": losses, "base_dtype": trial.config.train.lora_base_dtype, "base_bytes": held(False),
            "adapter_bytes": held(True)}


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategy", action="append", choices=["ddp", "fsdp2"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    summary = {"bench": "lora_base_dtype", "steps": args.steps}
    for strategy in args.strategy or ["ddp", "fsdp2"]:
        fp32, bf16 = (run(strategy, base, args.steps) for base in BASES)
        print(f"\n### {strategy}: base fp32 vs base {bf16['base_dtype']} (auto)\n")
        print("| step | loss, fp32 base | loss, bf16 base | bf16 / fp32 - 1 |\n|---|---|---|---|")
        for step, (a, b) in enumerate(zip(fp32["losses"], bf16["losses"]), 1):
            print(f"| {step} | {a:.4f} | {b:.4f} | {b / a - 1:+.3%} |")
        print(f"\nbase weights held: {fp32['base_bytes']:,} B (fp32) vs {bf16['base_bytes']:,} B (bf16); adapters "
              f"{fp32['adapter_bytes']:,} B vs {bf16['adapter_bytes']:,} B")
        summary[strategy] = {
            "max_abs_rel_diff": max(abs(b / a - 1) for a, b in zip(fp32["losses"], bf16["losses"])),
            "loss_first": [fp32["losses"][0], bf16["losses"][0]], "loss_final": [fp32["losses"][-1],
                                                                                 bf16["losses"][-1]],
            "base_bytes": [fp32["base_bytes"], bf16["base_bytes"]],
            "adapter_bytes": [fp32["adapter_bytes"], bf16["adapter_bytes"]]}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
