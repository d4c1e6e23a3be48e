"""The rehearsal against the pre-registered public corpus (bench/public_results.yaml): predicted against published
tokens/s per GPU (and memory where published), per entry, the unseen entries apart from the seen ones.

    .venv/bin/python bench/rehearse_public.py [--only ID ...] [--json-only]
    .venv/bin/python bench/rehearse_public.py --pin "why the pinned figures moved"

Each entry the rehearsal can express becomes a one-trial sweep (`sweep_for`): the preset of its published shape,
its strategy, batch, sequence length, precision, activation checkpointing, compile, optimizer and LoRA, on its GPU
(`GPU_NAMES`) with its nodes' GPUs (`estimate.gpus_per_node`, as `raybench rehearse` takes them; links nominal).
It is planned and rehearsed in this process through `raybench rehearse`'s own path (rehearse/trials.py), in a store
with no calibration profile (so with the shipped constants) and one cache of traces for all entries, so compiled
and eager twins trace once. Nothing is fitted.

Prints one Markdown table (unseen entries, then seen ones), the entries not expressible with why, and JSON lines:
one per entry, then the summary, whose "unseen" part is the score (median and max |step time error|).
A step time error is predicted / published - 1 (a published step time, else the one its tokens/s per GPU
implies): +10% means predicted 10% slow; the tokens/s error is its inverse. A memory error marked "stack differs"
is scored as it is, with what the source's stack holds that raybench's trial does not (the entry's memory.differs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

from raybench.planning.plan import plan
from raybench.rehearse.trials import rehearse_trials
from raybench.spec.load import parse_sweep
from raybench.spec.presets import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parent))
import public_results  # bench/public_results.py

# The corpus's GPU, as raybench's hardware table names it (the corpus says under `assumed:` where they differ).
GPU_NAMES = {"A100 80GB": "A100 80GB", "A100": "A100 80GB", "H200": "H200", "H100": "H100 SXM",
             "H100 96GB HBM2e (2.4 TB/s), 500 W power limit": "H100 HBM2e"}
STRATEGIES = {"single": "ddp", "fsdp": "fsdp2", "hsdp": "fsdp2", "tp": "tp", "fsdp+tp": "tp_fsdp2", "zero3": "deepspeed"}
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size")


def preset_of(model: dict, seq_len: int) -> str:
    """The preset whose shape is the entry's published one, with positions for its sequence length."""
    numbers = tuple(model[k] for k in public_results.MODEL_NUMBERS)
    for name, shape in PRESETS.items():
        if tuple(getattr(shape, k) for k in SHAPE_KEYS) == numbers and shape.max_position_embeddings >= seq_len:
            return name
    raise ValueError(f"no preset has the shape {numbers} of {model['name']}: add it to raybench/spec/presets.py")


def ac_fields(config: dict) -> dict:
    """The corpus's activation checkpointing as raybench's ac_ratio and ac_mode."""
    ac = config.get("ac", "none")
    if ac == "none":
        return {"ac_ratio": "0"}
    if ac == "full":
        return {"ac_ratio": "1"}
    if ac == "selective-op":  # torchtitan's op-level policy: matmuls and attention kept, the rest recomputed
        return {"ac_ratio": "1", "ac_mode": "op"}
    return {"ac_ratio": str(Fraction(1, config["ac_every"]))}  # selective-layer: one block in ac_every


def sweep_for(entry: public_results.PublicEntry) -> dict:
    """The one-trial sweep that rehearses `entry`."""
    c = entry.config
    train = {"strategy": STRATEGIES[c["strategy"]], "seq_len": c["seq_len"], "micro_batch": c["micro_batch"],
             "grad_accum": c.get("grad_accum", 1), "precision": "bf16", "compile": c.get("compile", False),
             "optimizer": c.get("optimizer", "adamw"), "finetune": c["finetune"], "steps": 10, "warmup_steps": 2,
             **ac_fields(c)}
    # The loss as the source's stack computes it (raybench's default chunks it): torchtune's recipes use a chunked
    # output loss (CEWithChunkedOutputLoss); torchtitan, fms-fsdp and KempnerForge take cross-entropy over whole logits.
    train["loss"] = "chunked" if entry.source.get("repo", "").endswith("/torchtune") else "full"
    if c["strategy"] == "zero3":
        train["zero_stage"] = 3
    if c.get("tp", 1) > 1:
        train["tp_size"] = c["tp"]
    if c.get("master_weights", "fp32") != "fp32":
        train["master_weights"] = c["master_weights"]
    if c["precision"] == "fp8-tensorwise":
        train["fp8"] = "tensorwise"
    if c["finetune"] == "lora":
        train["lora"] = {"rank": c["lora"]["rank"], "alpha": c["lora"]["alpha"], "targets": c["lora"]["targets"]}
    return {"name": f"public-{entry.id}", "model": {"preset": preset_of(entry.model, c["seq_len"])}, "train": train,
            "resources": {"workers": entry.gpus, "gpus_per_worker": 1},
            "estimate": {"gpu": GPU_NAMES[entry.gpu], "gpus_per_node": entry.gpus_per_node, "prune": False}}


def predict(entry: public_results.PublicEntry, store: str, traces: dict, estimate: dict | None = None) -> dict:
    """Rehearse the entry's trial as `raybench rehearse` does; its predicted against published figures.
    estimate: fields that replace the sweep's (a what-if, e.g. another fabric: bench/fabric_what_if.py)."""
    sweep = sweep_for(entry)
    sweep["estimate"] |= estimate or {}
    spec = parse_sweep(sweep, source=entry.id)
    (trial,) = plan(spec, store_path=store)
    gpu = spec.estimate.gpu
    t0 = time.perf_counter()
    (rehearsed,) = rehearse_trials(spec, [trial], store, traces=traces)
    result = SimpleNamespace(**rehearsed)
    row = {"id": entry.id, "set": "seen" if entry.seen else "unseen", "gpus": entry.gpus, "gpu": gpu,
           "preset": spec.model.preset, "method": result.method, "seconds": round(time.perf_counter() - t0, 1),
           "published_step_s": round(entry.published_step_s, 3),
           "published_tokens_per_gpu_s": round(entry.published_tokens_per_gpu_s, 1)}
    if result.step_time_s:
        row |= {"predicted_step_s": round(result.step_time_s, 3),
                "predicted_tokens_per_gpu_s": round(entry.tokens_per_gpu_step / result.step_time_s, 1),
                "step_err": round(result.step_time_s / entry.published_step_s - 1, 4),
                "compute_s": round(result.compute_s, 3), "comm_s": round(result.comm_s or 0, 3),
                "exposed_comm_s": round(result.exposed_comm_s or 0, 3)}
    if result.reserved_gib:
        row |= {"predicted_reserved_gib": round(result.reserved_gib, 2),
                "predicted_peak_gib": round(result.peak_gib, 2)}
    if entry.memory:
        row |= {"published_memory_gib": round(entry.published_memory_gib, 2), "memory_measures":
                entry.memory["measures"]}
        predicted = result.reserved_gib if entry.memory["measures"] == "max_reserved" else result.peak_gib
        if entry.memory.get("differs"):  # what the source's stack holds that the trial does not: in the error
            row["memory_differs"] = entry.memory["differs"]
        if entry.memory.get("not_comparable"):
            row["memory_not_comparable"] = entry.memory["not_comparable"]
        elif predicted and result.method == "traced":
            row |= {"predicted_memory_gib": round(predicted, 2),
                    "memory_err": round(predicted / entry.published_memory_gib - 1, 4)}
    if result.method != "traced":
        row["notes"] = result.notes
    return row


def _errors(rows: list[dict], key: str) -> dict:
    """Median and max |error| of one figure over the rows that have it, the worst row, and the counts the goal
    names (step time: within 7% and beyond 20%; memory: within 5% and beyond 15%)."""
    scored = [r for r in rows if key in r]
    if not scored:
        return {"entries": 0}
    errs = [abs(r[key]) for r in scored]
    near, far = (0.07, 0.20) if key == "step_err" else (0.05, 0.15)
    return {"entries": len(errs), "median_abs_err": round(statistics.median(errs), 4),
            "max_abs_err": round(max(errs), 4), "worst": max(scored, key=lambda r: abs(r[key]))["id"],
            f"within_{round(near * 100)}pct": sum(e <= near for e in errs),
            f"beyond_{round(far * 100)}pct": sum(e > far for e in errs)}


# The entries whose predictions are pinned (bench/public_pinned.json; tests/unit/test_public_pinned.py re-predicts
# them in the default suite): eager and compiled FSDP2 under op-level AC, 128 ranks on 16 nodes, TP x FSDP2 on two
# nodes, pure TP, a LoRA 70B, block AC every other layer on A100s, and ZeRO-3 at 70B on 32 GPUs.
PINNED = ("torchtitan-h100-8gpu-llama31-8b-fsdp", "torchtitan-h100-8gpu-llama31-8b-fsdp-compile",
          "torchtitan-h100-128gpu-llama31-8b-fsdp-compile", "kempnerforge-h200-13b-8gpu-fsdp-tp-tp4",
          "kempnerforge-h200-7b-2gpu-tp", "torchtune-a100-8gpu-llama31-70b-lora", "torchtitan-a100-llama2-13b-sel-layer",
          "deepcompile-h100-32gpu-llama3-70b-zero3-mb2-seq1024")
PINNED_FILE = Path(__file__).resolve().parent / "public_pinned.json"
PINNED_FIGURES = ("predicted_step_s", "predicted_peak_gib", "predicted_reserved_gib")


def pinned_figures(rows: list[dict]) -> dict:
    """The figures a pinned entry's prediction must keep, by entry."""
    return {r["id"]: {k: r.get(k) for k in PINNED_FIGURES} for r in rows}


def pin(why: str) -> dict:
    """Re-predict the pinned entries and write their figures to PINNED_FILE, the reason appended to its log."""
    entries = {e.id: e for e in public_results.load()}
    traces: dict = {}
    with tempfile.TemporaryDirectory() as store:
        rows = [predict(entries[i], store, traces) for i in PINNED]
    log = json.loads(PINNED_FILE.read_text())["why"] if PINNED_FILE.exists() else []
    pinned = {"why": [*log, why], "entries": pinned_figures(rows)}
    PINNED_FILE.write_text(json.dumps(pinned, indent=1) + "\n")
    return pinned


def summary(rows: list[dict], which: str) -> dict:
    """Step time and memory side by side over one set (unseen or seen); memory over the entries whose published
    figure raybench can predict (the same quantity of the same configuration), the others counted apart."""
    mine = [r for r in rows if r["set"] == which]
    return {"step": _errors(mine, "step_err"), "memory": _errors(mine, "memory_err"),
            "memory_not_comparable": sum("memory_not_comparable" in r for r in mine),
            "failed": [r["id"] for r in mine if "failed" in r]}


def node_pairs(entries: list, rows: list[dict]) -> list[dict]:
    """Each entry on one node against every entry of the same source, model, GPU, node size and configuration on
    several nodes: the per-GPU tokens/s change from one node to several, published against predicted, and the gap
    in points (the goal: within 10)."""
    by_id = {r["id"]: r for r in rows if "predicted_tokens_per_gpu_s" in r}
    pairs = []
    for one in entries:
        for many in entries:
            same = (one.source.get("path"), one.model, one.gpu, one.gpus_per_node) == (
                many.source.get("path"), many.model, many.gpu, many.gpus_per_node)
            same_config = {k: v for k, v in one.config.items() if k not in ("dp", "global_batch")} == {
                k: v for k, v in many.config.items() if k not in ("dp", "global_batch")}
            if one.nodes == 1 and many.nodes > 1 and same and same_config and {one.id, many.id} <= set(by_id):
                a, b = by_id[one.id], by_id[many.id]
                published = b["published_tokens_per_gpu_s"] / a["published_tokens_per_gpu_s"] - 1
                predicted = b["predicted_tokens_per_gpu_s"] / a["predicted_tokens_per_gpu_s"] - 1
                pairs.append({"one_node": one.id, "nodes": many.nodes, "many_nodes": many.id,
                              "published_change": round(published, 4), "predicted_change": round(predicted, 4),
                              "gap_points": round((predicted - published) * 100, 1)})
    return pairs


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def table(rows: list[dict]) -> str:
    lines = ["| set | entry | GPUs | published tok/s/GPU | predicted | step err | memory measured as | published GiB "
             "| predicted GiB | mem err |", "|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["set"] != "unseen", r["id"])):
        err = "failed" if "failed" in r else _pct(r.get("step_err"))
        mem_err = "not comparable" if "memory_not_comparable" in r else _pct(r.get("memory_err"))
        mem_err += " (stack differs)" if "memory_differs" in r else ""
        lines.append(f"| {r['set']} | {r['id']} | {r['gpus']} | {r['published_tokens_per_gpu_s']:,.0f} | "
                     f"{r.get('predicted_tokens_per_gpu_s', 0):,.0f} | {err} | {r.get('memory_measures', '-')} | "
                     f"{r.get('published_memory_gib', '-')} | {r.get('predicted_memory_gib', '-')} | {mem_err} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="entry ids to rehearse (default: every expressible entry)")
    parser.add_argument("--json-only", action="store_true", help="print the JSON lines only")
    parser.add_argument("--pin", metavar="WHY", help="re-predict the pinned entries (PINNED) and write their figures "
                        "to bench/public_pinned.json with WHY: a line saying why they moved")
    args = parser.parse_args()
    if args.pin:
        print(json.dumps(pin(args.pin)["entries"], indent=1))
        return
    entries = public_results.load()
    chosen = [e for e in entries if not args.only or e.id in args.only]
    rows, traces, t0 = [], {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as store:
        for entry in chosen:
            if entry.not_expressible is None:
                try:
                    rows.append(predict(entry, store, traces))
                except Exception as err:  # one entry that cannot be planned or traced must not stop the others
                    rows.append({"id": entry.id, "set": "seen" if entry.seen else "unseen", "gpus": entry.gpus,
                                 "published_tokens_per_gpu_s": entry.published_tokens_per_gpu_s,
                                 "failed": f"{type(err).__name__}: {err}"[:300]})
                print(json.dumps(rows[-1]), flush=True)
    skipped = [{"id": e.id, "not_expressible": e.not_expressible} for e in chosen if e.not_expressible]
    pairs = node_pairs(chosen, rows)
    for item in skipped + pairs:
        print(json.dumps(item))
    if not args.json_only:
        print(table(rows))
        print("\nOne node against several (tokens/s per GPU, the same configuration):\n\n"
              "| one node | several nodes | nodes | published change | predicted change | gap (points) |\n"
              "|---|---|---:|---:|---:|---:|\n" + "\n".join(
                  f"| {p['one_node']} | {p['many_nodes']} | {p['nodes']} | {_pct(p['published_change'])} | "
                  f"{_pct(p['predicted_change'])} | {p['gap_points']:+.1f} |" for p in pairs))
        print("\nNot expressible:\n" + "\n".join(f"- {s['id']}: {s['not_expressible']}" for s in skipped))
    print(json.dumps({"summary": True, "unseen": summary(rows, "unseen"), "seen": summary(rows, "seen"),
                      "node_pairs": {"pairs": len(pairs), "max_abs_gap_points": max(
                          (abs(p["gap_points"]) for p in pairs), default=None)},
                      "not_expressible": len(skipped), "seconds": round(time.perf_counter() - t0)}))


if __name__ == "__main__":
    main()
