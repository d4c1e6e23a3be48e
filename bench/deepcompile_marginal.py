"""DeepCompile's published FSDP rows (bench/public_results.yaml, tohtana/bench_deep_compile): the step time each
extra token per GPU adds, between rows of the same sequence length or micro-batch, and the model FLOP rate that
implies (8N per token: forward, backward and the recompute of full checkpointing; N = Llama-3-70B's 70.55e9).
Reads published figures only; predicts nothing.

    .venv/bin/python bench/deepcompile_marginal.py
"""

from __future__ import annotations

from pathlib import Path

import yaml

CORPUS = Path(__file__).with_name("public_results.yaml")
PARAMS = 70.55e9
PAIRS = (((1, 2048), (2, 2048)), ((1, 2048), (4, 1024)), ((2, 1024), (2, 2048)), ((2, 1024), (4, 1024)))


def main() -> None:
    entries = yaml.safe_load(CORPUS.read_text())["entries"]
    rows = {(e["config"]["micro_batch"], e["config"]["seq_len"]): e["published"]["step_time_s"]
            for e in entries if e["id"].startswith("deepcompile-") and e["config"]["strategy"] == "fsdp"}
    for (mb, seq), step_s in sorted(rows.items(), key=lambda kv: kv[0][0] * kv[0][1]):
        print(f"micro-batch {mb} x {seq}: {mb * seq} tokens/GPU, step {step_s:.3f} s")
    for a, b in PAIRS:
        added_s, added_tokens = rows[b] - rows[a], b[0] * b[1] - a[0] * a[1]
        per_token_s = added_s / added_tokens
        print(f"{a} -> {b}: +{added_s:.2f} s for +{added_tokens} tokens: {per_token_s * 1e3:.2f} ms/token, "
              f"{8 * PARAMS / per_token_s / 1e12:.0f} TFLOP/s of model FLOPs")


if __name__ == "__main__":
    main()
