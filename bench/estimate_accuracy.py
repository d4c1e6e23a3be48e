"""How close the memory estimate comes to measured peaks on CPU: real trials under torchrun (2 gloo ranks, fp32)
of a mid-size random Llama (hidden 512, 8 layers, vocab 32000; ~56M parameters) so the model, not the Python
process, dominates each rank's memory; plus one tiny-preset trial that measures the process baseline itself.

    .venv/bin/python bench/estimate_accuracy.py [--steps 3]

For each trial: the estimate's raw peak per rank, the measured peak RSS (max over ranks) and the error
measured / estimate - 1, exactly as the store's est_peak_error column. Prints a table, then one JSON line:
value = median |error| over the mid-size trials. Goal: <= 0.25 (the calibration then corrects what is left).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from raybench.drivers import executors
from raybench.drivers.trial import run_trial
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep

SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)
CASES = [  # (label, model, train overrides)
    ("baseline: tiny preset", "tiny", {}),
    ("ddp", "mid", {}),
    ("ddp, ac_ratio 1", "mid", {"ac_ratio": "1"}),
    ("ddp, micro_batch 8", "mid", {"micro_batch": 8}),
    ("ddp, sgd", "mid", {"optimizer": "sgd"}),
    ("ddp, lora r16", "mid", {"finetune": "lora", "lora": {"rank": 16}}),
    ("fsdp2", "mid", {"strategy": "fsdp2"}),
    ("tp 2", "mid", {"strategy": "tp", "tp_size": 2}),
]


def make_model_dir(directory: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(directory, safe_serialization=True)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="raybench-estimate-") as tmp:
        mid = make_model_dir(Path(tmp) / "mid")
        root = Path(tmp) / "store"
        results = []
        for label, model, overrides in CASES:
            spec = parse_sweep({
                "name": "estimate-accuracy", "model": {"preset": "tiny"} if model == "tiny" else {"path": str(mid)},
                "train": {"steps": args.steps, "warmup_steps": 1, "seq_len": 256, "micro_batch": 4,
                          "precision": "fp32", "strategy": "ddp", **overrides},
                "resources": {"workers": 2},
            })
            (t,) = plan(spec)
            row = run_trial(t.payload, spec.name, str(root), "torchrun", executors.get("torchrun"))
            if row["status"] != "ok":
                raise SystemExit(f"{label}: {row['status']}: {row['message']}")
            results.append((label, model, t.assessment.analytic, row))
    mid_errors = [row["est_peak_error"] for _, model, _, row in results if model == "mid"]
    baseline = next(row["peak_rss_gib"] for _, model, _, row in results if model == "tiny")
    print(f"{'trial':<24}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'other':>8}{'estimate':>10}"
          f"{'measured':>10}{'error':>8}")
    for label, _, e, row in results:
        print(f"{label:<24}" + "".join(f"{gib:>8.3f}" for gib in (e.params_gib, e.grads_gib, e.optimizer_gib,
                                                                   e.activations_gib, e.other_gib))
              + f"{e.measured_part_gib:>10.3f}{row['peak_rss_gib']:>10.3f}{row['est_peak_error']:>+8.1%}")
    print("GiB per rank; measured = peak RSS, max over the 2 ranks; error = measured / estimate - 1")
    print(json.dumps({
        "bench": "estimate_accuracy", "metric": "median |measured / estimated peak - 1|, CPU fp32 trials",
        "value": round(statistics.median(abs(x) for x in mid_errors), 3), "unit": "fraction", "goal": "<= 0.25",
        "errors": {label: round(row["est_peak_error"], 3) for label, _, _, row in results},
        "tiny_trial_peak_rss_gib": round(baseline, 3),
    }))


if __name__ == "__main__":
    main()
