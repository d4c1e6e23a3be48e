"""`raybench run` in two processes (drivers/split_run.py): under `--cluster` and in a one-shot SLURM job the sweep's
driver runs in a child, and should Ray end that child without a word at a stop, the parent stores what the child
had running as `interrupted`. Here the child is a plain Python script playing the driver's part (a journal, then
death by SIGKILL as Ray's C++ core ends it); no Ray, no SLURM: tests/integration/test_cluster_faults.py does it
on the real 2-node test SLURM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from raybench.drivers import slurm, split_run
from raybench.drivers.ray_cluster import Terminated, terminate_on_sigterm
from raybench.drivers.slurm import SlurmOptions
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.load import parse_sweep

TINY = {"name": "split", "model": {"preset": "tiny"}, "resources": {"workers": 1},
        "train": {"steps": 4, "warmup_steps": 1, "seq_len": 64}, "axes": {"train.micro_batch": [1, 2]}}
REPO = Path(__file__).resolve().parents[2]


def test_a_second_sigterm_during_the_stop_is_the_same_stop():
    # In a one-shot job SLURM sends SIGTERM to every process of the job, and `raybench run` passes its own on to the
    # sweep's driver: the driver gets two. The second must not break its teardown (the `interrupted` rows' second
    # check runs there), at any depth of the nested handlers (`run`'s own, the sweep's).
    stops, torn_down = [], []
    with pytest.raises(Terminated, match="received signal 15"):
        with terminate_on_sigterm():
            try:
                with terminate_on_sigterm(stops.append):
                    try:
                        os.kill(os.getpid(), signal.SIGTERM)
                        time.sleep(5)
                    finally:  # Ray's teardown
                        os.kill(os.getpid(), signal.SIGTERM)
                        time.sleep(0.2)
                        torn_down.append("ray")
            finally:  # the rows checked again once Ray is down (sweep.record_interrupted)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)
                torn_down.append("rows")
    assert torn_down == ["ray", "rows"] and stops == ["received signal 15"]
    # Once the sweep has stopped, SIGTERM is SIGTERM again: the next sweep's stop is its own.
    with pytest.raises(Terminated):
        with terminate_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)


def test_a_one_shot_jobs_run_and_run_cluster_split_and_a_plain_run_does_not(tmp_path, monkeypatch):
    monkeypatch.delenv(split_run.JOURNAL_ENV, raising=False)
    run = slurm._run_command(SlurmOptions(), Path("/s.yaml"), Path("/store"), [])
    assert "run /s.yaml --store /store --slurm-job" in run  # the job's payload says it
    assert split_run.splits(None, slurm_job=True) and split_run.splits("c", slurm_job=False)
    assert not split_run.splits(None, slurm_job=False)  # `run` alone, or with --address: one process
    monkeypatch.setenv(split_run.JOURNAL_ENV, str(tmp_path / "trials.json"))
    assert not split_run.splits(None, slurm_job=True)  # the child itself runs the sweep


# The sweep's driver, played by a script: it keeps the journal with its first trial running, says so, then waits.
# "dies without a word": SIGTERM ends it at once with status 1 and no cleanup, as Ray's C++ core does;
# "hangs": it ignores SIGTERM; "killed alone": it dies with no stop at all (the OOM killer).
CHILD = """
import os, signal, sys, time
from raybench.drivers.progress import SweepProgress
from raybench.drivers.split_run import child_journal
from raybench.planning.plan import plan
from raybench.spec.load import parse_sweep

trials = plan(parse_sweep({tiny!r}))
progress = SweepProgress("quiet")
progress.keep_journal(child_journal())
progress.start(len(trials))
progress.trial_started(trials[0].trial_id, trials[0].axis_values)
signal.signal(signal.SIGTERM, signal.SIG_IGN if {how!r} == "hangs" else lambda *_: os._exit(1))
print("running", flush=True)
if {how!r} == "killed alone":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""
# `raybench run`'s parent, with the script above as its child.
PARENT = """
import json, sys
from raybench.drivers import split_run
from raybench.spec.load import parse_sweep

split_run.CHILD_STOP_S = 1.0
child = [sys.executable, "-c", {child!r}]
print(json.dumps(split_run.supervise(child, parse_sweep({tiny!r}), {root!r}, "<sweep>")), flush=True)
"""


@pytest.mark.parametrize("how", ["dies without a word", "hangs", "killed alone"])
def test_the_parent_stores_what_a_child_killed_at_a_stop_had_running(tmp_path, how):
    child = textwrap.dedent(CHILD.format(tiny=TINY, how=how))
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(child=child, tiny=TINY, root=str(tmp_path))],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "running", parent.stderr.read()
    started = time.monotonic()
    if how != "killed alone":
        parent.send_signal(signal.SIGTERM)  # SLURM's, at the job's time limit
    out, err = parent.communicate(timeout=60)
    code, stopped = json.loads(out)
    first = plan(parse_sweep(TINY))[0]
    rows = store.read_results(tmp_path, "split").to_dict("records") if (tmp_path / "sweep=split").is_dir() else []
    if how == "killed alone":  # no stop: the child's death is its own, and there is nothing to add to it
        assert (code, stopped, rows) == (1, None, []), err
        return
    assert time.monotonic() - started < 10  # at once, or CHILD_STOP_S (1 s here) for a child that hangs
    assert code == split_run.EXIT_INTERRUPTED == 130, err
    assert stopped == ["received signal 15", "of 2 trials: 1 interrupted, 1 not started"]
    killed = -signal.SIGKILL if how == "hangs" else 1
    assert f"the sweep's driver ended without a word (exit status {killed})" in err
    [row] = rows
    assert row["trial_id"] == first.trial_id and row["status"] == "interrupted"
    # the words of the child's own stop (sweep.INTERRUPTED_MESSAGE, ray_cluster.terminate_on_sigterm)
    assert row["message"].startswith("the sweep was stopped while this trial ran (received signal 15)")
