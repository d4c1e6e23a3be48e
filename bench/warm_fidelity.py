"""Warm equals fresh: the same configurations measured by warm pool actors and by fresh processes, interleaved.

    .venv/bin/python bench/warm_fidelity.py [--rounds 3] [--steps 14] [--seq-len 64] [--micro-batch 2] [--store DIR]

Seven configurations of the tiny preset on 2 gloo ranks (a strategy, sAC, compile, LoRA, ZeRO-3, compiled
tensor parallelism and a process-level environment among them). Each round runs every configuration twice, back
to back: once as the next trial of the warm pool (whose actors have run the other configurations before), once
under a fresh `torchrun`. Per
configuration: the median over rounds of tok/s per device warm and fresh, and of each one's training memory (the
peak RSS above the RSS before the build, max over ranks); then warm/fresh ratios. Prints a table, then one JSON
line; value = the median over configurations of warm/fresh tok/s. Goals: within 3% of 1, and every memory ratio
within 5% of 1. A failed trial does not stop the bench: it is printed and listed under its configuration
("failed"), and the medians are over the trials that ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from raybench.drivers import executors
from raybench.drivers.ray_cluster import ray_cluster
from raybench.drivers.trial import run_trial
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep

CONFIGS = {
    "ddp": {"train.strategy": "ddp"},
    "ddp-lora": {"train.finetune": "lora"},
    "fsdp2-sac-half": {"train.strategy": "fsdp2", "train.ac_ratio": "1/2"},
    "fsdp2-compile": {"train.strategy": "fsdp2", "train.compile": True},
    "zero3": {"train.strategy": "deepspeed", "train.zero_stage": 3},
    "tp-compile": {"train.strategy": "tp", "train.tp_size": 2, "train.compile": True},
    "ddp-env": {"train.env": {"OMP_NUM_THREADS": "1", "NCCL_BUFFSIZE": "4194304"}},
}


def payloads(steps: int, seq_len: int, micro_batch: int, names: list[str]) -> dict:
    spec = parse_sweep({"name": "warm-fidelity", "model": {"preset": "tiny"},
                        "train": {"steps": steps, "warmup_steps": 4, "seq_len": seq_len, "micro_batch": micro_batch,
                                  "precision": "fp32"},
                        "resources": {"workers": 2, "timeout_s": 900},
                        "axes": {"setup": [CONFIGS[name] for name in names]}})
    return dict(zip(names, (t.payload for t in plan(spec))))


def training_memory_gib(row: dict) -> float:
    return max(p - b for p, b in zip(row["peak_rss_gib_by_rank"], row["rss_before_build_gib_by_rank"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    parser.add_argument("--store", help="keep the rows in this store (default: a temporary directory)")
    args = parser.parse_args()
    names = args.configs.split(",")
    trials = payloads(args.steps, args.seq_len, args.micro_batch, names)
    rows: dict[tuple[str, str], list[dict]] = {(c, e): [] for c in names for e in ("pool", "torchrun")}
    failed: dict[str, list[str]] = {c: [] for c in names}  # a failed trial is a finding too: kept, not fatal
    with ray_cluster(None), tempfile.TemporaryDirectory(prefix="raybench-fidelity-") as tmp:
        store = args.store or tmp
        for round_index in range(args.rounds):
            for name, payload in trials.items():
                for executor in ("pool", "torchrun"):
                    row = run_trial(payload, "warm-fidelity", store, executor, executors.get(executor))
                    if row["status"] == "ok":
                        rows[(name, executor)].append(row)
                    else:
                        failed[name].append(f"round {round_index + 1}, {executor}: {row['status']}: "
                                            f"{row['message']}"[:300])
    print(f"tiny preset, 2 gloo ranks, {args.steps} steps of {args.micro_batch} x {args.seq_len} tokens, "
          f"{args.rounds} interleaved rounds (medians)")
    print(f"{'configuration':16} {'warm tok/s':>11} {'fresh tok/s':>11} {'ratio':>7} {'warm MiB':>9} {'fresh MiB':>9} "
          f"{'ratio':>7} {'warm trial #':>12}")
    summary = {}
    for name in names:
        warm, fresh = rows[(name, "pool")], rows[(name, "torchrun")]
        for failure in failed[name]:
            print(f"{name:16} failed: {failure}")
        if not warm or not fresh:
            summary[name] = {"failed": failed[name]}
            continue
        tok = [statistics.median(r["tok_per_s_per_device"] for r in runs) for runs in (warm, fresh)]
        mem = [statistics.median(training_memory_gib(r) for r in runs) * 1024 for runs in (warm, fresh)]
        index = statistics.median(r["process_trial_index"] for r in warm)
        summary[name] = {"warm_tok_per_s": tok[0], "fresh_tok_per_s": tok[1], "tok_ratio": tok[0] / tok[1],
                         "warm_training_mib": mem[0], "fresh_training_mib": mem[1], "memory_ratio": mem[0] / mem[1],
                         "loss_final_equal": all(w["loss_final"] == f["loss_final"] for w, f in zip(warm, fresh)),
                         "warm_process_trial_index": index, "failed": failed[name]}
        print(f"{name:16} {tok[0]:11.0f} {tok[1]:11.0f} {tok[0] / tok[1]:7.3f} {mem[0]:9.1f} {mem[1]:9.1f} "
              f"{mem[0] / mem[1]:7.3f} {index:12.0f}")
    ratio = statistics.median(s["tok_ratio"] for s in summary.values() if "tok_ratio" in s)
    print(json.dumps({"bench": "warm_fidelity", "metric": "median over configurations of warm/fresh tok/s per device",
                      "value": ratio, "goal": "within 0.03 of 1; every memory ratio within 0.05 of 1",
                      "rounds": args.rounds, "steps": args.steps, "seq_len": args.seq_len,
                      "micro_batch": args.micro_batch, "configurations": summary}))


if __name__ == "__main__":
    main()
