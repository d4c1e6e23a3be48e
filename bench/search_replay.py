"""How much of a full grid's trial time does each searcher need to get within 3% of the grid's optimum?

    .venv/bin/python bench/search_replay.py --store bench-store/search-replay [--seeds 100]

Phase 1 records the full grid once with the real tool (`raybench run` semantics: embedded Ray, warm pool,
one Parquet row per trial): sAC ratio {0, 1/4, 1/2, 3/4, 1} x micro-batch {1, 2, 4, 8} x strategy {ddp, fsdp2}
on the tiny preset, 2 CPU ranks per trial. Rows already stored in --store are reused, so a second run skips
straight to phase 2.

Phase 2 replays searchers offline against the recorded rows, many seeds each, with the product's own search
code (`raybench.drivers.search.PlannedSearch` and `make_sampler`): a proposed point "costs" its recorded trial time.
Measured per run: the fraction of the whole grid's trial time spent until a trial within --within (3%) of the
grid's best tok/s/device has been evaluated. Searchers: the grid in declared order, the grid in a random order,
search.algo random, search.algo optuna (TPE), optuna with Optuna's default 10 random start-up proposals instead
of raybench's rule, and optuna with early_stop. Prints a table, then one JSON line
whose value is the mean fraction for the default searcher (algo optuna). Goal: <= 0.35.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from collections.abc import Callable, Iterator

from raybench.drivers.api import run_sweep
from raybench.drivers.ray_cluster import ray_cluster
from raybench.planning.plan import PlannedTrial, plan
from raybench.results import store
from raybench.spec.load import parse_sweep
from raybench.spec.sweep_spec import SweepSpec

METRIC = "tok_per_s_per_device"
GRID = {"train.ac_ratio": ["0", "1/4", "1/2", "3/4", "1"], "train.micro_batch": [1, 2, 4, 8],
        "train.strategy": ["ddp", "fsdp2"]}


def grid_spec(steps: int, seq_len: int) -> SweepSpec:
    return parse_sweep({
        "name": "search-replay", "model": {"preset": "tiny"}, "executor": "pool",
        "train": {"steps": steps, "warmup_steps": 3, "seq_len": seq_len, "precision": "fp32", "lr": 1e-3},
        "resources": {"workers": 2, "timeout_s": 600}, "axes": GRID,
    })


def record(spec: SweepSpec, store_path: str) -> dict[str, dict]:
    """Run every grid point not yet stored ok; return trial id -> recorded row."""
    if set(store.ok_trial_ids(store_path, spec.name)) < {t.trial_id for t in plan(spec)}:
        with ray_cluster(None):
            # A throw-away trial first starts the pool's actors, so no grid point's time includes that start-up.
            warm = spec.model_copy(update={"name": "search-replay-warmup", "axes": {}})
            run_sweep(warm, store_path=tempfile.mkdtemp(prefix="raybench-warmup-"), progress=lambda line: None)
            ran = run_sweep(spec, store_path=store_path, progress=lambda line: print(line, flush=True)).ran
        print(f"phase 1: {len(ran)} trial(s) run, the rest reused from {store_path}")
    rows = store.read_results(store_path, spec.name)
    return {r["trial_id"]: r for r in rows.to_dict("records")}


def _in_order(trials: list[PlannedTrial]) -> Iterator[list[PlannedTrial]]:
    for t in trials:
        yield [t]


def replay_order(order: Iterator[list[PlannedTrial]], recorded: dict, target: float) -> tuple[float, int]:
    """(trial seconds spent, trials run) until a trial reaches `target`, walking a fixed order."""
    spent, runs = 0.0, 0
    for trials in order:
        rows = [recorded[t.trial_id] for t in trials]
        spent += sum(r["trial_wall_s"] or 0.0 for r in rows)
        runs += 1
        if all(r["status"] == "ok" for r in rows) and statistics.fmean(r[METRIC] for r in rows) >= target:
            return spent, runs
    return float("nan"), runs


def replay_search(spec: SweepSpec, recorded: dict, target: float, algo: str, seed: int,
                  early_stop: int | None = None, tpe_startup: int | None = None) -> tuple[float, int]:
    """(trial seconds spent, points run) until the searcher evaluated a point reaching `target`; nan if it
    stopped first. Each proposal is answered with the recorded rows of its trials, as a driver would.
    `tpe_startup` replaces the product's TPE start-up rule (for comparison with Optuna's default)."""
    # Imported here: raybench.drivers.search imports ray, which must come after the embedded Ray's auth is chosen.
    import optuna
    from ray.tune.search import Searcher

    from raybench.drivers.search import PlannedSearch, SearchSpace, make_sampler

    space = SearchSpace(spec, plan(spec, keep_invalid=True))
    sampler = make_sampler(algo, seed, len(space.points)) if tpe_startup is None else \
        optuna.samplers.TPESampler(seed=seed, n_startup_trials=tpe_startup)
    searcher = PlannedSearch(space, [(METRIC, "max")], sampler, early_stop=early_stop)
    spent, runs = 0.0, 0
    while True:
        suggestion = searcher.suggest(f"replay-{runs}")
        if suggestion in (None, Searcher.FINISHED):  # nothing runs concurrently here: None cannot happen
            return float("nan"), runs
        rows = [recorded[trial_id] for trial_id in suggestion["trial_ids"]]
        fields = ("trial_id", "status", "message", "trial_wall_s", METRIC)
        searcher.on_trial_complete(f"replay-{runs}", {"rows_json": json.dumps([{k: r[k] for k in fields}
                                                                               for r in rows])})
        spent += sum(r["trial_wall_s"] or 0.0 for r in rows)
        runs += 1
        if all(r["status"] == "ok" for r in rows) and statistics.fmean(r[METRIC] for r in rows) >= target:
            return spent, runs


def print_landscape(rows: list[dict]) -> None:
    """The recorded tok/s/worker and trial seconds of every point: strategy x micro-batch rows, sAC columns."""
    ratios = GRID["train.ac_ratio"]
    cell = {(r["train_strategy"], r["train_micro_batch"], r["train_ac_ratio"]): r for r in rows}
    print(f"\n{'strategy':<9}{'mb':>3}" + "".join(f"{'ac ' + q:>16}" for q in ratios) + "   (tok/s/worker | trial s)")
    for strategy in GRID["train.strategy"]:
        for mb in GRID["train.micro_batch"]:
            cells = [cell[(strategy, mb, q)] for q in ratios]
            print(f"{strategy:<9}{mb:>3}" + "".join(
                f"{(r[METRIC] or 0):>9,.0f} |{r['trial_wall_s']:>4.1f}" for r in cells))


def summarize(name: str, results: list[tuple[float, int]], total_s: float) -> dict:
    reached = [(s, n) for s, n in results if s == s]  # nan: the searcher stopped before reaching the target
    fractions = [s / total_s for s, _ in reached]
    return {
        "searcher": name, "runs": len(results), "reached": len(reached),
        "mean_fraction": statistics.fmean(fractions) if fractions else None,
        "median_fraction": statistics.median(fractions) if fractions else None,
        "p90_fraction": statistics.quantiles(fractions, n=10)[-1] if len(fractions) > 1 else None,
        "mean_trials": statistics.fmean(n for _, n in reached) if reached else None,
        "mean_trials_all": statistics.fmean(n for _, n in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True, help="where the recorded grid is kept (reused when present)")
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--within", type=float, default=0.03, help="relative distance to the optimum (0.03)")
    parser.add_argument("--early-stop", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    spec = grid_spec(args.steps, args.seq_len)
    recorded = record(spec, args.store)
    trials = plan(spec)
    rows = [recorded[t.trial_id] for t in trials]
    best = max(r[METRIC] for r in rows if r["status"] == "ok")
    target = best * (1 - args.within)
    total_s = sum(r["trial_wall_s"] or 0.0 for r in rows)
    near = [r for r in rows if r["status"] == "ok" and r[METRIC] >= target]
    print(f"grid: {len(rows)} trials, {sum(r['status'] == 'ok' for r in rows)} ok, {total_s:.1f} s of trial time; "
          f"best {best:,.0f} tok/s/worker; {len(near)} point(s) within {args.within:.0%}:")
    for r in sorted(near, key=lambda r: -r[METRIC]):
        print(f"  {json.loads(r['axis_values_json'])}  {r[METRIC]:,.0f}")
    print_landscape(rows)

    def seeded(run: Callable[[int], tuple[float, int]]) -> list[tuple[float, int]]:
        return [run(seed) for seed in range(args.seeds)]

    def shuffled(seed: int) -> Iterator[list[PlannedTrial]]:
        order = list(trials)
        random.Random(seed).shuffle(order)
        return _in_order(order)

    results = [
        summarize("grid, declared order", [replay_order(_in_order(trials), recorded, target)], total_s),
        summarize("grid, random order", seeded(lambda s: replay_order(shuffled(s), recorded, target)), total_s),
        summarize("random", seeded(lambda s: replay_search(spec, recorded, target, "random", s)), total_s),
        summarize("optuna (default)", seeded(lambda s: replay_search(spec, recorded, target, "optuna", s)), total_s),
        summarize("optuna, 10 random first", seeded(lambda s: replay_search(spec, recorded, target, "optuna", s,
                                                                              tpe_startup=10)), total_s),
        summarize(f"optuna, early_stop {args.early_stop}",
                  seeded(lambda s: replay_search(spec, recorded, target, "optuna", s, args.early_stop)), total_s),
    ]
    fmt = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\n{'searcher':<24}{'runs':>6}{'reached':>9}{'mean frac':>11}{'median':>9}{'p90':>8}{'trials':>8}")
    for r in results:
        print(f"{r['searcher']:<24}{r['runs']:>6}{r['reached']:>9}{fmt(r['mean_fraction']):>11}"
              f"{fmt(r['median_fraction']):>9}{fmt(r['p90_fraction']):>8}{fmt(r['mean_trials'], '.1f'):>8}")
    default = next(r for r in results if r["searcher"] == "optuna (default)")
    print(json.dumps({
        "bench": "search_replay", "metric": f"fraction of the grid's trial time until within {args.within:.0%} of "
        "the grid optimum (optuna TPE, mean over seeds)", "value": round(default["mean_fraction"], 4),
        "unit": "fraction", "goal": "<= 0.35", "seeds": args.seeds, "grid_trials": len(rows),
        "grid_trial_time_s": round(total_s, 2), "points_within": len(near),
        "searchers": {r["searcher"]: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                      if k != "searcher"} for r in results},
    }))


if __name__ == "__main__":
    main()
