"""Build plus wrap of a model under FSDP2 on N CPU ranks: today's whole build against the sharded build, and
two ways of reading real weights, in one run with the candidates interleaved round by round.

    .venv/bin/python bench/sharded_build.py [--preset llama-3.2-1b] [--ranks 4] [--rounds 2] [--skip whole_hf]

Candidates (each a fresh `torchrun` of N gloo ranks; LoRA as in the issue's proof trial):
- whole_hf:       the build before sharded builds: every rank initialises the whole model (Hugging Face init on
                  the CPU), applies LoRA, then fully_shard keeps its shards;
- sharded_random: raybench's build: meta model, LoRA, fully_shard, then each rank draws only its shards;
- dir_slices:     the same from a safetensors directory: torch.distributed.checkpoint's Hugging Face reader,
                  each rank reading only its own slices (what raybench does);
- dir_rank0:      the same directory read whole by rank 0 and broadcast (set_model_state_dict with
                  full_state_dict and broadcast_from_rank0), the alternative the design considered.
Per candidate: build+wrap seconds (slowest rank), each rank's peak RSS above its RSS before the build, and their
sum over the node. Prints a table, then one JSON line; value = sharded_random / whole_hf build+wrap time (null
when whole_hf is skipped: on a 24 GiB machine 4 ranks of the whole 1B build are killed for memory).
Goal: <= 1 (the sharded build is no slower than the whole one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CANDIDATES = ("whole_hf", "sharded_random", "dir_slices", "dir_rank0")


def _peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM")


def child(candidate: str, preset: str, weights_dir: str, out: str) -> None:
    """One candidate on this rank (under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from raybench.runtime.build import build_meta, fill
    from raybench.runtime.strategies import RankContext, fsdp2
    from raybench.runtime.techniques import lora
    from raybench.spec.presets import PRESETS
    from raybench.spec.sweep_spec import ModelSpec, TrainSpec

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, cpu = dist.get_rank(), torch.device("cpu")
    ctx = RankContext(rank, dist.get_world_size(), 0, cpu)
    train = TrainSpec(strategy="fsdp2", finetune="lora", precision="fp32")
    spec = ModelSpec(preset=preset) if candidate in ("whole_hf", "sharded_random") else ModelSpec(path=weights_dir)
    Path("/proc/self/clear_refs").write_text("5")
    before = _peak_rss_gib()
    dist.barrier()
    t0 = time.perf_counter()
    if candidate == "whole_hf":
        torch.manual_seed(0)
        shape = PRESETS[preset]
        config = AutoConfig.for_model(shape.model_type, **shape.hf_config_kwargs(), use_cache=False)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = lora.apply(model, train)
        fsdp2.setup(model, train, ctx)
    else:
        model, source, info = build_meta(spec, seed=0)
        model = lora.apply(model, train)
        if candidate == "dir_rank0":
            def materialize(whole: bool) -> None:
                from safetensors.torch import load_file

                model.to_empty(device=cpu)
                state = {}
                if rank == 0:
                    for file in sorted(Path(weights_dir).glob("*.safetensors")):
                        state.update(load_file(file))
                    state = {f"base_model.model.{k}".replace("_proj.weight", "_proj.base_layer.weight"): v
                             for k, v in state.items()}
                set_model_state_dict(model, state, options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=True, strict=False))
        else:
            def materialize(whole: bool) -> None:
                fill(model, cpu, source, info, whole)
        fsdp2.setup(model, train, ctx, materialize)
    dist.barrier()
    seconds = time.perf_counter() - t0
    growth = [None] * ctx.world_size
    dist.all_gather_object(growth, _peak_rss_gib() - before)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "growth_gib": growth}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as raybench's worker does: gloo's threads can abort an orderly interpreter shutdown


def run(candidate: str, preset: str, ranks: int, weights_dir: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={ranks}", __file__, "--child", candidate, "--preset", preset,
                               "--weights-dir", weights_dir, "--out", out.name], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{candidate} failed:\n{done.stderr[-4000:]}")
        return json.loads(Path(out.name).read_text())


def save_weights(preset: str, directory: Path) -> None:
    import torch

    from raybench.runtime.build import build_model
    from raybench.spec.sweep_spec import ModelSpec

    model, _ = build_model(ModelSpec(preset=preset), torch.device("cpu"), seed=0)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="500MB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=CANDIDATES, help="candidates not to run")
    parser.add_argument("--child")
    parser.add_argument("--weights-dir", default="")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.preset, args.weights_dir, args.out)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="raybench-weights-") as weights_dir:
        save_weights(args.preset, Path(weights_dir))
        results: dict[str, list[dict]] = {c: [] for c in CANDIDATES if c not in args.skip}
        for _ in range(args.rounds):
            for candidate in results:
                results[candidate].append(run(candidate, args.preset, args.ranks, weights_dir))
    print(f"{args.preset}, fsdp2 + LoRA, {args.ranks} gloo ranks, {args.rounds} rounds (median)")
    print(f"{'candidate':16} {'build+wrap s':>12} {'max rank GiB':>12} {'node sum GiB':>12}")
    summary = {}
    for candidate, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        rank_max = statistics.median(max(r["growth_gib"]) for r in runs)
        node = statistics.median(sum(r["growth_gib"]) for r in runs)
        summary[candidate] = {"build_wrap_s": seconds, "max_rank_growth_gib": rank_max, "node_growth_gib": node}
        print(f"{candidate:16} {seconds:12.2f} {rank_max:12.2f} {node:12.2f}")
    ratio = (summary["sharded_random"]["build_wrap_s"] / summary["whole_hf"]["build_wrap_s"]
             if "whole_hf" in summary else None)
    print(json.dumps({"bench": "sharded_build", "metric": "sharded_random / whole_hf build+wrap time",
                      "value": ratio, "goal": "<= 1", "preset": args.preset, "ranks": args.ranks,
                      "rounds": args.rounds, "candidates": summary}))


if __name__ == "__main__":
    main()
