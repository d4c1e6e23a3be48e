"""What the block-by-block overlap (docs/rehearse.md, "Overlap") exposes, next to the step's first and last
collectives alone (the model before it), on a shape where the collectives come near the compute.

    .venv/bin/python bench/rehearse_overlap.py     # Llama 3.2 1B, FSDP2, 8 H100s, micro-batch 2 x 2,048

Rehearses the trial once, then prices its trace at several bus bandwidths both ways. Prints one JSON line per
bandwidth, then a shallow model's collectives in the order the trace issued them (kind, MB).
"""

from __future__ import annotations

import json

from raybench.planning.plan import plan
from raybench.rehearse import rehearsal, step_time
from raybench.spec.load import parse_sweep

GPU = "H100 SXM"
WORKERS = 8
BUSBW_GBPS = (50.0, 100.0, 200.0, 400.0)


def main() -> None:
    spec = parse_sweep({"name": "overlap", "model": {"preset": "llama-3.2-1b"},
                        "train": {"steps": 2, "warmup_steps": 1, "seq_len": 2048, "micro_batch": 2,
                                  "precision": "bf16", "strategy": "fsdp2"},
                        "resources": {"workers": WORKERS, "gpus_per_worker": 1}, "estimate": {"gpu": GPU}})
    (trial,) = plan(spec)
    traces: dict = {}
    layout = step_time.layout_of(GPU)
    for busbw in BUSBW_GBPS:
        r = rehearsal.rehearse(trial.config, trial.shape, GPU, busbw_gbps=busbw, busbw_source="set", traces=traces)
        deep = next(v for k, v in traces.items() if isinstance(v, rehearsal.StepTrace) and k[0] != "shallow")
        first_and_last_s = step_time._edges_exposed_s(deep, step_time._call_price(WORKERS, busbw, layout),
                                                      r.compute_s)
        print(json.dumps({"bench": "rehearse_overlap", "busbw_gbps": busbw, "compute_ms": r.compute_s * 1e3,
                          "comm_ms": r.comm_s * 1e3, "exposed_ms": r.exposed_comm_s * 1e3,
                          "first_and_last_only_ms": first_and_last_s * 1e3, "notes": r.notes}))
    shallow = next(v for k, v in traces.items() if k[0] == "shallow")
    calls = [(e[3], round(e[2] / 1e6, 1)) for e in shallow.timeline[0][1] if e[0] == "comm"]
    print(json.dumps({"bench": "rehearse_overlap", "shallow_model_calls_in_order_mb": calls}))


if __name__ == "__main__":
    main()
