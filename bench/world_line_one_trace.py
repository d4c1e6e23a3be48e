"""The world-size line's second end from one trace (rehearse/shards.py), against that world size's own trace.

A grid point's first shallow model (sAC 1/2: blocks checkpointed, plain, checkpointed, plain) is traced at one world
size with its second end built at another (`trace_step(second_dp=...)`), and traced again at that other world size.
Compared: the memory after every operator (each category, exactly), then every field of the two StepTraces
(numbers within 1e-9 relative, bytes exactly); with --share-to, the line through the traced step and its second end
(worlds.share) at a third world size against the line through the two traced steps.

    .venv/bin/python bench/world_line_one_trace.py --model qwen2.5-72b --strategy tp_fsdp2 --grad-accum 4 \
        --worlds 16 64 --share-to 128

Records: docs/results/grid-rehearsal-2026-11-28.md, last sections.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from rehearse_grid import differences  # a sibling script: bench/ is the path's first entry

from raybench.planning.plan import plan
from raybench.rehearse import rehearsal, worlds
from raybench.spec.load import load_sweep

SWEEP = Path(__file__).resolve().parent / "sweeps" / "grid-1000.yaml"
KINDS = (True, False, True, False)  # the shallow model sAC 1/2 traces first


def fields_off(one, other) -> list[str]:
    names = [f.name for f in dataclasses.fields(one) if f.name not in ("memory_events", "sharding", "second")]
    return differences({n: getattr(one, n) for n in names}, {n: getattr(other, n) for n in names})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "tp_fsdp2"])
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--worlds", type=int, nargs=2, default=[8, 16], help="traced, then its second end's")
    parser.add_argument("--share-to", type=int, help="a third world size, shared through each pair of ends")
    args = parser.parse_args()
    points = {t.axis_values["resources.workers"]: t for t in plan(load_sweep(SWEEP))
              if t.axis_values["model.preset"] == args.model and t.axis_values["train.strategy"] == args.strategy
              and t.axis_values["train.grad_accum"] == args.grad_accum and t.axis_values["train.ac_ratio"] == "1/2"}
    tp = 8 if args.strategy == "tp_fsdp2" else 1
    dp1, dp2 = (world // tp for world in args.worlds)

    def traced(world: int, second_dp: int | None = None):
        t = points[world]
        return rehearsal._trace(t.config, t.shape, 0, "H100 SXM", rehearsal.SHIPPED_CALIBRATION, KINDS,
                                record_events=True, second_dp=second_dp)

    first, own = traced(args.worlds[0], second_dp=dp2), traced(args.worlds[1])
    second, first.second = first.second, None
    one, two = second.memory_events, own.memory_events
    values_off = sum(a != b for a, b in zip(one.category_bytes, two.category_bytes))
    print(f"{args.model} {args.strategy} x{args.grad_accum}: FSDP2 group {dp1} traced, its second end at {dp2}: "
          f"operators {one.count} (its own trace: {two.count}), memory values off {values_off} of "
          f"{len(two.category_bytes)}; fields off {fields_off(second, own)[:5] or 'none'}")
    if args.share_to:
        dp3 = args.share_to // tp
        split, both_traced = worlds.share(dp3, {dp1: first, dp2: second}), worlds.share(dp3, {dp1: first, dp2: own})
        print(f"shared to {dp3} through the second end against through two traced steps: fields off "
              f"{fields_off(split, both_traced)[:5] or 'none'}")


if __name__ == "__main__":
    main()
