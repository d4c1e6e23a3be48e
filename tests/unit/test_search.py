"""The searcher over a sweep's grid, driven without Ray: space mapping, infeasible points, reuse of stored rows
(resume without duplicates), early stop, budgets, concurrency, multi-objective fronts."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from raybench.drivers.search import FINISHED, PlannedSearch, SearchSpace, make_sampler, outcome_from_rows
from raybench.planning.plan import plan
from raybench.spec.errors import ConfigError
from raybench.spec.load import parse_sweep

BASE = {"name": "s", "model": {"preset": "tiny"}, "resources": {"workers": 2}}


def sweep(axes: dict, search: dict | None = None, **extra):
    return parse_sweep({**BASE, "axes": axes, "search": {"algo": "optuna", **(search or {})}, **extra})


def searcher_for(spec, **kwargs) -> PlannedSearch:
    space = SearchSpace(spec, plan(spec, keep_invalid=True))
    sampler = make_sampler(spec.search.algo, spec.search.seed, len(space.points))
    return PlannedSearch(space, spec.search.objectives(), sampler,
                         num_samples=spec.search.num_samples, early_stop=spec.search.early_stop, **kwargs)


def throughput(payload: dict) -> float:
    """A made-up landscape: more sequences per step help, checkpointing costs; ddp a bit faster than fsdp2."""
    train = payload["config"]["train"]
    speed = 1000.0 * train["micro_batch"] ** 0.5 * (1 - 0.3 * float(Fraction(train["ac_ratio"])))
    return speed * (1.0 if train["strategy"] == "ddp" else 0.97)


def drive(searcher: PlannedSearch, evaluate=lambda p: {"status": "ok", "tok_per_s_per_device": throughput(p)},
          limit: int = 500) -> list[dict]:
    """Run the searcher to the end as Tune would with one trial at a time; returns every row 'run'. `evaluate`
    gets a trial's payload as plain data."""
    payloads = {t.trial_id: t.payload.to_dict() for trials in searcher.space.points.values() for t in trials}
    rows = []
    for n in range(limit):
        suggestion = searcher.suggest(f"t{n}")
        if suggestion == FINISHED:
            return rows
        ran = [{"trial_id": trial_id, "trial_wall_s": 1.0, "message": "", **evaluate(payloads[trial_id])}
               for trial_id in suggestion["trial_ids"]]
        rows += ran
        searcher.on_trial_complete(f"t{n}", {"rows_json": json.dumps(ran)})
    raise AssertionError("the search did not finish")


def test_space_maps_indices_to_planned_trials():
    spec = sweep({"train.micro_batch": [8, 1, 4],
                  "setup": [{"train.strategy": "ddp"}, {"train.strategy": "tp", "train.tp_size": 2}]},
                 exclude=[{"train.micro_batch": 4, "setup": {"train.strategy": "ddp"}}])
    space = SearchSpace(spec, plan(spec, keep_invalid=True))
    micro, setup = space.axes
    assert micro.order == (1, 2, 0)  # ranks sorted by value: 1, 4, 8 (TPE learns neighbours alike)
    assert setup.order is None  # mappings have no order: categorical
    assert len(space.points) == 5 and space.excluded == {(2, 0)}
    trial = space.points[space.point({"train.micro_batch": 2, "setup": 1})][0]  # rank 2 = value 8
    assert trial.axis_values == {"train.micro_batch": 8, "train.strategy": "tp", "train.tp_size": 2}
    assert space.label((0, 1)) == "micro_batch=8 setup={'train.strategy': 'tp', 'train.tp_size': 2}"


def test_sac_ratio_axis_is_ordered_by_value():
    spec = sweep({"train.ac_ratio": ["1", "1/4", "0", "3/4", "1/2"]})
    axis = SearchSpace(spec, plan(spec, keep_invalid=True)).axes[0]
    assert [axis.values[i] for i in axis.order] == ["0", "1/4", "1/2", "3/4", "1"]


def test_invalid_points_are_stored_once_and_told_infeasible():
    # tp needs tp_size == workers (2) and tp_size 3 divides no head count: only 2 of 6 points can run.
    spec = sweep({"train.strategy": ["ddp", "tp"], "train.tp_size": [1, 2, 3]})
    recorded = []
    searcher = searcher_for(spec, record_unrun=recorded.extend)
    rows = drive(searcher)
    assert len(rows) == 2 and {r["status"] for r in rows} == {"ok"}
    invalid = [o for _, o in searcher.history if o.status == "invalid"]
    assert len(invalid) == 4 and len(recorded) == 4 and len({t.trial_id for t in recorded}) == 4
    assert all(not o.feasible and o.source == "plan" and o.cost_s == 0 for o in invalid)
    # Optuna got each invalid point as a constraint-violating trial (not a silently dropped one).
    study = searcher.study
    violated = [t for t in study.trials if t.constraints and max(t.constraints.values()) > 0]
    assert len(violated) >= 4
    assert searcher.stop_reason == "every runnable grid point evaluated"
    assert "4 invalid" in searcher.summary()

    # A resumed search does not write the invalid rows again.
    stored = {t.trial_id: {"status": "invalid"} for t in recorded}
    stored.update({r["trial_id"]: {**r, "status": "ok"} for r in rows})
    again = []
    resumed = searcher_for(spec, record_unrun=again.extend, stored=stored)
    assert drive(resumed) == [] and again == []


def test_oom_results_are_told_infeasible_and_the_search_goes_on():
    spec = sweep({"train.micro_batch": [1, 2, 4, 8], "train.ac_ratio": ["0", "1"]})
    searcher = searcher_for(spec)

    def evaluate(payload):
        if payload["config"]["train"]["micro_batch"] == 8:
            return {"status": "oom", "message": "CUDA out of memory", "tok_per_s_per_device": None}
        return {"status": "ok", "tok_per_s_per_device": throughput(payload)}

    rows = drive(searcher, evaluate)
    assert len(rows) == 8 and sum(r["status"] == "oom" for r in rows) == 2
    ooms = [o for _, o in searcher.history if o.status == "oom"]
    assert len(ooms) == 2 and not any(o.feasible for o in ooms) and ooms[0].message == "CUDA out of memory"
    best = searcher.best()
    assert len(best) == 1
    assert searcher.space.label(best[0][0]) == "micro_batch=4 ac_ratio=0"  # the best that fits


def test_resume_replays_the_same_points_without_running_stored_ones():
    spec = sweep({"train.micro_batch": [1, 2, 4, 8], "train.ac_ratio": ["0", "1/2", "1"],
                  "train.strategy": ["ddp", "fsdp2"]}, {"num_samples": 8, "seed": 3})
    first = drive(searcher_for(spec))
    assert len(first) == 8

    # Interrupted after 3 trials: the re-run answers those from the store and runs exactly the other 5.
    stored = {r["trial_id"]: r for r in first[:3]}
    resumed = searcher_for(spec, stored=stored)
    rest = drive(resumed)
    assert [r["trial_id"] for r in rest] == [r["trial_id"] for r in first[3:]]
    assert sum(o.source == "store" for _, o in resumed.history) == 3

    # Complete: nothing runs, the same 8 points are the answer.
    done = searcher_for(spec, stored={r["trial_id"]: r for r in first})
    assert drive(done) == [] and len(done.history) == 8 and done.stop_reason == "num_samples (8) reached"


def test_repeats_of_a_point_run_together_and_stored_ones_are_reused():
    spec = sweep({"train.micro_batch": [1, 2]}, {"num_samples": 2}, repeats=3)
    searcher = searcher_for(spec)
    first = searcher.suggest("a")
    assert [t.repeat for t in searcher.dispatched] == [0, 1, 2]
    ids = first["trial_ids"]
    assert ids == [t.trial_id for t in searcher.dispatched]
    values = [100.0, 110.0, 120.0]
    searcher.on_trial_complete("a", {"rows_json": json.dumps([
        {"trial_id": i, "status": "ok", "trial_wall_s": 2.0, "tok_per_s_per_device": v}
        for i, v in zip(ids, values)])})
    point, outcome = searcher.history[0]
    assert outcome.values == (110.0,) and outcome.cost_s == 6.0

    # Two of three repeats stored ok: only the missing one runs, and the outcome averages all three.
    stored = {ids[0]: {"status": "ok", "tok_per_s_per_device": 100.0}, ids[2]: {"status": "ok",
                                                                               "tok_per_s_per_device": 120.0}}
    resumed = searcher_for(spec, stored=stored)
    again = resumed.suggest("b")
    assert again["trial_ids"] == [ids[1]]
    resumed.on_trial_complete("b", {"rows_json": json.dumps([{"trial_id": ids[1], "status": "ok",
                                                                 "tok_per_s_per_device": 110.0}])})
    assert resumed.history[0][1].values == (110.0,)


def test_early_stop_after_k_points_without_improvement():
    spec = sweep({"train.micro_batch": list(range(1, 21))}, {"algo": "random", "early_stop": 3, "seed": 1})
    searcher = searcher_for(spec)
    rows = drive(searcher, lambda p: {"status": "ok", "tok_per_s_per_device": 100.0})  # a flat landscape
    assert len(rows) == 4  # the first sets the best; three more without a better value
    assert searcher.stop_reason.startswith("early stop: 3")


def test_multi_objective_front_and_improvement():
    spec = sweep({"train.micro_batch": [1, 2, 4, 8]},
                 {"metric": ["tok_per_s_per_device", "peak_rss_gib"], "algo": "random"})
    assert spec.search.objectives() == [("tok_per_s_per_device", "max"), ("peak_rss_gib", "min")]
    searcher = searcher_for(spec)

    def evaluate(payload):
        mb = payload["config"]["train"]["micro_batch"]
        # 8 is slower than 4 and bigger: dominated. The rest trade speed for memory.
        return {"status": "ok", "tok_per_s_per_device": {1: 100, 2: 180, 4: 300, 8: 250}[mb],
                "peak_rss_gib": {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}[mb]}

    drive(searcher, evaluate)
    front = sorted(searcher.space.label(p) for p, _ in searcher.best())
    assert front == ["micro_batch=1", "micro_batch=2", "micro_batch=4"]


def test_concurrent_trials_wait_instead_of_repeating_a_running_point():
    spec = sweep({"train.micro_batch": [1, 2]})
    searcher = searcher_for(spec)
    a, b = searcher.suggest("a"), searcher.suggest("b")
    assert {a["point"], b["point"]} == {"micro_batch=1", "micro_batch=2"}
    assert searcher.suggest("c") is None  # every point is running: wait
    for tid, s in (("a", a), ("b", b)):
        searcher.on_trial_complete(tid, {"rows_json": json.dumps([{"trial_id": s["trial_ids"][0],
                                                                    "status": "ok", "tok_per_s_per_device": 1.0}])})
    assert searcher.suggest("d") == FINISHED


def test_a_driver_that_died_is_an_infeasible_error():
    spec = sweep({"train.micro_batch": [1, 2]})
    searcher = searcher_for(spec)
    searcher.suggest("a")
    searcher.on_trial_complete("a", None, error=True)
    outcome = searcher.history[0][1]
    assert outcome.status == "error" and not outcome.feasible and "died" in outcome.message


def test_rows_without_the_metric_cannot_be_ranked():
    outcome = outcome_from_rows([{"status": "ok", "tok_per_s_per_device": None}], ["tok_per_s_per_device"])
    assert not outcome.feasible and "no value for tok_per_s_per_device" in outcome.message


@pytest.mark.parametrize("search, field, words", [
    ({"algo": "optuna", "metric": "tok_per_s_per_devic"}, "search.metric", "did you mean 'tok_per_s_per_device'"),
    ({"algo": "optuna", "metric": ["tok_per_s", "peak_rss_gib"], "mode": ["max"]}, "search.mode", "one mode per"),
    ({"algo": "optuna", "metric": "peak_reserved_gib"}, "search.metric", "null on CPU trials"),
    ({"algo": "grid", "early_stop": 5}, "search.early_stop", "only used by search.algo random or optuna"),
    ({"algo": "bayes"}, "search.algo", "'grid', 'random' or 'optuna'"),
])
def test_bad_search_sections_name_field_value_and_fix(search, field, words):
    with pytest.raises(ConfigError) as err:
        parse_sweep({**BASE, "axes": {"train.micro_batch": [1, 2]}, "search": search})
    assert any(p.field == field and words in p.message for p in err.value.problems), err.value.report()


def test_a_search_needs_axes():
    with pytest.raises(ConfigError) as err:
        parse_sweep({**BASE, "search": {"algo": "random"}})
    assert err.value.problems[0].field == "search.algo" and "no axes" in err.value.problems[0].message


def test_stored_rows_reuse_ok_and_oom_but_not_errors(tmp_path):
    from datetime import datetime, timedelta, timezone

    from raybench.drivers.search import stored_rows
    from raybench.drivers.trial import build_row
    from raybench.results import store
    from raybench.spec.schema import RankResult

    spec = sweep({"train.micro_batch": [1, 2, 4]})
    a, b, c = (t.payload for t in plan(spec))
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    for payload, status, minute in ((a, "oom", 0), (a, "ok", 1), (a, "error", 2), (b, "oom", 0), (c, "error", 0)):
        result = RankResult.from_columns({"tok_per_s_per_device": 5.0 if status == "ok" else None})
        store.write_row(tmp_path, build_row(payload, "s", status, status, result,
                                            ended_at=start + timedelta(minutes=minute)))
    stored = stored_rows(store.read_table(tmp_path, latest=False), "s", ["tok_per_s_per_device"])
    assert stored[a.trial_id]["status"] == "ok"  # an ok attempt wins over later failures
    assert stored[b.trial_id]["status"] == "oom" and c.trial_id not in stored

    searcher = searcher_for(spec, stored=stored)
    rows = drive(searcher)
    assert [r["trial_id"] for r in rows] == [c.trial_id]  # only the errored trial runs again
    sources = {searcher.space.label(p): (o.source, o.status) for p, o in searcher.history}
    assert sources == {"micro_batch=1": ("store", "ok"), "micro_batch=2": ("store", "oom"),
                       "micro_batch=4": ("run", "ok")}


def test_excluded_points_are_told_infeasible_without_rows():
    spec = sweep({"train.micro_batch": [1, 2, 4], "train.ac_ratio": ["0", "1"]},
                 exclude=[{"train.micro_batch": 4}])
    recorded = []
    searcher = searcher_for(spec, record_unrun=recorded.extend)
    rows = drive(searcher)
    assert len(rows) == 4 and recorded == []
    assert all(searcher.space.axes[0].values[p[0]] != 4 for p, _ in searcher.history)
    study = searcher.study
    told_excluded = [t for t in study.trials if t.constraints and t.params["train.micro_batch"] == 2]  # rank 2 = 4
    assert told_excluded and all(max(t.constraints.values()) > 0 for t in told_excluded)


def test_grid_rerun_writes_invalid_rows_once(tmp_path):
    from raybench.drivers.api import run_sweep
    from raybench.results import store

    spec = parse_sweep({**BASE, "axes": {"train.tp_size": [3, 4]}})  # tp_size applies to tp only: both invalid
    for _ in range(2):
        assert run_sweep(spec, store_path=str(tmp_path), keep_invalid=True, progress=lambda line: None).ran == []
    assert len(store.result_files(tmp_path, "s")) == 2
    assert set(store.read_results(tmp_path, "s").status) == {"invalid"}


def test_points_the_memory_estimate_skips_are_stored_once_and_told_infeasible():
    spec = sweep({"train.micro_batch": [1, 2, 256]}, train={"seq_len": 1024}, estimate={"device_memory_gib": 1.0})
    recorded = []
    searcher = searcher_for(spec, record_unrun=recorded.extend)
    rows = drive(searcher)
    assert len(rows) == 2 and [t.status for t in recorded] == ["skipped"]
    skipped = [o for _, o in searcher.history if o.status == "skipped"]
    assert len(skipped) == 1 and not skipped[0].feasible and "exceeds" in skipped[0].message
    # A measurement outranks the estimate: stored ok, the point is answered from the store, not skipped.
    stored = {recorded[0].trial_id: {"status": "ok", "tok_per_s_per_device": 1.0}}
    stored.update({r["trial_id"]: {**r, "status": "ok"} for r in rows})
    resumed = searcher_for(spec, stored=stored)
    assert drive(resumed) == [] and {o.source for _, o in resumed.history} == {"store"}
