"""A digest of the rehearsal's traced step for six tiny trials (fsdp2 with accumulation, ddp, tp, tp_fsdp2 with full
sAC, ddp LoRA with accumulation, fsdp2 with half sAC). Run at two commits, equal digests mean every figure of the
trace is unchanged: a check that a refactoring moved code without changing what it computes
(docs/results/refactor-checks-2026-11-27.md).

    PYTHONPATH=CHECKOUT .venv/bin/python bench/trace_digest.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
import torch.distributed as dist

from raybench.planning.plan import plan
from raybench.rehearse import fake_world, trace
from raybench.runtime.strategies import RankContext
from raybench.spec.load import parse_sweep

CASES = [(2, {"strategy": "fsdp2", "grad_accum": 3}), (2, {"strategy": "ddp"}), (2, {"strategy": "tp", "tp_size": 2}),
         (4, {"strategy": "tp_fsdp2", "tp_size": 2, "ac_ratio": "1"}),
         (2, {"strategy": "ddp", "finetune": "lora", "grad_accum": 4}), (2, {"strategy": "fsdp2", "ac_ratio": "1/2"})]
TRAIN = {"steps": 2, "warmup_steps": 1, "seq_len": 64, "micro_batch": 2, "precision": "bf16"}


def digest(world: int, train: dict) -> str:
    """The first 16 hex digits of the SHA-256 of the traced step, every field of it as sorted JSON."""
    spec = parse_sweep({"name": "digest", "model": {"preset": "tiny"}, "resources": {"workers": world},
                        "train": {**TRAIN, **train}, "estimate": {"gpu": "H100 SXM"}})
    (trial,) = plan(spec)
    fake_world.init_fake_world(0, world)
    try:
        step = trace.trace_step(trial.config, trial.shape, RankContext(0, world, 0, torch.device("cpu")), fake=True)
    finally:
        dist.destroy_process_group()
    text = json.dumps(dataclasses.asdict(step), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main() -> None:
    digests = {}
    for world, train in CASES:
        name = f"{world} ranks {json.dumps(train, sort_keys=True)}"
        digests[name] = digest(world, train)
        print(f"{name}: {digests[name]}")
    print(json.dumps({"bench": "trace_digest", "metric": "digest of six traced steps",
                      "value": hashlib.sha256("".join(digests.values()).encode()).hexdigest()[:16],
                      "goal": "equal at both commits of a refactoring", "digests": digests}))


if __name__ == "__main__":
    main()
