"""Search a sweep's grid instead of running all of it: Ray Tune asks a searcher for each next point.

The space is the grid of `axes`, one dimension per axis holding the *index* of a value (axis values may be
mappings, which no searcher can sample). Axes whose values are all numbers (micro-batch, sAC ratio) are
ordered, so Optuna's TPE can learn that neighbouring values behave alike; other axes are categorical.

`PlannedSearch` asks an Optuna study (TPE, or Optuna's RandomSampler for algo random) for each next point and
decides what it costs:
- an excluded point, an invalid combination, or a point the memory estimate skips (each stored once as an
  `invalid`/`skipped` row) is told to the searcher as infeasible at once, without running;
- a point whose trials are already stored ok (or oom: it does not fit) is answered from the store (resume
  and data reuse: a re-run search replays the same proposals and adds no duplicate rows); it counts toward
  `num_samples`;
- a point evaluated earlier in this search is told its known outcome again (Optuna's own advice for a
  repeated proposal on a finite space) and the searcher is asked again;
- any other point runs as one Tune trial (all its repeats); an OOM, error or timeout is told as infeasible.
Infeasible means an Optuna constraint value > 0: TPE ranks such points below every feasible one, so it
learns to avoid the region instead of forgetting the point (a FAILED trial would be ignored).
The search ends at `num_samples` distinct points, after `early_stop` points in a row without improvement,
when every point is known, or when the searcher keeps proposing known points (it has converged).

It speaks Ray Tune's searcher protocol (suggest / on_trial_complete / FINISHED) without importing Ray: the sweep
driver (`raybench.drivers.sweep`) hands it to Tune, and the replay benchmark drives it without Tune.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import optuna
import pyarrow as pa

from raybench.planning.plan import PlannedTrial
from raybench.spec.axes import axis_assignments, excluded
from raybench.spec.stats import dominates
from raybench.spec.sweep_spec import SweepSpec

Point = tuple[int, ...]  # one value index per axis, in the sweep's axis order
STATUS_EXCLUDED = "excluded"  # a point the sweep's `exclude:` drops: no trial, no row
ANSWERED = ("ok", "oom")  # stored statuses a search reuses instead of running the trial again
FINISHED = "FINISHED"  # suggest()'s answer when the search is over (the value Ray Tune's searchers use)


def _number(value: Any) -> Fraction | None:
    """An axis value as an exact number (2, 0.5, "3/4"), or None if it is not one. Never evaluates text."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return Fraction(str(value))
    if isinstance(value, str):
        try:
            return Fraction(value.strip())
        except (ValueError, ZeroDivisionError):
            return None
    return None


@dataclass(frozen=True)
class Axis:
    key: str
    values: list
    order: tuple[int, ...] | None  # value indices sorted by value for a numeric axis; None: unordered

    def distribution(self) -> optuna.distributions.BaseDistribution:
        if self.order is not None:
            return optuna.distributions.IntDistribution(0, len(self.values) - 1)
        return optuna.distributions.CategoricalDistribution(tuple(range(len(self.values))))

    def index(self, param: int) -> int:
        """The value index a sampled parameter stands for (a rank on ordered axes)."""
        return self.order[param] if self.order is not None else param


def _axis(key: str, values: list) -> Axis:
    numbers = [_number(v) for v in values]
    order = None if None in numbers else tuple(sorted(range(len(values)), key=lambda i: numbers[i]))
    return Axis(key, list(values), order)


class SearchSpace:
    """The grid of a sweep's axes; each non-excluded point maps to its planned trials (one per repeat)."""

    def __init__(self, spec: SweepSpec, trials: list[PlannedTrial]):
        """`trials` is plan(spec, keep_invalid=True): every non-excluded point, invalid ones included."""
        self.axes = [_axis(key, values) for key, values in spec.axes.items()]
        self.points: dict[Point, list[PlannedTrial]] = {}
        self.excluded: set[Point] = set()
        remaining = iter(trials)
        # plan() expands the same product in the same order (first axis slowest), `repeats` trials per point.
        for point in itertools.product(*(range(len(a.values)) for a in self.axes)):
            values = {a.key: a.values[i] for a, i in zip(self.axes, point)}
            if excluded(values, spec.exclude):
                self.excluded.add(point)
                continue
            repeats = [next(remaining) for _ in range(spec.repeats)]
            expected = {path: leaf for key, value in values.items()
                        for path, leaf in axis_assignments(key, value).items()}
            if repeats[0].axis_values != expected:
                raise RuntimeError(f"search space and plan disagree at {expected} vs {repeats[0].axis_values}")
            self.points[point] = repeats

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        return {a.key: a.distribution() for a in self.axes}

    def point(self, params: dict) -> Point:
        return tuple(a.index(params[a.key]) for a in self.axes)

    def label(self, point: Point) -> str:
        return " ".join(f"{a.key.split('.')[-1]}={a.values[i]}" for a, i in zip(self.axes, point))


@dataclass(frozen=True)
class Outcome:
    """What the searcher was told about one point."""

    status: str  # ok | oom | error | timeout | invalid | skipped | excluded
    values: tuple[float, ...] | None  # objective values (means over repeats); None: infeasible
    cost_s: float = 0.0  # trial time this search spent on it (0 when answered without running)
    source: str = "run"  # run | store (stored rows) | plan (invalid, skipped or excluded: never runs)
    message: str = ""

    @property
    def feasible(self) -> bool:
        return self.values is not None


def outcome_from_rows(rows: list[dict], metrics: list[str], source: str = "run") -> Outcome:
    """A point's outcome from its trials' rows: feasible when every row is ok and has every metric."""
    cost_s = sum(r.get("trial_wall_s") or 0.0 for r in rows) if source == "run" else 0.0
    failed = next((r for r in rows if r["status"] != "ok"), None)
    if failed is not None:
        return Outcome(failed["status"], None, cost_s, source, failed.get("message") or "")
    values = []
    for metric in metrics:
        found = [r.get(metric) for r in rows]
        if any(v is None or math.isnan(v) for v in found):
            return Outcome("ok", None, cost_s, source, f"no value for {metric} in its rows: it cannot be ranked")
        values.append(sum(found) / len(found))
    return Outcome("ok", tuple(values), cost_s, source)


def make_sampler(algo: str, seed: int, points: int) -> optuna.samplers.BaseSampler:
    """The Optuna sampler behind a search algo over a grid of `points` points (the replay benchmark uses it too).

    TPE starts with random proposals before it models anything. Optuna's default of 10 is sized for continuous
    spaces; on a 40-point grid it spends a quarter of the grid at random. raybench uses a tenth of the grid,
    3 to 10 (docs/results/search-replay-2026-11-22.md compares both on recorded grids).
    """
    if algo == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(3, points // 10)))


class PlannedSearch:
    """A searcher over a SearchSpace; see the module docstring for how each proposal is handled.

    Call suggest(id), run the trials config["trial_ids"] names, then on_trial_complete(id, {"rows_json": ...}); Ray
    Tune does this through the sweep driver's adapter (whose trial drivers hold every runnable trial's payload).
    """

    def __init__(self, space: SearchSpace, objectives: list[tuple[str, str]], sampler: optuna.samplers.BaseSampler,
                 *, num_samples: int | None = None, early_stop: int | None = None,
                 stored: dict[str, dict] | None = None,
                 record_unrun: Callable[[list[PlannedTrial]], None] = lambda trials: None,
                 log: Callable[[str], None] = lambda line: None):
        """`stored`: trial id -> its stored row (ok, oom, invalid or skipped) from earlier runs of this sweep;
        `record_unrun` stores the rows of points that are not run (invalid, or skipped by the memory estimate)."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # one INFO line per told point otherwise
        self.space = space
        self.metrics = [m for m, _ in objectives]
        self.modes = [mode for _, mode in objectives]
        self.study = optuna.create_study(sampler=sampler, directions=[
            "minimize" if mode == "min" else "maximize" for mode in self.modes])
        self._asked: dict[str, optuna.trial.Trial] = {}  # ask id -> the Optuna trial it proposed
        self.num_samples = num_samples
        self.early_stop = early_stop
        self._stored = stored or {}
        self._record_unrun = record_unrun
        self._log = log
        # This many proposals in a row of points already known means the searcher has converged.
        self._max_stale_asks = max(64, 4 * len(space.points))
        self._stale = False  # the last suggest() gave up on stale proposals while trials were running
        self._asks = 0
        self._runnable = sum(1 for trials in space.points.values() if trials[0].status == "planned")
        self.outcomes: dict[Point, Outcome] = {}  # every point resolved so far (invalid and excluded included)
        self.history: list[tuple[Point, Outcome]] = []  # first resolution of each point, in order
        self.dispatched: list[PlannedTrial] = []  # trials handed to Tune to run
        self._pending: dict[str, tuple[Point, str]] = {}  # Tune trial id -> (point, ask id)
        self._waiting: dict[Point, list[str]] = {}  # asks that proposed a running point: told when it ends
        self._counted = 0  # points run or answered from the store (num_samples counts these)
        self._since_improvement = 0
        self.stop_reason: str | None = None

    # ---- the searcher protocol (Ray Tune's) ----

    def suggest(self, trial_id: str) -> dict | str | None:
        """The next point to run as {"trial_ids": [...], "point": label}; None to wait for running trials;
        FINISHED when done."""
        if self._stale:
            return None  # proposals only repeated known points: wait until a running trial tells something new
        stale_asks = 0
        while not self._done():
            if stale_asks >= self._max_stale_asks:
                if self._pending:
                    self._stale = True
                    return None
                self.stop_reason = f"converged: {stale_asks} proposals in a row were points already evaluated"
                break
            ask = self._ask_id()
            self._asked[ask] = self.study.ask(self.space.distributions())
            point = self.space.point(self._asked[ask].params)
            stale_asks += 1
            if any(p == point for p, _ in self._pending.values()):
                self._waiting.setdefault(point, []).append(ask)
            elif point in self.outcomes:
                self._tell(ask, self.outcomes[point])
            elif point in self.space.excluded:
                # Not a trial (the user dropped it), but the searcher must learn that it is no candidate.
                self._tell(ask, Outcome(STATUS_EXCLUDED, None, source="plan", message="excluded by the sweep"))
            else:
                stale_asks = 0
                to_run = self._resolve_without_running(point, ask)
                if to_run:
                    self._pending[trial_id] = (point, ask)
                    self.dispatched += to_run
                    return {"trial_ids": [t.trial_id for t in to_run],
                            "point": self.space.label(point)}
        return None if self._pending else FINISHED

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        point, ask = self._pending.pop(trial_id)
        trials = self.space.points[point]
        rows = json.loads((result or {}).get("rows_json") or "[]")
        ran = {r["trial_id"] for r in rows}
        # Repeats answered before this run count with the new ones; a repeat with no row died with its driver.
        rows += [self._stored[t.trial_id] for t in trials if t.trial_id not in ran and self._is_answered(t.trial_id)]
        if len(rows) < len(trials):
            rows.append({"status": "error", "message": "trial driver died before reporting a row"})
        outcome = outcome_from_rows(rows, self.metrics)
        self._stale = False
        self._resolve(point, outcome, ask)
        for waiting in self._waiting.pop(point, []):
            self._tell(waiting, outcome)

    def __getstate__(self) -> dict:
        # Tune pickles its search algorithm into its experiment state, which raybench never restores (see save());
        # the callbacks (a progress view, the store writer) belong to this process.
        return {**self.__dict__, "_log": None, "_record_unrun": None}

    # ---- results ----

    @property
    def budget(self) -> int:
        """At most this many points are run or answered from the store."""
        return min(self.num_samples or self._runnable, self._runnable)

    def best(self) -> list[tuple[Point, Outcome]]:
        """The feasible points no other feasible point dominates (single objective: the best one(s))."""
        feasible = [(p, o) for p, o in self.history if o.feasible]
        return [(p, o) for p, o in feasible
                if not any(dominates(other.values, o.values, self.modes) for _, other in feasible)]

    def summary(self) -> str:
        resolved = [o for _, o in self.history]
        ran = sum(o.source == "run" for o in resolved)
        reused = sum(o.source == "store" for o in resolved)
        infeasible = [o.status for o in resolved if not o.feasible]
        kinds = ", ".join(f"{infeasible.count(s)} {s}" for s in dict.fromkeys(infeasible)) or "none"
        return (f"search: {ran} point(s) run, {reused} answered from the store, infeasible: {kinds}; "
                f"stopped: {self.stop_reason or 'budget reached'}")

    # ---- internals ----

    def _ask_id(self) -> str:
        self._asks += 1
        return f"ask-{self._asks}"

    def _is_answered(self, trial_id: str) -> bool:
        """Stored as a measurement: ok, or oom (it does not fit). Errors and timeouts are tried again."""
        return self._stored.get(trial_id, {}).get("status") in ANSWERED

    def _done(self) -> bool:
        """No new point may start: stopped, num_samples spent, or every point resolved or running.
        Sets stop_reason once nothing is running any more."""
        if self.stop_reason:
            return True
        spent = self._counted + len(self._pending) >= self.budget
        all_known = len(self.outcomes) + len(self._pending) >= len(self.space.points)
        if not (spent or all_known):
            return False
        if not self._pending:
            sampled = self.num_samples is not None and self._counted >= self.num_samples
            self.stop_reason = (f"num_samples ({self.num_samples}) reached" if sampled
                                else "every runnable grid point evaluated")
        return True

    def _resolve_without_running(self, point: Point, ask: str) -> list[PlannedTrial]:
        """Answer `point` from the store or the plan if possible; else return the trials that must run."""
        trials = self.space.points[point]
        missing = [t for t in trials if not self._is_answered(t.trial_id)]
        if not missing:  # measured before (a measurement outranks the plan's memory estimate)
            self._resolve(point, outcome_from_rows([self._stored[t.trial_id] for t in trials], self.metrics,
                                                   source="store"), ask)
            return []
        status = trials[0].status
        if status != "planned":  # invalid, or skipped: estimated not to fit in device memory
            fresh = [t for t in trials if self._stored.get(t.trial_id, {}).get("status") != status]
            self._record_unrun(fresh)  # its row, once: a resumed search does not write it again
            self._resolve(point, Outcome(status, None, source="plan", message="; ".join(trials[0].reasons)), ask)
            return []
        return missing

    def _resolve(self, point: Point, outcome: Outcome, ask: str) -> None:
        """Record a point's first outcome, tell the searcher, and update the stopping rules."""
        self.outcomes[point] = outcome
        self.history.append((point, outcome))
        if outcome.source != "plan":
            self._counted += 1
            self._note_improvement(outcome)
        self._tell(ask, outcome)
        what = ", ".join(f"{m}={v:,.4g}" for m, v in zip(self.metrics, outcome.values)) if outcome.feasible else \
            f"{outcome.status} ({outcome.message[:300]}); told the searcher: infeasible"
        source = {"store": " (answered from the store)", "plan": " (not run)"}.get(outcome.source, "")
        self._log(f"search: {self.space.label(point)}{source}: {what}")

    def _note_improvement(self, outcome: Outcome) -> None:
        earlier = [o.values for _, o in self.history[:-1] if o.feasible]
        improved = outcome.feasible and not any(
            e == outcome.values or dominates(e, outcome.values, self.modes) for e in earlier)
        self._since_improvement = 0 if improved else self._since_improvement + 1
        if self.early_stop and self._since_improvement >= self.early_stop:
            self.stop_reason = f"early stop: {self.early_stop} evaluated point(s) in a row without improvement"

    def _tell(self, ask: str, outcome: Outcome) -> None:
        trial = self._asked.pop(ask)
        if outcome.feasible:
            values = list(outcome.values)
        else:
            # Optuna reads a constraint value > 0 as infeasible and ranks the trial below every feasible one
            # whatever its value; the value itself is required by Optuna's tell and otherwise unused.
            trial.set_constraint("feasible", 1.0)
            values = [0.0] * len(self.metrics)
        self.study.tell(trial, values)


def stored_rows(attempts: pa.Table, sweep: str, metrics: list[str], executor: str | None = None) -> dict[str, dict]:
    """trial id -> its stored row (the columns a search needs): its latest ok attempt, else its latest oom or
    invalid or skipped one. Other failures (error, timeout) are not answers: those trials run again. With
    `executor`, only measurements of that executor answer (the plan's invalid and skipped rows always do).
    `attempts` is every stored attempt, already read (store.read_table(store, latest=False), any sweeps)."""
    columns = ["sweep", "trial_id", "status", "message", "trial_wall_s", "ended_at", "executor", *metrics]
    keep = [r for r in attempts.select(columns).to_pylist()
            if r["sweep"] == sweep and r["status"] in (*ANSWERED, "invalid", "skipped")
            and (executor is None or r["executor"] in (None, executor))]
    # Later entries win: ok after any other status, then the latest attempt.
    keep.sort(key=lambda r: (r["status"] == "ok", r["ended_at"] is not None, r["ended_at"] or 0))
    return {r["trial_id"]: r for r in keep}
