"""The rehearsal against published results it was not fitted to: seed 000's scaling, seed 001's sAC ratios and
GB200 GPU-hours, and one public torchtitan run. Nothing here fits anything: the constants are the shipped ones
(raybench/rehearse/fitted.py, fitted on the 1B sAC H100 rows of bench/validation_split.yaml).

    .venv/bin/python bench/rehearse_out_of_sample.py

Each case is a sweep rehearsed by `raybench rehearse --json` (and `raybench best --predict --json` for the sAC
choices) in a fresh process and temporary store. Prints one Markdown table per case and one JSON line per case.

Published figures (quoted, with their sources):
- seed 000 (torchtune lora_finetune_distributed, Llama-3.2-1B, LoRA r64, batch 6, seq 2048 packed, one node):
  "about 6-8% for going from 1 to 2 GPUs and 2% or less for going from 2 to 4 GPUs" (A100 and H100).
- seed 001 (IDRIS, FSDP2 + sAC + compile, seq 4096, GBS 128): the sAC ratio per model, H100-80GB on 64 GPUs
  (4 GPUs per node): 14B 1/2, 32B 3/4, 72B 1; GB200 NVL72 on 64 GPUs: 14B 0, 32B 0, 72B 1/2; and GPU-hours on
  32 GB200s (4 sequences each) against 64 (2 each): 14B 148.48 vs 234.88, 32B 429.76 vs 469.12, 72B 1128.6 vs
  1142.4 (the 32-GPU ratios are not published).
- torchtitan docs/performance.md, "Llama 3 performance numbers": Llama 3 8B, FSDP2 on 64 A100 80GB, local batch
  1, selective layer AC: 2,904 tokens/s per GPU (56.8% MFU). The sequence length (8192) and the layer AC's
  frequency (every second block) are torchtitan's llama3_8b config of that time, not stated on the page.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

SEED000 = {
    "name": "seed000-scaling", "model": {"preset": "llama-3.2-1b"},
    "train": {"strategy": "fsdp2", "steps": 10, "warmup_steps": 2, "seq_len": 2048, "micro_batch": 6,
              "precision": "bf16", "finetune": "lora",
              "lora": {"rank": 64, "alpha": 128, "dropout": 0.0, "targets": "attention_mlp"}, "ac_ratio": "1"},
    "resources": {"gpus_per_worker": 1}, "axes": {"resources.workers": [1, 2, 4]},
}
SEED000_PUBLISHED = {"1->2": (0.06, 0.08), "2->4": (0.0, 0.02)}

SEED001_H100_RATIOS = {"qwen2.5-14b": "1/2", "qwen2.5-32b": "3/4", "qwen2.5-72b": "1"}
SEED001_GB200_RATIOS = {"qwen2.5-14b": "0", "qwen2.5-32b": "0", "qwen2.5-72b": "1/2"}
SEED001_GB200_GPU_HOURS = {"qwen2.5-14b": (148.48, 234.88), "qwen2.5-32b": (429.76, 469.12),
                           "qwen2.5-72b": (1128.6, 1142.4)}  # (32 GPUs, 64 GPUs)

TORCHTITAN_8B = {
    "name": "torchtitan-llama3-8b-a100", "model": {"preset": "llama-3-8b"},
    "train": {"strategy": "fsdp2", "steps": 10, "warmup_steps": 2, "seq_len": 8192, "micro_batch": 1,
              "precision": "bf16", "finetune": "full", "ac_ratio": "1/2"},
    "resources": {"workers": 64, "gpus_per_worker": 1}, "estimate": {"gpu": "A100 80GB"},
}
TORCHTITAN_8B_PUBLISHED_TOKS = 2904


def raybench(*args: str) -> list[dict]:
    """`python -m raybench ARGS --json`: one JSON object per line."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "raybench", *args, "--json"], capture_output=True, text=True,
                          env=env, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def rehearse(sweep: Path, store: str, *flags: str) -> list[dict]:
    return raybench("rehearse", str(sweep), "--store", store, *flags)


def tokens_per_gpu_s(row: dict, micro_batch: int, seq_len: int) -> float:
    return micro_batch * seq_len / row["step_time_s"]


def seed000(tmp: Path) -> list[dict]:
    """Per GPU type: predicted tokens/s per GPU at 1, 2 and 4 GPUs and the scaling losses."""
    sweep = tmp / "seed000.yaml"
    sweep.write_text(yaml.safe_dump(SEED000))
    out = []
    for gpu in ("A100 80GB", "H100 SXM"):
        with tempfile.TemporaryDirectory() as store:
            rows = {r["world_size"]: r for r in rehearse(sweep, store, "--gpu", gpu)}
        toks = {n: tokens_per_gpu_s(rows[n], 6, 2048) for n in (1, 2, 4)}
        losses = {"1->2": 1 - toks[2] / toks[1], "2->4": 1 - toks[4] / toks[2]}
        out.append({"case": "seed000", "gpu": gpu, "tokens_per_gpu_s": {n: round(v) for n, v in toks.items()},
                    "loss": {k: round(v, 4) for k, v in losses.items()}, "published": SEED000_PUBLISHED,
                    "exposed_comm_s": {n: rows[n]["exposed_comm_s"] for n in (1, 2, 4)},
                    "step_s": {n: rows[n]["step_time_s"] for n in (1, 2, 4)}})
    return out


def chosen(sweep: Path, store: str, *flags: str) -> list[dict]:
    """`raybench best SWEEP --predict`'s groups: {"model", "workers", "compile", "ratio"} of each choice (ratio None
    where no ratio is predicted to fit)."""
    picks = []
    for row in raybench("best", str(sweep), "--predict", "--store", store, *flags):
        group = row["group"]
        picks.append({"model": group.get("model.preset"), "workers": group.get("resources.workers"),
                      "compile": group.get("train.compile"), "ratio": row["best"]["value"] if row["best"] else None})
    return picks


def seed001() -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as store:
        sweep = REPO / "sweeps" / "seed001-idris-sac.yaml"
        rehearse(sweep, store, "--gpu", "H100 SXM")
        for pick in chosen(sweep, store, "--gpu", "H100 SXM"):
            out.append({"case": "seed001 H100, 64 GPUs", **pick, "published": SEED001_H100_RATIOS[pick["model"]]})
    with tempfile.TemporaryDirectory() as store:
        sweep = REPO / "sweeps" / "seed001-gb200.yaml"
        step_s = {(r["axis_values"]["model.preset"], r["world_size"], r["axis_values"]["train.ac_ratio"]):
                  r["step_time_s"] for r in rehearse(sweep, store)}
        picks = chosen(sweep, store)
        for pick in picks:
            published = SEED001_GB200_RATIOS[pick["model"]] if str(pick["workers"]) == "64" else None
            out.append({"case": "seed001 GB200", **pick, "published": published})
        for model, (hours_32, hours_64) in SEED001_GB200_GPU_HOURS.items():
            ratio = {str(p["workers"]): p["ratio"] for p in picks if p["model"] == model}
            if None in ratio.values():
                continue
            # GBS 128 on both scales: the same steps, so GPU-hours go as GPUs x step time.
            hours = {n: int(n) * step_s[(model, int(n), ratio[n])] for n in ("32", "64")}
            out.append({"case": "seed001 GB200 GPU-hours, 32 against 64 GPUs", "model": model, "ratios": ratio,
                        "predicted": round(hours["32"] / hours["64"], 3), "published": round(hours_32 / hours_64, 3)})
    return out


def torchtitan_8b(tmp: Path) -> dict:
    sweep = tmp / "torchtitan.yaml"
    sweep.write_text(yaml.safe_dump(TORCHTITAN_8B))
    with tempfile.TemporaryDirectory() as store:
        (row,) = rehearse(sweep, store)
    toks = tokens_per_gpu_s(row, 1, 8192)
    return {"case": "torchtitan Llama 3 8B, 64 A100", "predicted_tokens_per_gpu_s": round(toks),
            "published": TORCHTITAN_8B_PUBLISHED_TOKS, "error": round(toks / TORCHTITAN_8B_PUBLISHED_TOKS - 1, 4),
            "step_s": row["step_time_s"], "exposed_comm_s": row["exposed_comm_s"], "peak_gib": row["peak_gib"]}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = [*seed000(Path(tmp)), *seed001(), torchtitan_8b(Path(tmp))]
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
