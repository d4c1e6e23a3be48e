"""How long `raybench rehearse` takes on bench/sweeps/grid-1000.yaml, on the whole grid or a slice of it.

    .venv/bin/python bench/rehearse_grid.py                          # all 1,050 points (goal: <= 600 s)
    .venv/bin/python bench/rehearse_grid.py --model qwen2.5-72b --strategy fsdp2 --grad-accum 1 --workers 64 128

As `raybench rehearse` runs: --jobs N worker processes (default: one per CPU this process may use), each given
whole groups of points that share traces, with a trace cache of its own; --jobs 1 is one process with one cache
(how the figures before 2026-11-28's "Every core" section were taken). A temporary store unless --store. Prints one line per point (seconds so far, its axis values, its trace seconds and how its depth was
traced), then one JSON line.

    .venv/bin/python bench/rehearse_grid.py --model llama-2-7b --strategy fsdp2 --grad-accum 1 --workers 64 \
        --ac-ratio 1/4 3/4 --check-depth

--check-depth rehearses each point also with every block traced (`--full-depth`) and prints, per point, how
its extrapolated rehearsal differs from the full trace: the tensor peak and each memory category in bytes, and
the relative difference of FLOPs, step time and every collective's bytes.

    .venv/bin/python bench/rehearse_grid.py --model llama-2-7b --strategy fsdp2 tp_fsdp2 --ac-ratio 0 1/2 \
        --workers 8 16 64 256 --check-world

--check-world rehearses the points in order through one cache, so that FSDP2 and TP x FSDP2 steps are shared
across world sizes (rehearse/worlds.py), and each point whose step was shared also with world sizes never shared
(its own trace): per point, every field that differs (bytes exactly, other numbers beyond 1e-9 relative), the
tensor peak and its bytes off, and the seconds each way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import tempfile
import time
from pathlib import Path

from raybench.planning.plan import plan
from raybench.rehearse.rehearsal import rehearse
from raybench.rehearse.workers import default_jobs, rehearse_sweep
from raybench.spec.load import load_sweep

SWEEP = Path(__file__).resolve().parent / "sweeps" / "grid-1000.yaml"


def selected(trial, args) -> bool:
    values = trial.axis_values
    wanted = {"model.preset": args.model, "train.strategy": args.strategy, "train.grad_accum": args.grad_accum,
              "resources.workers": args.workers, "train.ac_ratio": args.ac_ratio}
    return all(not allowed or values[name] in allowed for name, allowed in wanted.items())


GIB = 2**30


def check_depth(spec, trials: list) -> None:
    """Each point rehearsed as `raybench rehearse` does and with every block traced, and how far apart."""
    extrapolated_cache, full_cache = {}, {}
    for t in trials:
        gpu = spec.estimate.gpu
        t0 = time.perf_counter()
        deep = rehearse(t.config, t.shape, gpu, traces=extrapolated_cache)
        t1 = time.perf_counter()
        full = rehearse(t.config, t.shape, gpu, traces=full_cache, extrapolate_depth=False)
        t2 = time.perf_counter()
        bytes_off = {name: round((deep.memory_gib[name] - gib) * GIB) for name, gib in full.memory_gib.items()}
        relative = {name: abs(getattr(deep, name) / getattr(full, name) - 1) for name in ("flops", "step_time_s")}
        relative["comm_bytes"] = max((abs(deep.comm_bytes.get(k, 0) / v - 1) for k, v in full.comm_bytes.items()),
                                     default=0.0)
        print(json.dumps({"point": t.axis_values, "depth": [n for n in deep.notes if "depth" in n],
                          "peak_gib": round(full.peak_gib, 4), "peak_bytes_off": round((deep.peak_gib - full.peak_gib) * GIB),
                          "category_bytes_off": bytes_off, "relative_off": relative,
                          "extrapolated_s": round(t1 - t0, 1), "full_s": round(t2 - t1, 1)}), flush=True)


def differences(one, other, path: str = "") -> list[str]:
    """Where two rehearsals' fields differ (nested): numbers beyond 1e-9 relative, anything else unequal."""
    if isinstance(one, dict) and isinstance(other, dict):
        if one.keys() != other.keys():
            return [f"{path}: keys differ"]
        return [d for key in one for d in differences(one[key], other[key], f"{path}.{key}")]
    if isinstance(one, (list, tuple)) and isinstance(other, (list, tuple)) and len(one) == len(other):
        return [d for i, (a, b) in enumerate(zip(one, other)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(one, float) and isinstance(other, float):
        return [] if math.isclose(one, other, rel_tol=1e-9, abs_tol=1e-300) else [path]
    return [] if one == other else [path]


def check_world(spec, trials: list) -> None:
    """Each point rehearsed as `raybench rehearse` does (world sizes shared) and, where shared, alone."""
    shared_cache, alone_cache = {}, {}
    for t in trials:
        t0 = time.perf_counter()
        shared = rehearse(t.config, t.shape, spec.estimate.gpu, traces=shared_cache)
        t1 = time.perf_counter()
        world = [n for n in shared.notes if "shared to" in n or "not shared" in n]
        report = {"point": t.axis_values, "world": world, "peak_gib": round(shared.peak_gib, 4),
                  "shared_s": round(t1 - t0, 1)}
        if any("shared to" in n for n in world):
            alone = rehearse(t.config, t.shape, spec.estimate.gpu, traces=alone_cache, share_worlds=False)
            one, other = shared.as_dict(), alone.as_dict()
            for name in ("notes", "trace_s"):
                one.pop(name), other.pop(name)
            report.update(alone_s=round(time.perf_counter() - t1, 1),
                          peak_bytes_off=round((shared.peak_gib - alone.peak_gib) * GIB),
                          fields_off=differences(one, other),
                          notes_off=[n for n in shared.notes if n not in world] != alone.notes)
        print(json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", nargs="*")
    parser.add_argument("--strategy", nargs="*")
    parser.add_argument("--grad-accum", nargs="*", type=int)
    parser.add_argument("--workers", nargs="*", type=int)
    parser.add_argument("--ac-ratio", nargs="*")
    parser.add_argument("--check-depth", action="store_true", help="compare with full traces (see above)")
    parser.add_argument("--check-world", action="store_true", help="compare with world sizes traced alone")
    parser.add_argument("--store", help="keep the rehearsals there (then `raybench best SWEEP --predict --store`)")
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="worker processes (`raybench rehearse "
                        "--jobs`; default: one per CPU this process may use)")
    args = parser.parse_args()
    spec = load_sweep(SWEEP)
    trials = [t for t in plan(spec) if selected(t, args)]
    if args.check_depth:
        check_depth(spec, trials)
        return
    if args.check_world:
        check_world(spec, trials)
        return
    store = args.store or tempfile.mkdtemp()
    t0 = time.perf_counter()
    for row in rehearse_sweep(spec, trials, store, jobs=args.jobs):
        depth = [note for note in row["notes"] if "depth" in note]
        print(f"{time.perf_counter() - t0:8.1f} s  {row['axis_values']}  trace {row['trace_s'] or 0:.1f} s  {depth}",
              flush=True)
    print(json.dumps({"bench": "rehearse_grid", "metric": "seconds to rehearse grid-1000 points",
                      "points": len(trials), "value": round(time.perf_counter() - t0, 1), "goal": "<= 600 s (all)",
                      "cpu_s": round(cpu_seconds(), 1), "jobs": args.jobs, "cpus": os.cpu_count(),
                      "load_avg": os.getloadavg()}))


def cpu_seconds() -> float:
    """CPU seconds (user and system) of this process and of the worker processes it has waited for: the work
    done, whatever the load of other processes left of the wall time."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage,
                                                    (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


if __name__ == "__main__":
    main()
