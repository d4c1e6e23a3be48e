"""ZeRO-2's step against its FSDP2 twin's, as `raybench rehearse` prices them: DeepSpeed gathers the updated weights
once a step after the optimizer step, with nothing beside it (rehearse/step_time.gathered_after_step); the twin
gathers them in every micro-batch's forward, hidden behind the blocks (how a ZeRO-2 step was priced before).

    PYTHONPATH=$PWD .venv/bin/python bench/zero2_gather.py [--preset llama-3.2-1b] [--workers 8] [--gpu "H100 SXM"]
"""

from __future__ import annotations

import argparse
import json

from raybench.planning.plan import plan
from raybench.rehearse import rehearsal
from raybench.spec.load import parse_sweep
from raybench.spec.presets import PRESETS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--gpu", default="H100 SXM")
    parser.add_argument("--grad-accum", type=int, default=2)
    args = parser.parse_args()
    sweep = {"name": "zero2-gather", "model": {"preset": args.preset},
             "train": {"strategy": "deepspeed", "zero_stage": 2, "seq_len": 2048, "micro_batch": 1,
                       "grad_accum": args.grad_accum, "precision": "bf16", "steps": 10, "warmup_steps": 2},
             "resources": {"workers": args.workers, "gpus_per_worker": 1},
             "estimate": {"gpu": args.gpu, "prune": False}}
    (trial,) = plan(parse_sweep(sweep))
    shape, traces = PRESETS[args.preset], {}
    zero2 = rehearsal.rehearse(trial.config, shape, args.gpu, analytic=trial.assessment.analytic, traces=traces)
    twin = rehearsal.rehearse(rehearsal.zero_twin(trial.config), shape, args.gpu, traces=traces)
    for name, r in (("fsdp2 twin (ZeRO-2 as priced before)", twin), ("zero2", zero2)):
        print(json.dumps({"priced_as": name, "step_time_s": round(r.step_time_s, 5), "compute_s": round(r.compute_s, 5),
                          "comm_s": round(r.comm_s, 5), "exposed_comm_s": round(r.exposed_comm_s, 5),
                          "allgather_gb_per_step": round(r.comm_bytes["allgather_base"] / 1e9, 3)}))
    print(json.dumps({"zero2_over_twin_step": round(zero2.step_time_s / twin.step_time_s - 1, 4)}))


if __name__ == "__main__":
    main()
