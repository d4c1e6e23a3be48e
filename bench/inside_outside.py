"""The same training script inside raybench and outside it: does a stack's trial time as its script does alone?

    .venv/bin/python bench/inside_outside.py [--stacks command,hf,lightning] [--variants inside,trial,outside]
        [--rounds 2] [--steps 40] [--workers 2] [--micro-batch N] [--seq-len N] [--out DIR]

Per stack, the shipped CPU sweep's first grid point (sweeps/stack-<kind>-cpu.yaml, its axes pinned to their first
value, train.steps raised to --steps so that each median has more steps) on `raybench example-data` data, --workers
gloo ranks of 1 CPU (2, the sweeps' own; 1 leaves a core of a 2-core machine to Ray's own processes), and
--micro-batch / --seq-len in place of the sweep's own (longer steps: is a gap a fixed time per step?):

    A  inside: `raybench run` of that one-trial sweep (a private local Ray, the default executor `train`): the row's
       step_time_p50_s
    B  outside: the same script started by hand under torchrun, with the same arguments (the command stack: the
       trial's filled command line; hf: the trial's SFTConfig keys, spec.stacks.hf.trial_args; lightning: the
       entry's overrides and the Trainer's arguments raybench builds) and the environment raybench gives the
       trial's ranks (OMP_NUM_THREADS=1; train.env, none here)
    T  trial: `raybench trial` of the same sweep's one trial (raybench's whole harness, its hooks, probe and process
       group, under torchrun with no Ray actor): the row's step_time_p50_s. Where A and B differ, T says whether
       the Ray Train actor or the rest of the harness makes the difference
    C  as B with MALLOC_MMAP_THRESHOLD_=131072: what raybench's own loop gets on CPU, and what stack trials got
       before 2026-11-28 (docs/metrics.md)

B and C are timed the same way as A and T: each rank's StepProbe (the command script calls it itself; for hf and
lightning a callback at the hooks raybench's stack modules use), the records reduced by raybench's own
`rank_metrics.combine` (a step lasts as long as its slowest rank), the median over the steps after
train.warmup_steps. Each round runs the variants forward then backward (--variants inside,trial,outside: A T B B T
A), so that a drift of the machine's speed over the round falls on every variant alike. Per round: inside/outside =
mean(A) / mean(B), trial/outside = mean(T) / mean(B), and what the glibc threshold costs = mean(C) / mean(B); the
medians over rounds are the figures. B and C also give each rank's peak RSS (ru_maxrss, the process's whole
life): what the fixed threshold buys. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STACKS = ("command", "hf", "lightning")
VARIANTS = ("inside", "trial", "outside", "outside-mmap")
MMAP_BYTES = "131072"  # glibc's initial threshold, fixed: raybench's own loop's CPU default
MMAP = "MALLOC_MMAP_THRESHOLD_"


# ---- the driver: sweeps, blocks, figures ----

def pinned_sweep(kind: str, steps: int, workers: int, directory: Path, train: dict) -> Path:
    """The shipped CPU sweep of this stack as one trial, written where its relative paths resolve (directory holds
    links to sweeps/stacks and the example data)."""
    spec = yaml.safe_load((REPO / "sweeps" / f"stack-{kind}-cpu.yaml").read_text())
    for field, values in (spec.pop("axes", None) or {}).items():
        section, _, key = field.rpartition(".")
        target = spec
        for part in section.split("."):
            target = target.setdefault(part, {})
        target[key] = values[0]
    spec["train"].update(steps=steps, **train)
    spec.setdefault("resources", {})["workers"] = workers
    spec["name"] = f"inside-outside-{kind}"
    path = directory / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def planned_trial(sweep: Path):
    from raybench import load_sweep, plan

    (trial,) = plan(load_sweep(str(sweep)), source=str(sweep))
    return trial


def run_inside(sweep: Path, store: Path, command: list[str]) -> dict:
    """One `raybench run` (or `raybench trial`) into a fresh store: the row's step p50."""
    from raybench import read_results

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "raybench", *command, "--store", str(store)],
                          env=env, capture_output=True, text=True)
    rows = read_results(str(store)) if store.exists() else None
    if done.returncode != 0 or rows is None or len(rows) != 1 or rows.iloc[0]["status"] != "ok":
        raise RuntimeError(f"inside run of {sweep} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    row = rows.iloc[0]
    return {"step_p50_s": float(row["step_time_p50_s"]), "env_json": row["env_json"]}


def outside_env(trial, mmap: bool) -> dict[str, str]:
    """The environment raybench gives the trial's ranks (its start env and one thread per rank), with the glibc
    threshold fixed or as raybench leaves it."""
    env = {**os.environ, "OMP_NUM_THREADS": str(int(trial.config.resources.cpus_per_worker)),
           **trial.payload.start_env()}
    env.pop("PYTHONPATH", None)
    if mmap:
        env[MMAP] = MMAP_BYTES
    return env


def run_outside(kind: str, trial, sweep: Path, cache_root: Path, mmap: bool, scratch: Path) -> dict:
    """The same script under torchrun by hand; each rank's probe record reduced as raybench reduces a trial's."""
    from raybench.planning.stacks import command as command_stack
    from raybench.runtime import rank_metrics
    from raybench.spec import metrics

    probe_dir = Path(tempfile.mkdtemp(dir=scratch, prefix=f"{kind}-"))
    env = {**outside_env(trial, mmap), "RAYBENCH_PROBE_DIR": str(probe_dir)}
    workers = str(trial.config.resources.workers)
    if kind == "command":
        argv = command_stack.argv(trial.config, sys.executable)
        env["PYTHONPATH"] = str(REPO)  # the command stack puts raybench on the path for the probe
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", workers,
                str(Path(__file__).resolve()), "--rank-of", kind, "--sweep", str(sweep), "--cache-root",
                str(cache_root)]
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *(str(sweep.parent / p) for p in
                                                           trial.config.stack.pythonpath)])
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=sweep.parent)
    records = [json.loads(p.read_text()) for p in sorted(probe_dir.glob("rank-*.json"))]
    if done.returncode != 0 or len(records) != trial.config.resources.workers:
        raise RuntimeError(f"outside run {argv} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    warm = trial.config.train.warmup_steps
    reduced = rank_metrics.combine(records, tp_size=1, warmup_steps=warm)
    return {"step_p50_s": metrics.percentile(reduced.step_times_s[warm:], 50),
            "peak_rss_gib_by_rank": reduced.peak_rss_gib_by_rank}


def run_variant(variant: str, kind: str, trial, sweep: Path, cache_root: Path, work: Path, store: Path) -> dict:
    if variant == "inside":
        return run_inside(sweep, store, ["run", str(sweep), "--quiet"])
    if variant == "trial":
        return run_inside(sweep, store, ["trial", str(sweep), "0"])
    return run_outside(kind, trial, sweep, cache_root, variant == "outside-mmap", work)


def bench_stack(kind: str, variants: list[str], rounds: int, steps: int, workers: int, work: Path,
                train: dict) -> dict:
    sweep = pinned_sweep(kind, steps, workers, work, train)
    trial = planned_trial(sweep)
    cache_root = outside_cache(trial, work)
    blocks = []
    for r in range(rounds):
        for i, variant in enumerate([*variants, *reversed(variants)]):
            result = run_variant(variant, kind, trial, sweep, cache_root, work, work / f"store-{kind}-{r}-{i}")
            blocks.append({"round": r, "variant": variant, **result})
            print(f"  {kind} round {r} {variant:16s} step p50 {result['step_p50_s'] * 1e3:7.1f} ms", flush=True)
    return {"stack": kind, "blocks": blocks, **figures(blocks, variants, rounds)}


def outside_cache(trial, work: Path) -> Path:
    """Where the outside run finds the tokens the inside run trains on (hf data: tokenized there now)."""
    from raybench.data import tokenized

    cache_root = work / "outside-cache"
    if trial.config.data.source == "hf":
        tokenized.prepare(trial.config.data, tokenized.spec_key(trial.config.data, trial.config.model.path)[1],
                          cache_root)
    return cache_root


def scratch_dir() -> Path:
    """A new scratch directory holding `raybench example-data` and a link to sweeps/stacks, as the pinned sweeps'
    relative paths expect."""
    work = Path(tempfile.mkdtemp(prefix="inside-outside-"))
    subprocess.run([sys.executable, "-m", "raybench", "example-data", str(work / "example-data")], check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    (work / "stacks").symlink_to(REPO / "sweeps" / "stacks", target_is_directory=True)
    return work


def figures(blocks: list[dict], variants: list[str], rounds: int) -> dict:
    """Each variant's ratio to the outside run (B), per round and the median over rounds; the outside runs' RSS."""
    def mean_of(r: int, variant: str) -> float:
        return statistics.fmean(b["step_p50_s"] for b in blocks if b["round"] == r and b["variant"] == variant)

    ratios = {v: [mean_of(r, v) / mean_of(r, "outside") for r in range(rounds)] for v in variants if v != "outside"}
    outside = [v for v in ("outside", "outside-mmap") if v in variants]
    rss = {v: [max(b["peak_rss_gib_by_rank"]) for b in blocks if b["variant"] == v] for v in outside}
    spread = {v: [max(b["peak_rss_gib_by_rank"]) - min(b["peak_rss_gib_by_rank"]) for b in blocks
                  if b["variant"] == v] for v in outside}
    return {"to_outside_by_round": ratios, "to_outside": {v: statistics.median(x) for v, x in ratios.items()},
            "step_p50_ms": {v: statistics.median(b["step_p50_s"] * 1e3 for b in blocks if b["variant"] == v)
                            for v in variants},
            "peak_rss_gib_max": {v: max(x) for v, x in rss.items()},
            "rank_rss_spread_gib_max": {v: max(x) for v, x in spread.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stacks", default=",".join(STACKS))
    parser.add_argument("--variants", default="inside,trial,outside",
                        help=f"the blocks of a round, run forward then backward; of {','.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2, help="ranks of 1 CPU per trial")
    parser.add_argument("--micro-batch", type=int, help="train.micro_batch (default: the sweep's)")
    parser.add_argument("--seq-len", type=int, help="train.seq_len (default: the sweep's)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rank-of", choices=("hf", "lightning"), help=argparse.SUPPRESS)  # an outside rank
    parser.add_argument("--sweep", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache-root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        return outside_rank(args.rank_of, args.sweep, args.cache_root)
    variants = args.variants.split(",")
    if "outside" not in variants or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants {args.variants!r}: name some of {','.join(VARIANTS)}, 'outside' among them "
                     "(every figure is a ratio to it)")
    from raybench.runtime.fingerprint import cpu_model

    work = scratch_dir()
    train = {key: value for key, value in (("micro_batch", args.micro_batch), ("seq_len", args.seq_len))
             if value is not None}
    t0 = time.perf_counter()
    results = [bench_stack(kind, variants, args.rounds, args.steps, args.workers, work, train)
               for kind in args.stacks.split(",")]
    print_table(results, variants)
    summary = {"bench": "inside_outside", "cpu": cpu_model(), "python": platform.python_version(),
               "rounds": args.rounds, "steps": args.steps, "workers": args.workers, "train": train,
               "variants": variants,
               "wall_s": round(time.perf_counter() - t0, 1), "stacks": results}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "inside_outside.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "stacks"}
                     | {r["stack"]: r["to_outside"] for r in results}))


def print_table(results: list[dict], variants: list[str]) -> None:
    others = [v for v in variants if v != "outside"]
    print("\n| stack | " + " | ".join(f"{v} p50 ms" for v in variants) + " | "
          + " | ".join(f"{v} / outside (by round)" for v in others) + " |")
    print("|---" * (1 + len(variants) + len(others)) + "|")
    for r in results:
        ms = r["step_p50_ms"]
        ratios = [f"{r['to_outside'][v]:.3f} ({', '.join(f'{x:.3f}' for x in r['to_outside_by_round'][v])})"
                  for v in others]
        print(f"| {r['stack']} | " + " | ".join(f"{ms[v]:.1f}" for v in variants) + " | " + " | ".join(ratios) + " |")
    if "outside-mmap" in variants:
        print("\npeak RSS GiB, outside / outside-mmap (rank spread): " + "; ".join(
            f"{r['stack']} {r['peak_rss_gib_max']['outside']:.3f} / {r['peak_rss_gib_max']['outside-mmap']:.3f} "
            f"({r['rank_rss_spread_gib_max']['outside']:.3f} / {r['rank_rss_spread_gib_max']['outside-mmap']:.3f})"
            for r in results))


# ---- an outside rank: the stack's script as a user starts it, timed by the probe ----

def outside_rank(kind: str, sweep: Path, cache_root: Path) -> None:
    import torch.distributed as dist

    from raybench.runtime.probe import StepProbe

    trial = planned_trial(sweep)
    probe = StepProbe()
    if kind == "hf":
        outside_hf(trial.config, cache_root, probe)
    else:
        outside_lightning(trial.config, probe)
    probe.finish()
    if dist.is_initialized():
        dist.destroy_process_group()


def outside_hf(config, cache_root: Path, probe) -> None:
    """The entry function's SFTTrainer on the trial's SFTConfig keys and tokens, with a callback at the probe's
    hooks (on_train_begin, on_step_end)."""
    import datasets
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed

    from raybench.data import tokenized
    from raybench.spec.stacks import hf as hf_args

    if not dist.is_initialized():  # planning built the SFTConfig once, whose accelerate state made it already
        dist.init_process_group("gloo")
    if dist.get_backend() != "gloo":
        raise RuntimeError(f"the outside ranks use {dist.get_backend()}, raybench's gloo")
    cls = hf_args.args_class()
    args = cls(**hf_args.trial_args(config, set(hf_args.field_types(cls))),
               output_dir=tempfile.mkdtemp(prefix="outside-hf-"), use_cpu=True)
    datasets.disable_caching()  # TRL's own maps go to temporary files, as inside
    ctx = SimpleNamespace(
        args=args,
        load_model=lambda: AutoModelForCausalLM.from_pretrained(
            config.model.path, dtype=torch.float32, attn_implementation=config.model.attn_implementation),
        load_tokenizer=lambda: AutoTokenizer.from_pretrained(config.data.tokenizer or config.model.path),
        tokenized_dataset=lambda: tokenized.dataset(config.data, cache_root))
    set_seed(config.train.seed)
    module, _, function = config.stack.entry.partition(":")
    trainer = getattr(__import__(module), function)(dict(config.stack.overrides), ctx)

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            probe.start()

        def on_step_end(self, args, state, control, **kwargs):
            probe.step(tokens=0)

    trainer.add_callback(Timing())
    trainer.train()


def outside_lightning(config, probe) -> None:
    """The entry function's module and data under a Lightning Trainer of the trial's arguments (Lightning makes the
    process group from torchrun's variables), with a callback at the probe's hooks."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from raybench.runtime.stacks import lightning as stack

    seed_everything(config.train.seed, workers=True, verbose=False)
    module_name, _, name = config.stack.entry.partition(":")
    function = getattr(__import__(module_name), name)
    module, data = function(**stack.user_kwargs(function, config.stack.overrides))
    world = int(os.environ["WORLD_SIZE"])
    rank_ctx = SimpleNamespace(world_size=world, rank=int(os.environ["RANK"]),
                               local_rank=int(os.environ["LOCAL_RANK"]), device=torch.device("cpu"))
    kwargs = stack.trainer_kwargs(SimpleNamespace(config=config), rank_ctx, config.stack.overrides)
    kwargs.pop("plugins")  # raybench's: join its process group; outside, Lightning makes its own

    class Timing(Callback):
        steps = 0

        def on_train_start(self, trainer, pl_module):
            probe.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self.steps:  # an optimizer step ended
                self.steps = trainer.global_step
                probe.step(tokens=0)

    Trainer(**kwargs, callbacks=[Timing()]).fit(module, data)


if __name__ == "__main__":
    main()
