"""What one `raybench run` does once: load and plan the sweep, read the store, validate each trial's config, and
pickle each payload; the final table and the "driver died" rows come from what the run knows. Ray is never
started: the trials' drivers are stood in for (the integration tests run them on Ray)."""

from __future__ import annotations

import json
import pickle

from raybench.cli import main as cli
from raybench.drivers import api, sweep
from raybench.drivers.executors import train
from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import load_sweep, parse_sweep
from raybench.spec.schema import RankResult
from raybench.spec.sweep_spec import TrialConfig

TINY = {"name": "once", "model": {"preset": "tiny"}, "resources": {"workers": 2},
        "train": {"steps": 4, "warmup_steps": 1, "seq_len": 64, "precision": "fp32"},
        "axes": {"train.strategy": ["ddp", "fsdp2"], "train.micro_batch": [1, 2]}}


def counted(calls: list, name: str, function):
    def spy(*args, **kwargs):
        calls.append(name)
        return function(*args, **kwargs)

    return spy


FAILED_MESSAGE = "RuntimeError: boom in step 2"


def drivers_writing_rows(failing: set[str]):
    """A stand-in for sweep.run_planned: each trial's driver stores its row (an error for the trials `failing`)."""
    def run_planned(trials, sweep_name, store_path, executor, **options):
        for t in trials:
            status = "error" if t.trial_id in failing else "ok"
            measured = RankResult.from_columns({"tok_per_s_per_device": 100.0})
            message = FAILED_MESSAGE if t.trial_id in failing else ""
            store.write_row(store_path, build_row(t.payload, sweep_name, status, message, measured,
                                                  executor=executor))

    return run_planned


def test_a_run_loads_plans_and_reads_the_store_once_and_prints_what_a_new_read_would(tmp_path, monkeypatch,
                                                                                      capsys):
    path = tmp_path / "once.yaml"
    path.write_text(json.dumps({**TINY, "store": str(tmp_path / "unused")}))  # JSON is YAML
    root = tmp_path / "store"
    stored_ok, errored, *fresh = plan(load_sweep(path))
    # Before the run: one trial stored ok (skipped), one that failed (run again), and another sweep's row.
    measured = RankResult.from_columns({"tok_per_s_per_device": 90.0})
    store.write_row(root, build_row(stored_ok.payload, "once", "ok", "", measured))
    store.write_row(root, build_row(errored.payload, "once", "error", "boom"))
    store.write_row(root, build_row(fresh[0].payload, "other", "ok", ""))
    monkeypatch.setattr(sweep, "run_planned", drivers_writing_rows(failing={fresh[0].trial_id}))
    monkeypatch.setattr(api, "AUTO_COMPACT_FILES", 0)  # the run's new files are compacted before it returns

    calls = []
    monkeypatch.setattr(cli, "load_checked", counted(calls, "load_sweep", cli.load_checked))
    monkeypatch.setattr(api, "plan", counted(calls, "plan", plan))
    monkeypatch.setattr(store, "read_table", counted(calls, "read_table", store.read_table))
    assert cli.main(["run", str(path), "--store", str(root), "--quiet"]) == cli.EXIT_TRIALS_FAILED
    assert sorted(calls) == ["load_sweep", "plan", "read_table"]
    monkeypatch.undo()

    out = capsys.readouterr().out
    assert len(store.result_files(root, "once")) == 1  # compacted after the run
    # --quiet: no table; the trial that failed, then the closing line
    assert out.strip() == (f"{fresh[0].trial_id}: error: {FAILED_MESSAGE}\n\n3 trial(s) run, 1 not ok; results in "
                           f"{root} (`raybench report {root}` for the table)")


def test_the_rows_of_a_run_are_the_rows_read_before_and_the_files_added_since(tmp_path):
    trials = plan(parse_sweep(TINY))
    store.write_row(tmp_path, build_row(trials[0].payload, "once", "error", "boom"))
    store.write_row(tmp_path, build_row(trials[1].payload, "other", "ok", ""))
    listed = set(store.result_files(tmp_path, "once"))
    attempts = store.read_table(tmp_path, latest=False)
    for t in trials[:2]:  # a new attempt of a stored trial, and a new trial
        measured = RankResult.from_columns({"tok_per_s_per_device": 1.0})
        store.write_row(tmp_path, build_row(t.payload, "once", "ok", "", measured))
    since = store.read_table_since(attempts, listed, tmp_path, "once")
    assert since.to_pandas().equals(store.read_table(tmp_path, "once").to_pandas())
    assert sorted(since.column("status").to_pylist()) == ["ok", "ok"]


def test_a_trial_that_stored_no_row_during_the_run_gets_an_error_row(tmp_path, monkeypatch):
    earlier, wrote, died = plan(parse_sweep(TINY))[:3]
    store.write_row(tmp_path, build_row(earlier.payload, "once", "ok", ""))  # an earlier run's row
    listed = set(store.result_files(tmp_path, "once"))
    store.write_row(tmp_path, build_row(wrote.payload, "once", "ok", ""))

    reads = []
    monkeypatch.setattr(store, "read_table", counted(reads, "read_table", store.read_table))
    sweep.write_died_rows([earlier, wrote, died], "once", str(tmp_path), "pool", listed)
    assert reads == []  # file names, not rows
    monkeypatch.undo()

    rows = store.read_results(tmp_path, "once").set_index("trial_id")
    assert rows.status.to_dict() == {earlier.trial_id: "error", wrote.trial_id: "ok", died.trial_id: "error"}
    assert rows.message[died.trial_id] == "trial driver died before storing a row"
    assert store.trial_id_of(store.result_files(tmp_path, "once")[0]) in rows.index
    assert store.trial_id_of(tmp_path / "sweep=once" / "compacted-1_2.parquet") is None


def test_a_payload_is_validated_once_from_the_plan_to_its_ranks(monkeypatch):
    from raybench.runtime import worker

    spec = parse_sweep(TINY)
    validations = []
    validate = TrialConfig.model_validate
    monkeypatch.setattr(TrialConfig, "model_validate",
                        classmethod(lambda cls, *args, **kwargs: validations.append(1) or validate(*args, **kwargs)))
    trials = plan(spec)
    assert len(validations) == len(trials)  # the plan's own, one per grid point

    # Tune's trial driver gets the experiment's payloads through the object store (a pickle), its config the id.
    payloads = pickle.loads(pickle.dumps(sweep.pickled_payloads(trials)))
    (payload,) = sweep.trial_payloads({"trial_id": trials[2].trial_id}, payloads)
    assert payload == trials[2].payload
    assert [p.trial_id for p in sweep.trial_payloads({"trial_ids": [trials[1].trial_id, trials[3].trial_id]},
                                                     payloads)] == [trials[1].trial_id, trials[3].trial_id]
    # Ray Train pickles each rank's loop, payload included.
    ranks_got = []
    monkeypatch.setattr(worker, "run", ranks_got.append)
    pickle.loads(pickle.dumps(train.rank_loop(payload)))()
    assert ranks_got == [trials[2].payload]
    assert len(validations) == len(trials)
