"""Where a one-rank CPU trial's thread loses time inside Ray Train: each thread's CPU, context switches and
migrations, sampled from /proc over a window of the trial, inside Ray Train and outside it.

    .venv/bin/python bench/rank_threads.py [--stack hf] [--variants outside,inside,inside-pinned] [--rounds 1]
        [--steps 1500] [--window-s 10]

The trial is bench/inside_outside.py's (the shipped CPU sweep of the stack, one rank of 1 CPU: a core left for
Ray's own processes). Variants, each run forward then backward per round (A B C C B A):

    inside          `raybench run` of the trial (Ray Train); the rank is the RayTrainWorker process
    inside-pinned   the same, with the rank's busiest thread (the one that trains) pinned to the last CPU and every
                    other thread of every Ray and raybench process to the others, 5 s into the rank
    outside         the same script by hand under torchrun

Per block: for the rank's busiest threads, CPU (cores), voluntary and involuntary context switches per second and
migrations per second over `--window-s`, starting 10 s into the rank; and the trial's step p50 (the whole run).
Prints a line per thread and block, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inside_outside  # noqa: E402

VARIANTS = ("outside", "inside", "inside-pinned")


def thread_counters(pid: int) -> dict[int, dict]:
    """Each thread of `pid`: its name, CPU seconds, voluntary and involuntary switches, migrations."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            stat = Path(f"{base}/stat").read_text()
            status = Path(f"{base}/status").read_text().splitlines()
            sched = Path(f"{base}/sched").read_text().splitlines()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        switches = {line.split(":")[0]: int(line.split()[1]) for line in status if "ctxt_switches" in line}
        migrations = next(int(line.split(":")[1]) for line in sched if line.startswith("se.nr_migrations"))
        out[int(tid)] = {"name": stat[stat.index("(") + 1:stat.rindex(")")],
                         "cpu_s": (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"),
                         "voluntary": switches["voluntary_ctxt_switches"],
                         "involuntary": switches["nonvoluntary_ctxt_switches"], "migrations": migrations}
    return out


def find_rank(marker: str, alive: threading.Thread) -> int:
    while alive.is_alive():
        for proc in psutil.process_iter(["pid", "cmdline"]):
            line = " ".join(proc.info["cmdline"] or [])
            if marker in line and "torch.distributed.run" not in line:
                return proc.pid
        time.sleep(0.3)
    raise RuntimeError(f"no process {marker!r} started")


def pin(rank_pid: int) -> None:
    """The rank's busiest thread on the last CPU; every other thread of Ray's and raybench's processes elsewhere."""
    counters = thread_counters(rank_pid)
    trainer = max(counters, key=lambda tid: counters[tid]["cpu_s"])
    cpus = sorted(os.sched_getaffinity(0))
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if proc.pid == os.getpid() or ("ray" not in line and "raybench" not in line):
            continue
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        except OSError:  # the process ended
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, {cpus[-1]} if tid == trainer else set(cpus[:-1]))
            except OSError:
                pass


def block(variant: str, kind: str, trial, sweep: Path, cache_root: Path, work: Path, window_s: float) -> dict:
    result: dict = {}

    def run() -> None:
        if variant == "outside":
            result.update(inside_outside.run_outside(kind, trial, sweep, cache_root, False, work))
        else:
            store = work / f"store-{time.time_ns()}"
            result.update(inside_outside.run_inside(sweep, store, ["run", str(sweep), "--quiet"]))

    runner = threading.Thread(target=run)
    runner.start()
    rank = find_rank("RayTrainWorker" if variant.startswith("inside") else f"--rank-of {kind}", runner)
    time.sleep(5)
    if variant == "inside-pinned":
        pin(rank)
    time.sleep(5)
    before, t0 = thread_counters(rank), time.monotonic()
    time.sleep(window_s)
    after, elapsed = thread_counters(rank), time.monotonic() - t0
    runner.join()
    threads = []
    for tid, now in after.items():
        then = before.get(tid, now)
        threads.append({"name": now["name"], "cpu": (now["cpu_s"] - then["cpu_s"]) / elapsed,
                        **{f"{k}_per_s": (now[k] - then[k]) / elapsed
                           for k in ("voluntary", "involuntary", "migrations")}})
    threads.sort(key=lambda t: -t["cpu"])
    return {"variant": variant, "step_p50_ms": result["step_p50_s"] * 1e3, "threads": threads[:3],
            "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stack", default="hf", choices=("hf", "lightning", "command"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--window-s", type=float, default=10.0)
    args = parser.parse_args()
    variants = args.variants.split(",")
    work = inside_outside.scratch_dir()
    sweep = inside_outside.pinned_sweep(args.stack, args.steps, 1, work, {})
    trial = inside_outside.planned_trial(sweep)
    cache_root = inside_outside.outside_cache(trial, work)
    blocks = []
    for r in range(args.rounds):
        for variant in [*variants, *reversed(variants)]:
            b = {"round": r, **block(variant, args.stack, trial, sweep, cache_root, work, args.window_s)}
            blocks.append(b)
            for t in b["threads"]:
                print(f"{variant:14s} step p50 {b['step_p50_ms']:6.2f} ms  {t['name']:18s} cpu {t['cpu']:.3f}  "
                      f"vol/s {t['voluntary_per_s']:6.1f}  invol/s {t['involuntary_per_s']:5.1f}  "
                      f"migr/s {t['migrations_per_s']:4.1f}", flush=True)
    print(json.dumps({"bench": "rank_threads", "stack": args.stack, "steps": args.steps, "blocks": blocks}))


if __name__ == "__main__":
    main()
