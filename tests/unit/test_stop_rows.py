"""What a stopped sweep stores (SIGTERM at the end of an allocation, scancel): the trials in flight are
`interrupted`, recorded before Ray's teardown (which can hang on a GCS the same signal killed), never superseded by
a failure row that the stop itself caused, and the driver exits within the grace period even if the teardown
hangs. No Ray here: tests/integration/test_cluster_faults.py lets a real SLURM time limit expire."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq

from raybench.cli import cluster as cli_cluster
from raybench.cli import main as cli
from raybench.drivers import sweep
from raybench.drivers.progress import SweepProgress
from raybench.drivers.trial import build_row, run_trial
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep

TINY = {"name": "stop", "model": {"preset": "tiny"}, "resources": {"workers": 1},
        "train": {"steps": 4, "warmup_steps": 1, "seq_len": 64}, "axes": {"train.micro_batch": [1, 2]}}
REPO = Path(__file__).resolve().parents[2]


def _statuses(root: Path, trial_id: str) -> list[str]:
    """The trial's stored attempts, oldest first (by ended_at, as the latest row is chosen)."""
    rows = [pq.read_table(p).to_pylist()[0] for p in store.trial_row_files(root, "stop", trial_id)]
    return [r["status"] for r in sorted(rows, key=lambda r: r["ended_at"])]


def test_a_failure_the_stop_caused_never_supersedes_the_interrupted_row(tmp_path):
    trial, _ = plan(parse_sweep(TINY))

    def killed_by_the_stop(payload):  # the sweep driver records the stop, then the trial's ranks die with the job
        sweep.write_interrupted_rows([trial], "stop", str(tmp_path), "train", set(), "received signal 15")
        raise RuntimeError("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task")

    run_trial(trial.payload, "stop", str(tmp_path), "train", killed_by_the_stop)
    assert _statuses(tmp_path, trial.trial_id) == ["interrupted"]
    assert store.read_results(tmp_path, "stop").status.tolist() == ["interrupted"]

    # An interrupted row of an earlier run does not hide the failure of a later attempt.
    def failing(payload):
        raise RuntimeError("boom")

    run_trial(trial.payload, "stop", str(tmp_path), "train", failing)
    assert _statuses(tmp_path, trial.trial_id) == ["interrupted", "error"]


def test_the_stop_and_the_failure_it_caused_written_at_once_leave_the_interrupted_row_latest(tmp_path, monkeypatch):
    """A write takes its time (an fsync): the stop's row, built first, may land only once the trial has looked for
    it, or the trial's failure row, built after the stop's, once the stop has looked. Either way it goes."""
    trial, _ = plan(parse_sweep(TINY))
    root, why, write = str(tmp_path), "received signal 15", store.write_row
    stop_built = []

    def the_stop_lands_meanwhile(where, row):
        path = write(where, row)
        if row["status"] == "error":
            write(where, build_row(trial.payload, "stop", "interrupted", why, ended_at=stop_built[0]))
        return path

    def killed_by_the_stop(payload):
        stop_built.append(datetime.now(timezone.utc))
        raise RuntimeError("ray.exceptions.WorkerCrashedError: The worker died unexpectedly while executing this task")

    monkeypatch.setattr(store, "write_row", the_stop_lands_meanwhile)
    run_trial(trial.payload, "stop", root, "train", killed_by_the_stop)
    assert _statuses(tmp_path, trial.trial_id) == ["interrupted"]

    def a_failure_lands_meanwhile(where, row):
        if row["status"] == "interrupted":
            write(where, build_row(trial.payload, "stop", "error", "WorkerCrashedError"))  # built after the stop's
        return write(where, row)

    monkeypatch.setattr(store, "write_row", a_failure_lands_meanwhile)
    listed = set(store.result_files(root, "stop"))
    sweep.write_interrupted_rows([trial], "stop", root, "train", listed, why)
    assert _statuses(tmp_path, trial.trial_id) == ["interrupted", "interrupted"]


def test_the_stop_rows_are_written_again_only_over_a_late_failure(tmp_path):
    running, finished = plan(parse_sweep(TINY))
    root, why = str(tmp_path), "received signal 15"
    earlier = datetime(2020, 1, 1, tzinfo=timezone.utc)
    store.write_row(root, build_row(running.payload, "stop", "ok", "", ended_at=earlier))
    listed = set(store.result_files(root, "stop"))  # an ok row of an earlier run is no reason to skip the trial
    store.write_row(root, build_row(finished.payload, "stop", "ok", ""))  # stored ok by this run: kept as it is

    sweep.write_interrupted_rows([running, finished], "stop", root, "train", listed, why)  # at the stop
    sweep.write_interrupted_rows([running, finished], "stop", root, "train", listed, why)  # once Ray is down
    assert _statuses(tmp_path, running.trial_id) == ["ok", "interrupted"]  # once, not once per call
    assert _statuses(tmp_path, finished.trial_id) == ["ok"]

    # The dying trial's driver stored its error between the two (a failure the stop caused): superseded.
    store.write_row(root, build_row(running.payload, "stop", "error", "WorkerCrashedError"))
    sweep.write_interrupted_rows([running, finished], "stop", root, "train", listed, why)
    assert _statuses(tmp_path, running.trial_id) == ["ok", "interrupted", "error", "interrupted"]
    latest = store.read_results(tmp_path, "stop").set_index("trial_id").status
    assert latest[running.trial_id] == "interrupted" and latest[finished.trial_id] == "ok"


def test_a_trial_that_stored_ok_just_as_the_stop_came_keeps_its_ok_row_alone(tmp_path):
    # The stop looks first and finds no row; the trial's driver, finishing at that moment, stores ok after it.
    trial, _ = plan(parse_sweep(TINY))
    root, why = str(tmp_path), "received signal 15"
    progress = SweepProgress("quiet")
    progress.start(total=2)
    progress.trial_started(trial.trial_id, trial.axis_values)
    assert sweep.write_interrupted_rows([trial], "stop", root, "train", set(), why) == {trial.trial_id}  # at the stop
    progress.trials_interrupted({trial.trial_id})
    store.write_row(root, build_row(trial.payload, "stop", "ok", ""))
    progress.trial_finished(trial.trial_id, {"status": "ok"})
    assert _statuses(tmp_path, trial.trial_id) == ["interrupted", "ok"]

    cut = sweep.write_interrupted_rows([trial], "stop", root, "train", set(), why)  # once Ray is down
    assert cut == set() and _statuses(tmp_path, trial.trial_id) == ["ok"]
    assert progress.tally() == "of 2 trials: 1 ok, 1 not started"


STOPPED_WHILE_TEARDOWN_HANGS = """
import os, signal, sys, time
from raybench.cli import main as cli
from raybench.drivers import sweep
from raybench.drivers.progress import SweepProgress
from raybench.drivers.ray_cluster import Terminated, terminate_on_sigterm
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep

sweep.STOP_GRACE_S = 1.0
trials = plan(parse_sweep({tiny!r}))
progress = SweepProgress("quiet")
progress.trial_started(trials[0].trial_id, trials[0].axis_values)
with sweep.record_interrupted(progress, trials, "stop", {root!r}, "train", set()) as on_stop:
    try:
        with terminate_on_sigterm(on_stop):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
    finally:  # Ray's teardown, blocked on a GCS that is gone
        print("teardown", flush=True)
        time.sleep(30)
"""


def test_sigterm_stores_the_rows_before_the_teardown_and_exits_when_it_hangs(tmp_path):
    script = STOPPED_WHILE_TEARDOWN_HANGS.format(tiny=TINY, root=str(tmp_path))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == sweep.EXIT_INTERRUPTED == cli.EXIT_INTERRUPTED, done.stderr
    assert time.monotonic() - started < 20  # the grace period (1 s here), not the 30 s the teardown would take
    assert done.stdout.strip() == "teardown"
    assert "Ray did not shut down within 1 s" in done.stderr and "run the same command again" in done.stderr
    (trial, other) = plan(parse_sweep(TINY))
    assert _statuses(tmp_path, trial.trial_id) == ["interrupted"] and _statuses(tmp_path, other.trial_id) == []
    (row,) = store.read_results(tmp_path, "stop").to_dict("records")
    assert row["message"].startswith("the sweep was stopped while this trial ran (received signal 15)")


STOPPED_FROM_ANOTHER_THREAD = """
import threading, time
from raybench.drivers import sweep
from raybench.drivers.progress import SweepProgress
from raybench.drivers.ray_cluster import stop_sweep, terminate_on_sigterm
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep

trials = plan(parse_sweep({tiny!r}))
progress = SweepProgress("quiet")
progress.start(len(trials))
progress.trial_started(trials[0].trial_id, trials[0].axis_values)
with sweep.record_interrupted(progress, trials, "stop", {root!r}, "train", set()) as on_stop:
    try:
        with terminate_on_sigterm(on_stop):  # the allocation watcher of `run --cluster` calls stop_sweep
            threading.Thread(target=stop_sweep, args=({why!r}, 1.0)).start()
            time.sleep(30)
    finally:  # Ray's teardown, blocked on a head that is gone
        print("teardown", flush=True)
        time.sleep(30)
"""


def test_a_stop_from_another_thread_gives_its_reason_the_tally_and_exits_within_its_grace(tmp_path):
    why = "the allocation of cluster c ended: job 7 COMPLETING (TimeLimit)"
    script = STOPPED_FROM_ANOTHER_THREAD.format(tiny=TINY, root=str(tmp_path), why=why)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == sweep.EXIT_INTERRUPTED, done.stderr
    assert time.monotonic() - started < 20 and done.stdout.strip() == "teardown"
    assert f"interrupted ({why}); Ray did not shut down within 1 s" in done.stderr, done.stderr
    assert "of 2 trials: 1 interrupted, 1 not started" in done.stderr
    (row,) = store.read_results(tmp_path, "stop").to_dict("records")
    assert row["status"] == "interrupted"
    assert row["message"].startswith(f"the sweep was stopped while this trial ran ({why})")


def test_cluster_status_says_how_a_clusters_allocation_ended():
    status = {"name": "c", "job_id": "7", "state": "GONE", "ended": "TIMEOUT", "address": None, "nodes": None}
    assert cli_cluster.status_text(status) == "cluster c: job 7 GONE (its allocation ended: TIMEOUT), address -"


def test_a_stop_after_the_sweep_has_ended_does_nothing():
    # The allocation may end just as the sweep does: `run` then prints its table and exits as it would have.
    script = "from raybench.drivers.ray_cluster import stop_sweep; stop_sweep('the allocation ended'); print('alive')"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "alive", done.stderr
