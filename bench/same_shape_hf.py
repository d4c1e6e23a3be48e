"""One training shape through raybench's own loop and through the hf stack (TRL's SFTTrainer), on the same local
weights and the same batch: do the two paths count the same tokens per step and start from the same loss, and
what does the stack's own loop cost?

    .venv/bin/python bench/same_shape_hf.py [--steps 20] [--rounds 2] [--out DIR] [--hf-override KEY=YAML_VALUE ...]

The shape: a tiny Llama (2 layers, hidden 64, tests/conftest.make_model_dir) with LoRA r8, alpha 16, no dropout on
the attention and MLP projections, fp32, DDP over 2 gloo ranks of 1 CPU each, micro-batch 2 x grad-accum 2,
sequences padded to 64 tokens, AdamW (foreach) at a constant lr 1e-3 with clipping at 1.0. The data is a JSONL
file of 256 copies of one 40-word text (40 tokens and the EOS on both paths): every micro-batch of every rank is
the same batch whatever each path's sampler draws, so the first-step losses must agree to fp32 rounding
(LOSS_RTOL). A is raybench's own loop (train.finetune lora, data.packing false: one example per row, padded); B is
the hf stack with sweeps/stacks/hf_sft.py as its entry (PEFT's LoRA in SFTTrainer, pad_to_multiple_of 64, no
activation checkpointing: HF_SAME_SHAPE). Each is a one-trial sweep on a private local Ray (executor train), run
A B B A per round so that drift of the machine falls on both. --hf-override adds SFTConfig keys to B (e.g.
ddp_find_unused_parameters=false). Prints a Markdown table and one JSON line. bench/profile_hf_step.py shows where
the step's time goes on each path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from raybench import read_results  # noqa: E402
from raybench.cli import main as cli  # noqa: E402
from tests.conftest import WORDS, make_model_dir  # noqa: E402

SEQ_LEN = 64
TRAIN = {"warmup_steps": 2, "seq_len": SEQ_LEN, "micro_batch": 2, "grad_accum": 2, "precision": "fp32", "lr": 1e-3}
ORDER = ("raybench", "hf", "hf", "raybench")
RECORDS = 256
# Both first-step losses are the mean cross-entropy of the same 160 predicted tokens per rank, summed in a different
# order (raybench: F.cross_entropy's mean per micro-batch, / grad_accum, summed; TRL: its fused LM head's
# log-probabilities summed over each micro-batch, / the step's token count on all ranks, x world size): fp32
# rounding of such sums stays within a few units in the last place, well under 1e-6 relative.
LOSS_RTOL = 1e-6
# The hf stack's SFTConfig keys that make its trial the shape raybench's loop runs (activation checkpointing is
# train.ac_ratio on both paths: 0, where SFTConfig's own default would checkpoint).
HF_SAME_SHAPE = {"pad_to_multiple_of": SEQ_LEN, "lr_scheduler_type": "constant", "optim": "adamw_torch"}


TEXT_WORDS = 40  # words of the one record text: 40 tokens and the EOS, padded to SEQ_LEN on both paths


def write_inputs(directory: Path) -> tuple[Path, Path]:
    """The model, and RECORDS copies of one text: every micro-batch of every rank is the same batch, whatever
    order each path's sampler draws, so the two paths' first-step losses compare exactly."""
    model = make_model_dir(directory / "model")
    data = directory / "text.jsonl"
    text = " ".join(WORDS[(j * 5) % len(WORDS)] for j in range(TEXT_WORDS))
    data.write_text("\n".join(json.dumps({"text": text}) for _ in range(RECORDS)))
    return model, data


def sweep(kind: str, steps: int, model: Path, data: Path, hf_overrides: dict) -> dict:
    spec = {"name": f"same-shape-{kind}", "model": {"path": str(model)},
            "data": {"source": "hf", "path": str(data), "format": "text", "packing": False},
            "train": {**TRAIN, "steps": steps}, "resources": {"workers": 2, "cpus_per_worker": 1}}
    if kind == "raybench":
        spec["train"].update(finetune="lora", lora={"rank": 8, "alpha": 16, "dropout": 0.0,
                                                    "targets": "attention_mlp"})
    else:
        spec["stack"] = {"kind": "hf", "entry": "hf_sft:build_trainer", "pythonpath": [str(REPO / "sweeps/stacks")],
                         "overrides": {**HF_SAME_SHAPE, **hf_overrides}}
    return spec


def run_once(kind: str, index: int, steps: int, model: Path, data: Path, root: Path, hf_overrides: dict) -> dict:
    path = root / f"{index}-{kind}.yaml"
    path.write_text(yaml.safe_dump(sweep(kind, steps, model, data, hf_overrides)))
    store = root / f"store-{index}"
    code = cli.main(["run", str(path), "--store", str(store)])
    row = read_results(str(store), f"same-shape-{kind}").iloc[0]
    if code != 0 or row.status != "ok":
        raise SystemExit(f"run {index} ({kind}) failed: {row.status} {row.message} {row.error_detail}")
    return {"run": index, "kind": kind, "tokens_per_step": int(row.tokens_per_step),
            "nonpad_tokens_per_step": float(row.nonpad_tokens_per_step), "loss_first": float(row.loss_first),
            "loss_final": float(row.loss_final), "tok_per_s_per_device": float(row.tok_per_s_per_device),
            "step_time_p50_s": float(row.step_time_p50_s), "params_trainable": int(row.params_trainable),
            "stack_version": row.stack_version}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="how many times to run A B B A")
    parser.add_argument("--out", type=Path, default=None, help="keep the sweeps and stores here")
    parser.add_argument("--hf-override", action="append", default=[], metavar="KEY=YAML_VALUE",
                        help="an SFTConfig key for the hf runs, e.g. ddp_find_unused_parameters=false")
    args = parser.parse_args()
    hf_overrides = {key: yaml.safe_load(value) for key, _, value in (o.partition("=") for o in args.hf_override)}
    root = args.out or Path(tempfile.mkdtemp(prefix="same-shape-hf-"))
    root.mkdir(parents=True, exist_ok=True)
    model, data = write_inputs(root)
    rows = []
    for i, kind in enumerate(ORDER * args.rounds):
        load = os.getloadavg()[0]
        rows.append({**run_once(kind, i, args.steps, model, data, root, hf_overrides), "load_1m": load})
    print("| run | path | load 1m | tokens/step | nonpad/step | trainable params | loss first | loss final "
          "| tok/s/device | step p50 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['kind']} | {r['load_1m']:.1f} | {r['tokens_per_step']} | "
              f"{r['nonpad_tokens_per_step']:.0f} | {r['params_trainable']} | {r['loss_first']:.7f} | "
              f"{r['loss_final']:.4f} | {r['tok_per_s_per_device']:.0f} | {r['step_time_p50_s'] * 1e3:.1f} |")
    # Each A B B A quartet gives one ratio (its two hf runs over its two raybench runs): drift within it cancels.
    quartets = [rows[i:i + len(ORDER)] for i in range(0, len(rows), len(ORDER))]
    ratios = [sum(r["tok_per_s_per_device"] for r in q if r["kind"] == "hf")
              / sum(r["tok_per_s_per_device"] for r in q if r["kind"] == "raybench") for q in quartets]
    first = {kind: [r["loss_first"] for r in rows if r["kind"] == kind] for kind in ("raybench", "hf")}
    loss_gap = abs(first["hf"][0] - first["raybench"][0])
    summary = {"tok_per_s_ratio_hf_over_raybench_per_round": ratios,
               "tok_per_s_ratio_hf_over_raybench_median": statistics.median(ratios),
               "tokens_per_step_equal": len({r["tokens_per_step"] for r in rows}) == 1,
               "nonpad_tokens_per_step_equal": len({r["nonpad_tokens_per_step"] for r in rows}) == 1,
               "loss_first_abs_diff": loss_gap,
               "loss_first_equal": loss_gap <= LOSS_RTOL * abs(first["raybench"][0]),
               "loss_first_repeats": all(len(set(v)) == 1 for v in first.values()),
               "hf_overrides": hf_overrides,
               "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                          f"Python {platform.python_version()}", "rows": rows}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
