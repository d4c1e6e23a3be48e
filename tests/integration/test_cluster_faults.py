"""What a cluster does to a sweep, on the real 2-node local SLURM of the tests (two slurmd on 127.0.0.1), with the
fault injected for real and the rows read back by an independent reader (duckdb):
- a worker node dies mid-trial (every process of node 2 killed -9), on a warm cluster and on a one-shot job: the
  trial's row is `error` naming the lost node, a trial that needs both nodes ends at once as "not enough nodes",
  a trial that fits the remaining node runs, the warm cluster stays up and `cluster status` names the lost node;
  healed (slow variant), the next run runs exactly the missing trials (the default run's resume check is
  test_ray_sweep's rerun);
- the allocation's time limit expires mid-sweep (`--time 1`, `-m slow`): finished rows kept, the running trial
  `interrupted` (never ok, never a late error), and a resubmission completes the sweep with no trial stored ok twice;
  in the default run the same stop (SIGTERM to every process of the job) with the job's sweep driver frozen and
  killed -9, as when Ray ends it first: `raybench run`, its parent in the job, records the stop;
- a warm cluster's allocation ends under `run --cluster` (scancel in the default run; its real time limit, then a
  new cluster, with `-m slow`): `run` says so at once, the running trial `interrupted`, exit 130 with the tally and
  the resume hint; `cluster status` says how the allocation ended; the new cluster runs exactly the rest;
- the head node dies with the driver in a one-shot job (`-m slow`; every process of the job on node 1 killed -9):
  the rows written before are whole, SLURM ends the job and its processes, the next job reaps the head's Ray files
  and runs exactly the missing trials; the same on a warm cluster under `run --cluster` (`-m slow`), whose run
  stops at once with the trials in flight `interrupted`.

Kept cheap for the default run: three trials of the fewest steps for a node loss (one 2-node trial killed, one
2-node trial refused, one 1-node trial ok), and for the time limit `command` trials that idle (only SLURM's clock
matters), the one in flight held until the limit by a file the test removes before resubmitting.
Each node has os.cpu_count() CPUs and each worker asks for all of them, so a 2-worker trial spans both nodes.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import psutil
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_cluster import (NODE_PREFIX, RAYBENCH, free_port_block, job_processes, raybench_cli,  # noqa: E402
                           raybench_slurm)


pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
NODE2 = f"{NODE_PREFIX}2"
SWEEP = "faults"


@pytest.fixture(scope="module")
def slurm2(tmp_path_factory):
    with raybench_slurm(tmp_path_factory.mktemp("raybench-home"), nodes=2) as env:
        yield env


# The node-loss grid, in the order Tune runs it (one trial at a time: a 2-worker trial takes both nodes): the
# 2-node trial node 2 dies under, a 2-node trial refused at once, a 1-node trial that runs on the node left.
NODE_LOSS_POINTS = {"point": [{"resources.workers": 2, "train.micro_batch": 1},
                              {"resources.workers": 2, "train.micro_batch": 2},
                              {"resources.workers": 1, "train.micro_batch": 1}]}


def _sweep(path: Path, axes: dict, steps: int = 4) -> Path:
    """The smoke sweep's tiny ddp trial, each worker filling a node; `axes` decide the trials (grid order)."""
    spec = yaml.safe_load((REPO / "sweeps" / "smoke-cpu.yaml").read_text())
    # Ray Train's workers, whose loss with their node this file checks (the warm pool's: test_pool.py).
    spec.update(name=SWEEP, axes=axes, executor="train")
    spec["train"].update(strategy="ddp", steps=steps, warmup_steps=1, seq_len=32)
    spec["resources"]["cpus_per_worker"] = os.cpu_count()
    spec["resources"]["timeout_s"] = 600  # a trial that waited for a lost node would show as a 10-minute wait
    path.write_text(yaml.safe_dump(spec))
    return path


# A `command` trial that idles: it waits while its hold file exists, then times STEPS steps of nothing. Its row is
# an ordinary ok row with a timed window (the probe's records), at almost no CPU.
IDLE_TRIAL = """import os, sys, time, types
from raybench.runtime.probe import StepProbe
steps, hold = int(sys.argv[1]), sys.argv[2]
while os.path.exists(hold):
    time.sleep(0.2)
probe = StepProbe(device=types.SimpleNamespace(type="cpu"))  # no torch to import: nothing runs on a device
probe.start()
for _ in range(steps):
    time.sleep(0.01)
    probe.step(tokens=64)
probe.finish()
"""
IDLE_STEPS = 3


def _idle_sweep(tmp_path: Path, holds: list[Path]) -> Path:
    """One `command` trial per hold file, one at a time on one node (each worker takes all its CPUs)."""
    script = tmp_path / "idle_trial.py"
    script.write_text(IDLE_TRIAL)
    spec = {"name": SWEEP, "model": {"preset": "tiny"},
            "train": {"steps": IDLE_STEPS, "warmup_steps": 1},
            "resources": {"workers": 1, "cpus_per_worker": os.cpu_count(), "timeout_s": 600},
            "stack": {"kind": "command", "command": ["{python}", str(script), "{steps}", "{hold}"],
                      "overrides": {"hold": ""}},
            "axes": {"stack.overrides.hold": [str(h) for h in holds]}}
    path = tmp_path / "idle.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _options(nodes: int, time_limit: str = "20") -> list[str]:
    return ["--nodes", str(nodes), "--cpus-per-node", str(os.cpu_count()), "--time", time_limit,
            "--port", str(free_port_block())]


def _attempts(store: Path) -> list[dict]:
    """Every stored attempt of the sweep, read by duckdb straight from the Parquet files."""
    files = str(store / f"sweep={SWEEP}" / "*.parquet")
    query = (f"select trial_id, status, message, resources_workers, trial_wall_s, steps_timed, "
             f"epoch_ms(ended_at) as ended_ms from read_parquet('{files}', union_by_name=true) order by ended_ms")
    cursor = duckdb.connect().execute(query)
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row)) for row in cursor.fetchall()]


def _latest(attempts: list[dict]) -> dict[str, dict]:
    return {a["trial_id"]: a for a in attempts}  # ordered by ended_ms: the last one wins


def _resumed_exactly(store: Path, attempts: list[dict], ok_before: str) -> list[str]:
    """After a resume of the three-trial sweep whose first run stored `attempts`, only `ok_before` ok: each trial is
    stored ok once, and the rows the resume added are exactly the two others (none run twice). The ok trial ids."""
    after = _attempts(store)
    ok_rows = [a["trial_id"] for a in after if a["status"] == "ok"]
    assert len(ok_rows) == len(set(ok_rows)) == 3  # complete, none twice
    assert sorted(a["trial_id"] for a in after[len(attempts):]) == sorted(set(ok_rows) - {ok_before}), after
    return ok_rows


def _node2_processes(job_id: str) -> list[psutil.Process]:
    return [p for p in job_processes(job_id) if _environ(p).get("SLURMD_NODENAME") == NODE2
            and _name(p) not in ("slurmstepd", "slurmd", "")]


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


def _environ(proc: psutil.Process) -> dict:
    try:
        return proc.environ()
    except psutil.Error:
        return {}


def _kill_node2_mid_trial(job_id: str, killed: dict, timeout: float = 300) -> None:
    """Once a training rank runs on node 2, kill -9 every process of the job on node 2 (its raylet included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = [p for p in _node2_processes(job_id) if "RayTrainWorker" in " ".join(_cmdline(p))]
        if ranks:
            time.sleep(1)  # the rank is starting or training: mid-trial either way
            victims = _node2_processes(job_id)
            killed.update(count=len(victims), names=sorted({_name(p) for p in victims}), at=time.time())
            for proc in victims:
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            return
        time.sleep(0.3)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _job_id_of(env: dict, name: str) -> str:
    return json.loads((Path(env["RAYBENCH_HOME"]) / "clusters" / f"{name}.json").read_text())["job_id"]


def _check_node_loss_rows(attempts: list[dict]) -> None:
    """The 3-trial grid after node 2 died in its first (2-worker) trial."""
    latest = list(_latest(attempts).values())
    assert len(attempts) == len(latest) == 3, attempts
    lost, short, fits = latest  # by ended_at: the grid's order, one trial at a time
    assert lost["status"] == "error" and lost["resources_workers"] == 2, lost
    assert "was lost during the trial" in lost["message"] and f"Ray node {NODE2} (" in lost["message"], lost
    assert short["status"] == "error" and short["message"].startswith("not enough nodes"), short
    assert NODE2 in short["message"] and short["trial_wall_s"] < 30  # at once, not at timeout_s (600 s)
    assert fits["status"] == "ok" and fits["resources_workers"] == 1, fits


@pytest.mark.parametrize("healed", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["degraded", "then_healed"])
def test_worker_node_lost_on_a_warm_cluster(slurm2, tmp_path, healed):
    sweep, store = _sweep(tmp_path / "s.yaml", NODE_LOSS_POINTS, steps=2), tmp_path / "store"
    started = time.monotonic()
    assert raybench_cli(slurm2, "cluster", "up", "faulty", "--no-check", *_options(2)).returncode == 0
    try:
        _node_lost_on_warm_cluster(slurm2, sweep, store, healed)
    finally:  # a failed check must not leave the cluster holding both nodes for the next test
        raybench_cli(slurm2, "cluster", "down", "faulty")
    print(f"FIGURES warm{' healed' if healed else ''}: {time.monotonic() - started:.0f} s wall")


def _node_lost_on_warm_cluster(slurm2: dict, sweep: Path, store: Path, healed: bool) -> None:
    job_id, killed = _job_id_of(slurm2, "faulty"), {}
    killer = threading.Thread(target=_kill_node2_mid_trial, args=(job_id, killed))
    killer.start()
    done = raybench_cli(slurm2, "run", str(sweep), "--cluster", "faulty", "--store", str(store), "--quiet")
    killer.join()
    assert killed.get("count"), "no rank ever ran on node 2"
    assert done.returncode == 1, done.stderr  # some trials not ok; the run finished with its table
    attempts = _attempts(store)
    _check_node_loss_rows(attempts)

    status = raybench_cli(slurm2, "cluster", "status", "faulty")
    assert status.returncode == 0 and "RUNNING" in status.stdout  # up, degraded
    assert f"node {NODE2} (" in status.stdout and "GONE" in status.stdout and "degraded" in status.stdout
    print(f"FIGURES warm: faults 1 ({killed['count']} processes of {NODE2} killed -9), rows expected 3, "
          f"rows found {len(attempts)}, duplicates {len(attempts) - len(_latest(attempts))}")
    if not healed:
        return

    # Healed: a fresh 2-node allocation. The same sweep runs exactly the two trials that were not ok.
    assert raybench_cli(slurm2, "cluster", "down", "faulty").returncode == 0
    assert raybench_cli(slurm2, "cluster", "up", "faulty", "--no-check", *_options(2)).returncode == 0
    again = raybench_cli(slurm2, "run", str(sweep), "--cluster", "faulty", "--store", str(store), "--quiet")
    assert again.returncode == 0, again.stderr
    after = _attempts(store)
    missing = {a["trial_id"] for a in _latest(attempts).values() if a["status"] != "ok"}
    added = [a["trial_id"] for a in after[len(attempts):]]
    assert sorted(added) == sorted(missing) and len(missing) == 2
    assert {a["status"] for a in _latest(after).values()} == {"ok"}
    print(f"FIGURES warm healed: healed run added {len(added)}, latest ok {len(_latest(after))}, "
          f"duplicate ok rows {len([a for a in after if a['status'] == 'ok']) - len(_latest(after))}")


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller, where a CPU quota holds processes back


@contextlib.contextmanager
def _cpu_quota(procs: list[psutil.Process], fraction: float):
    """Hold `procs` (and every process they start) to `fraction` of one CPU, for real: a cgroup with a CFS quota;
    on leaving, they go back to the root group and the cgroup is removed."""
    group = CPU_CGROUP / f"raybench-throttle-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as err:
        pytest.skip(f"cannot make a cpu cgroup here ({err}): no way to slow a node down for real")
    try:
        # A 10 ms period: the quota's pauses come every few milliseconds, so a phase of a few milliseconds is held
        # back as a longer one is (with the default 100 ms period, a short phase often runs whole in one slice).
        (group / "cpu.cfs_period_us").write_text("10000")
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(10000 * fraction))))
        for proc in procs:
            with contextlib.suppress(OSError):
                (group / "cgroup.procs").write_text(str(proc.pid))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
        group.rmdir()


# ~3 min: a 2-node cluster up with its pre-flight, node 2's processes held to a tenth of a CPU, the check again
# (naming it), once more with --exclude-slow (leaving it out), then a sweep on the node left. The
# default run checks the pre-flight of `cluster up` on one node (test_slurm.py's warm cluster) and its judgement on
# planted figures (tests/unit/test_preflight.py).
@pytest.mark.slow
def test_the_preflight_names_a_throttled_node(slurm2, tmp_path):
    store = tmp_path / "store"
    up = raybench_cli(slurm2, "cluster", "up", "throttled", "--store", str(store), *_options(2))
    assert up.returncode == 0 and "pre-flight of cluster throttled" in up.stdout, up.stderr
    try:
        job_id = _job_id_of(slurm2, "throttled")
        with _cpu_quota(_node2_processes(job_id), 0.1):
            check = raybench_cli(slurm2, "cluster", "check", "throttled", "--store", str(store))
            # A trial across both nodes: its row names node 2's rank the straggler.
            both = _sweep(tmp_path / "both.yaml", {"point": NODE_LOSS_POINTS["point"][:1]}, steps=4)
            spanned = raybench_cli(slurm2, "run", str(both), "--cluster", "throttled", "--store",
                                   str(tmp_path / "both-store"), "--quiet")
            # Left out: node 2's Ray stopped, the cluster goes on with node 1 alone.
            excluded = raybench_cli(slurm2, "cluster", "check", "throttled", "--store", str(store), "--exclude-slow")
        status = raybench_cli(slurm2, "cluster", "status", "throttled")
        sweep = _sweep(tmp_path / "s.yaml", {"point": NODE_LOSS_POINTS["point"][1:]}, steps=2)
        ran = raybench_cli(slurm2, "run", str(sweep), "--cluster", "throttled", "--store", str(store), "--quiet")
    finally:
        raybench_cli(slurm2, "cluster", "down", "throttled")
    assert check.returncode == 1, check.stderr
    assert f"slow node(s): {NODE2};" in check.stdout and f"{NODE2} (cpu):" in check.stdout
    # The one pair of nodes all-reduced across the two nodes' Rays (gloo; with nothing to compare with, and no table
    # figure for CPUs, it is measured, not judged).
    assert f"{NODE_PREFIX}1<->{NODE2} (2 ranks): all-reduce" in check.stdout, check.stdout
    assert spanned.returncode == 0, spanned.stderr
    rows_of_both = f"read_parquet('{tmp_path}/both-store/sweep={SWEEP}/*.parquet')"
    (row,) = duckdb.sql(f"select straggler, slowest_rank_node, straggler_why, local_time_p50_s_by_rank, "
                        f"step_time_p50_s from {rows_of_both}").fetchall()
    print(f"FIGURES straggler: {row}")
    assert row[0] is True and row[1] == NODE2, row
    assert excluded.returncode == 0 and f"left out: {NODE2}" in excluded.stdout, excluded.stdout + excluded.stderr
    assert f"node {NODE2} (" in status.stdout and "GONE" in status.stdout, status.stdout
    # The sweep on what is left: the 2-node trial refused at once, the 1-node trial ok on node 1.
    assert ran.returncode == 1, ran.stderr
    statuses = sorted((a["resources_workers"], a["status"]) for a in _latest(_attempts(store)).values())
    assert statuses == [(1, "ok"), (2, "error")], statuses
    glob = str(store / "cluster-health" / "*.parquet")
    rows = duckdb.sql(f"select checked_at, node, slow, why, matmul_tflops_of_fastest from read_parquet('{glob}') "
                      "where link is null order by checked_at, node").fetchall()
    latest = [row[1:] for row in rows if row[0] == rows[-1][0]]  # the last check's (the first: `cluster up`'s)
    assert len(rows) == 6 and [(node, slow) for node, slow, _, _ in latest] == [(f"{NODE_PREFIX}1", False),
                                                                                 (NODE2, True)]
    assert latest[1][2].startswith("matmul") and latest[1][3] < 0.5, latest  # a tenth of a CPU: far below


@pytest.mark.slow  # ~100 s; the same node loss on a warm cluster is in the default run
def test_worker_node_lost_in_a_one_shot_job(slurm2, tmp_path):
    sweep, store = _sweep(tmp_path / "s.yaml", NODE_LOSS_POINTS, steps=2), tmp_path / "store"
    started = time.monotonic()
    submit = subprocess.Popen([*RAYBENCH, "slurm", "submit", str(sweep), "--store", str(store), "--wait",
                               *_options(2)], env=slurm2, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    job_id = None
    deadline = time.monotonic() + 60
    while job_id is None and time.monotonic() < deadline:  # squeue: the job submit just made
        out = subprocess.run(["squeue", "--noheader", "--format=%i %j %T"], env=slurm2, capture_output=True,
                             text=True).stdout.split("\n")
        job_id = next((line.split()[0] for line in out if "raybench-faults" in line and "RUNNING" in line), None)
        time.sleep(0.5)
    killed = {}
    _kill_node2_mid_trial(job_id, killed)
    if job_id is None:
        submit.kill()
    stdout, stderr = submit.communicate(timeout=600)
    assert job_id is not None, f"the job never ran: {stdout} {stderr}"
    print(stdout, stderr)
    assert killed.get("count"), "no rank ever ran on node 2"
    assert submit.returncode == 1 and "the sweep exited 1" in stdout, stderr
    attempts = _attempts(store)
    _check_node_loss_rows(attempts)
    print(f"FIGURES one-shot: faults 1 ({killed['count']} processes of {NODE2} killed -9), rows expected 3, "
          f"rows found {len(attempts)}, duplicates {len(attempts) - len(_latest(attempts))}; "
          f"{time.monotonic() - started:.0f} s wall")


def _job_log(env: dict) -> str:
    """The SLURM log of the one-shot job submitted last."""
    logs = sorted((Path(env["RAYBENCH_HOME"]) / "jobs").glob("*/slurm-*.out"), key=lambda p: p.stat().st_mtime)
    return logs[-1].read_text(errors="replace")


# ~90 s (SLURM's least limit is a minute). Out of the default run since 2026-11-28: in one of that day's three
# clean-clone runs the job's sweep driver stored nothing at the limit (no `interrupted` row, no stop line in the job
# log; the trial's latest row was its dying driver's `error`). Since then the driver runs in a child of the job's
# `raybench run`, which records the stop should the driver die without a word (drivers/split_run.py); the default
# run makes that death for sure (test_a_one_shot_jobs_driver_killed_at_the_stop_still_records_it).
@pytest.mark.slow
def test_time_limit_expires_then_resubmission_completes(slurm2, tmp_path):
    # Three idle trials on one node, one at a time: the first ends in seconds, the second idles until the
    # 1-minute limit ends the job (SLURM checks limits every 30 s: 60 to 90 s in), the third never starts.
    held = tmp_path / "held"
    held.touch()
    first_trial, in_flight, never_started = tmp_path / "free-1", held, tmp_path / "free-2"
    sweep, store = _idle_sweep(tmp_path, [first_trial, in_flight, never_started]), tmp_path / "store"
    started = time.monotonic()
    first = raybench_cli(slurm2, "slurm", "submit", str(sweep), "--store", str(store), "--wait", *_options(1, "1"))
    first_s = time.monotonic() - started
    assert first.returncode == 1 and "ended before the sweep finished" in first.stderr, first.stderr
    said = first.stderr.split("its log ends:")[0]  # the sweep's own lines first, before the log's raw end
    assert "DUE TO TIME LIMIT" in said, first.stderr
    log = _job_log(slurm2)
    assert "DUE TO TIME LIMIT" in log, log[-3000:]
    # Whether the stop was said before SLURM's SIGKILL, and by whom: the sweep's driver, or `raybench run` (its
    # parent in the job) when the driver died without a word (the rows below are written before either says so).
    print(f"FIGURES time limit: the stop line in the job log: {'interrupted (received signal 15)' in log}, said by "
          f"{'the parent' if 'ended without a word' in log else 'the driver itself'}")
    attempts = _attempts(store)
    latest = list(_latest(attempts).values())
    assert [a["status"] for a in latest] == ["ok", "interrupted"], attempts  # the third never started
    ok, interrupted = latest
    assert ok["steps_timed"] == IDLE_STEPS - 1  # its whole window
    assert interrupted["message"].startswith("the sweep was stopped while this trial ran (received signal 15)")
    assert "ok" not in {a["status"] for a in attempts if a["trial_id"] == interrupted["trial_id"]}

    held.unlink()  # released: the resubmitted job runs the held trial and the one never started, in seconds
    second = raybench_cli(slurm2, "slurm", "submit", str(sweep), "--store", str(store), "--wait", *_options(1))
    assert second.returncode == 0, second.stderr
    assert "2 trial(s) run, 0 not ok" in second.stdout  # the sweep's own tally, above the finished line
    ok_rows = _resumed_exactly(store, attempts, ok["trial_id"])
    # Neither job left a process or its Ray's files behind, the one that ran out of time included.
    for done in (first, second):
        job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)
        assert job_processes(job_id) == [] and not list(Path("/tmp").glob(f"rbs-{job_id}-*")), job_id
    print(f"FIGURES time limit: faults 1 (limit expired, first job {first_s:.0f} s), rows expected 3, first job "
          f"{len(attempts)} rows (1 ok, 1 interrupted, {len(attempts) - 2} other), after resubmission "
          f"{len(ok_rows)} ok, duplicate ok rows {len(ok_rows) - len(set(ok_rows))}; "
          f"{time.monotonic() - started:.0f} s wall")


# ~25 s; resubmitted (`-m slow`) ~45 s: the default run's resume check is test_ray_sweep's rerun.
@pytest.mark.parametrize("resubmitted", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["stopped", "resubmitted"])
def test_a_one_shot_jobs_driver_killed_at_the_stop_still_records_it(slurm2, tmp_path, resubmitted):
    # The default run's check of the time limit's stop above, without a minute's wait: the gap it once showed (the
    # job's sweep driver stored nothing at the limit) made here for sure. While the second of three idle trials
    # runs, the sweep's driver is frozen, SIGTERM goes to every process of the job as at the limit (the Ray head's
    # included; `--signal` sends no SIGCONT, which would thaw it), and the driver is killed -9 once the head's Ray
    # is down: it dies without a word, as when Ray's C++ core ends it first. Its parent, `raybench run` in the
    # job, records the stop.
    held = tmp_path / "held"
    held.touch()
    sweep, store = _idle_sweep(tmp_path, [tmp_path / "free-1", held, tmp_path / "free-2"]), tmp_path / "store"
    started = time.monotonic()
    submit = subprocess.Popen([*RAYBENCH, "slurm", "submit", str(sweep), "--store", str(store), "--wait",
                               *_options(1)], env=slurm2, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job_id = _job_id_from_squeue(slurm2, f"raybench-{SWEEP}")
        assert job_id, "the job never ran"
        # 20-60 s alone or under load; a wait that runs out says what the job was doing instead.
        _wait_for(lambda: _idle_trials_running(job_id) == 1 and _stored(store) == 1, 300, "the held trial never ran",
                  lambda: _job_seen(slurm2, job_id, store))
        driver = _sweep_driver_in(job_id)
        driver.suspend()
        subprocess.run(["scancel", "--signal=TERM", "--full", job_id], env=slurm2, check=True)
        stopped = time.monotonic()
        _wait_for(lambda: not [p for p in job_processes(job_id) if _name(p) == "gcs_server"], 15,
                  "the Ray head outlived SIGTERM")
        assert driver.status() == psutil.STATUS_STOPPED  # SLURM did not thaw it
        driver.kill()
    finally:
        stdout, stderr = submit.communicate(timeout=180)
    job_s = time.monotonic() - stopped
    print(stdout, stderr)
    assert submit.returncode == 1 and "ended before the sweep finished" in stderr, stderr
    # The job's pre-flight ran before its sweep: its verdict among the sweep's own lines, its row in the store.
    said = stderr.split("its log ends:")[0]
    assert "raybench: pre-flight: all 1 node(s) within 80% of the fastest of their kind" in said, stderr
    checks = duckdb.sql(f"select cluster, job_id, slow from '{store / 'cluster-health' / '*.parquet'}'").fetchall()
    assert checks == [(f"job {job_id}", job_id, False)], checks
    log = _job_log(slurm2)
    assert "interrupted (received signal 15); of 3 trials: 1 interrupted, 1 ok, 1 not started" in log, log[-3000:]
    assert "the sweep's driver ended without a word (exit status -9)" in log  # said by its parent
    attempts = _attempts(store)
    latest = list(_latest(attempts).values())
    assert [a["status"] for a in latest] == ["ok", "interrupted"], attempts  # the third never started
    ok, interrupted = latest
    assert interrupted["message"].startswith("the sweep was stopped while this trial ran (received signal 15)")
    assert "ok" not in {a["status"] for a in attempts if a["trial_id"] == interrupted["trial_id"]}
    _wait_for(lambda: not job_processes(job_id), 30, "processes of the stopped job are left")
    print(f"FIGURES one-shot driver killed at the stop: faults 1, `submit --wait` returned {job_s:.1f} s after "
          f"SIGTERM, rows expected 2 (1 ok, 1 interrupted), rows found {len(attempts)} ({_statuses(attempts)}); "
          f"{time.monotonic() - started:.0f} s wall")
    if not resubmitted:
        return
    held.unlink()
    again = raybench_cli(slurm2, "slurm", "submit", str(sweep), "--store", str(store), "--wait", *_options(1))
    assert again.returncode == 0, again.stderr
    ok_rows = _resumed_exactly(store, attempts, ok["trial_id"])
    print(f"FIGURES one-shot driver killed at the stop, resubmitted: rows expected 3, after resubmission "
          f"{len(ok_rows)} ok, duplicate ok rows {len(ok_rows) - len(set(ok_rows))}; "
          f"{time.monotonic() - started:.0f} s wall")


def _sweep_driver_in(job_id: str) -> psutil.Process:
    """The process of a one-shot job that drives its sweep: the child of the job's `raybench run`, or that `run`
    itself should it run in one process."""
    runs = {p.pid: p for p in job_processes(job_id) if _cmdline(p)[1:4] == ["-m", "raybench", "run"]}
    children = [p for p in runs.values() if p.ppid() in runs]
    assert len(children or runs) == 1, [_cmdline(p) for p in runs.values()]
    return (children or list(runs.values()))[0]


def _job_id_from_squeue(env: dict, name: str, timeout: float = 60) -> str | None:
    """The id of the running job named `name` (the one `slurm submit` just made)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "--noheader", "--format=%i %j %T"], env=env, capture_output=True,
                             text=True).stdout.splitlines()
        job_id = next((line.split()[0] for line in out if name in line and "RUNNING" in line), None)
        if job_id:
            return job_id
        time.sleep(0.5)
    return None


def _wait_for(ready, timeout: float, what: str, state=None) -> None:
    """Wait until ready(); past the timeout, fail with what was awaited and, from state(), what was seen instead."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what} after {timeout:.0f} s" + (f"; {state()}" if state else "")
        time.sleep(0.3)


def _job_seen(env: dict, job_id: str, store: Path) -> str:
    """What a wait on a job saw: its SLURM state, its processes by name, the rows stored and its log's tail."""
    names = collections.Counter(_name(p) for p in job_processes(job_id))
    logs = list(Path(env["RAYBENCH_HOME"]).glob(f"*/*/slurm-{job_id}.out"))  # a one-shot job's or a cluster's
    log = logs[0].read_text(errors="replace")[-2000:] if logs else "(no job log)"
    return (f"job {job_id} {_job_state(env, job_id) or 'gone'}, idle trials running {_idle_trials_running(job_id)}, "
            f"row files {_stored(store)}, processes {dict(names)}; job log's tail:\n{log}")


def _idle_trials_running(job_id: str) -> int:
    return sum("idle_trial.py" in " ".join(_cmdline(p)) for p in job_processes(job_id))


def _kill_head_node(job_id: str) -> list[str]:
    """kill -9 every process of the job on the head node (rbnode1), as the node's death would end them: the batch
    script and `raybench run` under it, the Ray head's GCS, raylet and workers, the trials' processes there.
    SLURM's own daemons stay (they stand for the controller's view of the node)."""
    victims = [p for p in job_processes(job_id) if _environ(p).get("SLURMD_NODENAME") == f"{NODE_PREFIX}1"
               and _name(p) not in ("slurmstepd", "slurmd", "")]
    names = sorted({_name(p) for p in victims})
    for proc in victims:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return names


@pytest.mark.slow  # ~90 s; the default run keeps the worker node's loss
def test_head_node_dies_with_the_driver_then_resubmission_runs_exactly_the_missing_trials(slurm2, tmp_path):
    # Three idle trials on two nodes, two at a time: the first ends in seconds; the second and third are held
    # (one per node) when the head node dies under them.
    holds, sweep, store = _free_then_two_held(tmp_path)
    started = time.monotonic()
    submit = subprocess.Popen([*RAYBENCH, "slurm", "submit", str(sweep), "--store", str(store), "--wait",
                               *_options(2)], env=slurm2, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        job_id = _job_id_from_squeue(slurm2, f"raybench-{SWEEP}")
        assert job_id, "the job never ran"
        _wait_for(lambda: len(_attempts(store)) == 1 if (store / f"sweep={SWEEP}").is_dir() else False, 180,
                  "the first trial stored no row", lambda: _job_seen(slurm2, job_id, store))
        _wait_for(lambda: _idle_trials_running(job_id) == 2, 120, "the two held trials did not both start",
                  lambda: _job_seen(slurm2, job_id, store))
        killed = _kill_head_node(job_id)
    finally:
        stdout, stderr = submit.communicate(timeout=300)
    print(stdout, stderr)
    assert {"gcs_server", "raylet", "python"} <= set(killed), killed  # the Ray head and `raybench run`
    assert submit.returncode == 1 and "ended before the sweep finished" in stderr, stderr
    # SLURM ends the job (its batch script died) and every process of it, node 2's raylet included; the head's
    # Ray files stay behind (nothing of the head ran its cleanup) until the next job on the node reaps them.
    _wait_for(lambda: not job_processes(job_id), 90, "processes of the dead job are left")
    leftovers = sorted(p.name for p in Path("/tmp").glob(f"rbs-{job_id}-*"))
    # Ray's agents outlive their killed raylet by about a minute (holding the dead job's ports), out of SLURM's
    # sight: they no longer count as the job's processes.
    agents = sorted(_name(p) for d in leftovers for p in _using(Path("/tmp") / d))

    # The rows written before the head died are intact and read by an independent reader; the trials in flight
    # have no row or one that is not ok.
    attempts = _attempts(store)
    assert [a["status"] for a in attempts][:1] == ["ok"] and attempts[0]["steps_timed"] == IDLE_STEPS - 1
    assert all(a["status"] != "ok" for a in attempts[1:]), attempts
    import pyarrow.parquet as pq
    for path in (store / f"sweep={SWEEP}").glob("*.parquet"):
        assert pq.read_table(path).num_rows == 1  # whole files, none torn

    for hold in holds[1:]:
        hold.unlink()
    again = raybench_cli(slurm2, "slurm", "submit", str(sweep), "--store", str(store), "--wait", *_options(2))
    assert again.returncode == 0, again.stderr
    assert not list(Path("/tmp").glob(f"rbs-{job_id}-*")), "the dead head's Ray files were not reaped"
    assert not [p for p in psutil.process_iter() if _name(p) in agents and f"rbs-{job_id}-" in " ".join(_cmdline(p))]
    if leftovers:
        assert f"removed /tmp/{leftovers[0]}" in _job_log(slurm2)
    ok_rows = _resumed_exactly(store, attempts, attempts[0]["trial_id"])
    print(f"FIGURES head node: faults 1 (killed -9: {', '.join(killed)}), left after the job: {leftovers or 'nothing'} "
          f"used by {agents or 'no process'} (reaped by the next job)"
          f"; rows expected 3, first job {len(attempts)} rows ({len(attempts) - 1} of the cut trials, none ok), "
          f"resubmission added {len(_attempts(store)) - len(attempts)}, ok rows {len(ok_rows)}, duplicate ok rows "
          f"{len(ok_rows) - len(set(ok_rows))}; {time.monotonic() - started:.0f} s wall")


@pytest.mark.slow  # ~150 s (SLURM's least limit is a minute); the default run cancels a warm cluster's allocation
def test_a_warm_clusters_allocation_ends_mid_run_then_a_new_cluster_runs_exactly_the_rest(slurm2, tmp_path):
    # Three idle trials, one at a time on one node: the first ends in seconds, the second is held until the warm
    # cluster's 1-minute limit ends its job (60 to 90 s after it starts), the third never starts.
    held = tmp_path / "held"
    held.touch()
    sweep, store = _idle_sweep(tmp_path, [tmp_path / "free-1", held, tmp_path / "free-2"]), tmp_path / "store"
    started = time.monotonic()
    assert raybench_cli(slurm2, "cluster", "up", "short", "--no-check", *_options(1, "1")).returncode == 0
    job_id = _job_id_of(slurm2, "short")
    try:
        run = raybench_cli(slurm2, "run", str(sweep), "--cluster", "short", "--store", str(store), "--quiet")
        run_ended = time.time()
        status = raybench_cli(slurm2, "cluster", "status", "short")
    finally:
        raybench_cli(slurm2, "cluster", "down", "short")
    job_end = subprocess.run(["squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%e %T"],
                             env=slurm2, capture_output=True, text=True).stdout.split()
    # `run` says at once that the allocation ended (not a minute of reconnecting to a dead head, no traceback),
    # with the tally and the resume hint, and exits non-zero.
    assert run.returncode == 130, run.stderr
    assert f"the allocation of cluster short ended: job {job_id}" in run.stderr
    assert "of 3 trials: 1 interrupted, 1 ok, 1 not started" in run.stderr, run.stderr
    assert "run the same command again to resume" in run.stderr and "cluster up short" in run.stderr
    assert "Traceback" not in run.stderr and "Failed to connect to GCS" not in run.stderr
    assert status.returncode == 1 and "GONE (its allocation ended" in status.stdout, status.stdout

    attempts = _attempts(store)
    latest = list(_latest(attempts).values())
    assert [a["status"] for a in latest] == ["ok", "interrupted"], attempts  # the third never started
    ok, interrupted = latest
    assert ok["steps_timed"] == IDLE_STEPS - 1
    assert interrupted["message"].startswith("the sweep was stopped while this trial ran (the allocation of "
                                             f"cluster short ended: job {job_id}"), interrupted
    assert "ok" not in {a["status"] for a in attempts if a["trial_id"] == interrupted["trial_id"]}

    # A new cluster: the same run runs exactly the held trial and the one never started.
    held.unlink()
    assert raybench_cli(slurm2, "cluster", "up", "short", "--no-check", *_options(1)).returncode == 0
    try:
        again = raybench_cli(slurm2, "run", str(sweep), "--cluster", "short", "--store", str(store), "--quiet")
    finally:
        raybench_cli(slurm2, "cluster", "down", "short")
    assert again.returncode == 0, again.stderr
    ok_rows = _resumed_exactly(store, attempts, ok["trial_id"])
    print(f"FIGURES warm time limit: faults 1 (job {job_id} {job_end}, run exited at "
          f"{time.strftime('%H:%M:%S', time.localtime(run_ended))}), rows expected 3, first run {len(attempts)} rows "
          f"({_statuses(attempts)}), after the new cluster {len(ok_rows)} ok, duplicate ok rows "
          f"{len(ok_rows) - len(set(ok_rows))}; {time.monotonic() - started:.0f} s wall")


def _statuses(attempts: list[dict]) -> str:
    """The attempts in the order they were stored, a failure's message cut short."""
    return ", ".join(a["status"] + (f" {a['message'][:60]!r}" if a["status"] == "error" else "") for a in attempts)


@pytest.mark.parametrize("driver", ["stops itself", "dies without a word"])
def test_a_warm_clusters_allocation_cancelled_mid_run_stops_the_run_at_once(slurm2, tmp_path, driver):
    # The default run's check of the same path as the time limit above, without a minute's wait: scancel ends the
    # warm cluster's allocation while its second trial runs. "dies without a word": the sweep's driver (the child
    # `run --cluster` starts) is frozen before the scancel and killed -9 once SLURM has ended the job, as Ray's own
    # exit ends it when the head's raylet goes first (exit 1, no cleanup): `run` must report and record the same.
    held = tmp_path / "held"
    held.touch()
    sweep, store = _idle_sweep(tmp_path, [tmp_path / "free-1", held, tmp_path / "free-2"]), tmp_path / "store"
    started = time.monotonic()
    assert raybench_cli(slurm2, "cluster", "up", "cut", "--no-check", *_options(1)).returncode == 0
    job_id = _job_id_of(slurm2, "cut")
    try:
        run = subprocess.Popen([*RAYBENCH, "run", str(sweep), "--cluster", "cut", "--store", str(store), "--quiet"],
                               env=slurm2, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_for(lambda: _idle_trials_running(job_id) == 1 and _stored(store) == 1, 180,
                      "the held trial never ran", lambda: _job_seen(slurm2, job_id, store))
            if driver == "dies without a word":
                sweep_driver = _sweep_driver_of(run.pid)
                sweep_driver.suspend()
            subprocess.run(["scancel", job_id], env=slurm2, check=True)
            cancelled = time.monotonic()
            if driver == "dies without a word":
                _wait_for(lambda: _job_state(slurm2, job_id) != "RUNNING", 60, "SLURM never ended the job")
                sweep_driver.kill()
        finally:
            stdout, stderr = run.communicate(timeout=120)
        run_exit_s = time.monotonic() - cancelled
        print(stdout, stderr)
        status = raybench_cli(slurm2, "cluster", "status", "cut")
    finally:
        raybench_cli(slurm2, "cluster", "down", "cut")
    assert run.returncode == 130, stderr
    assert f"the allocation of cluster cut ended: job {job_id}" in stderr and "cluster up cut" in stderr
    assert "of 3 trials: 1 interrupted, 1 ok, 1 not started" in stderr and "Traceback" not in stderr
    assert run_exit_s < 20, run_exit_s  # at once: SLURM's signal, a 2 s poll, a 3 s grace; not a minute
    assert status.returncode == 1 and "GONE (its allocation ended" in status.stdout, status.stdout
    attempts = _attempts(store)
    latest = list(_latest(attempts).values())
    assert [a["status"] for a in latest] == ["ok", "interrupted"], attempts
    assert "ok" not in {a["status"] for a in attempts if a["trial_id"] == latest[1]["trial_id"]}
    print(f"FIGURES warm scancel: faults 1, run exited {run_exit_s:.1f} s after scancel, rows expected 2 (1 ok, "
          f"1 interrupted), rows found {len(attempts)} ({_statuses(attempts)}); {time.monotonic() - started:.0f} s wall")


def _sweep_driver_of(pid: int) -> psutil.Process:
    """The child that `run --cluster` (pid) runs the sweep's driver in."""
    _wait_for(lambda: psutil.Process(pid).children(), 10, "run --cluster started no child")
    [child] = psutil.Process(pid).children()
    return child


def _job_state(env: dict, job_id: str) -> str:
    return subprocess.run(["squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T"], env=env,
                          capture_output=True, text=True).stdout.strip()


def _using(directory: Path) -> list[psutil.Process]:
    """The processes with a file open in `directory`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if any(f.path.startswith(f"{directory}/") for f in proc.open_files()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _free_then_two_held(tmp_path: Path) -> tuple[list[Path], Path, Path]:
    """Three idle trials: the first ends in seconds, the other two are held until their hold files go."""
    holds = [tmp_path / "free", tmp_path / "held-1", tmp_path / "held-2"]
    for hold in holds[1:]:
        hold.touch()
    return holds, _idle_sweep(tmp_path, holds), tmp_path / "store"


def _stored(store: Path) -> int:
    return len(list((store / f"sweep={SWEEP}").glob("*.parquet")))


@pytest.mark.slow  # ~100 s; the default run keeps the warm cluster cancelled under `run` (the same stop)
def test_a_warm_clusters_head_node_dies_under_run_then_a_new_cluster_runs_exactly_the_rest(slurm2, tmp_path):
    # The head node of a warm cluster dies (every process of the hold job on node 1 killed -9: the batch script, the
    # Ray head) while `run --cluster`, outside the job as on a login node, has two trials running on it.
    holds, sweep, store = _free_then_two_held(tmp_path)
    started = time.monotonic()
    assert raybench_cli(slurm2, "cluster", "up", "headless", "--no-check", *_options(2)).returncode == 0
    job_id = _job_id_of(slurm2, "headless")
    try:
        run = subprocess.Popen([*RAYBENCH, "run", str(sweep), "--cluster", "headless", "--store", str(store),
                                "--quiet"], env=slurm2, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_for(lambda: _idle_trials_running(job_id) == 2 and _stored(store) == 1, 180,
                      "the two held trials did not both run", lambda: _job_seen(slurm2, job_id, store))
            killed = _kill_head_node(job_id)
            killed_at = time.monotonic()
        finally:
            stdout, stderr = run.communicate(timeout=180)
        run_exit_s = time.monotonic() - killed_at
        print(stdout, stderr)
        status = raybench_cli(slurm2, "cluster", "status", "headless")
    finally:
        raybench_cli(slurm2, "cluster", "down", "headless")
    assert {"gcs_server", "raylet"} <= set(killed), killed
    assert run.returncode == 130 and f"the allocation of cluster headless ended: job {job_id}" in stderr, stderr
    assert "of 3 trials: 2 interrupted, 1 ok" in stderr and "Traceback" not in stderr
    assert status.returncode == 1 and "GONE (its allocation ended" in status.stdout, status.stdout
    attempts = _attempts(store)
    latest = list(_latest(attempts).values())
    assert sorted(a["status"] for a in latest) == ["interrupted", "interrupted", "ok"], attempts
    assert [a["status"] for a in attempts if a["status"] == "ok"] == ["ok"]  # no cut trial ever ok

    for hold in holds[1:]:
        hold.unlink()
    assert raybench_cli(slurm2, "cluster", "up", "headless", "--no-check", *_options(2)).returncode == 0
    try:
        again = raybench_cli(slurm2, "run", str(sweep), "--cluster", "headless", "--store", str(store), "--quiet")
    finally:
        raybench_cli(slurm2, "cluster", "down", "headless")
    assert again.returncode == 0, again.stderr
    assert not list(Path("/tmp").glob(f"rbs-{job_id}-*")), "the dead head's Ray files were not reaped"
    ok_rows = _resumed_exactly(store, attempts, attempts[0]["trial_id"])
    print(f"FIGURES warm head node: faults 1 (killed -9: {', '.join(killed)}), run exited {run_exit_s:.1f} s after "
          f"the kill, rows expected 3, first run {len(attempts)} rows ({_statuses(attempts)}), the new cluster added "
          f"{len(_attempts(store)) - len(attempts)}, ok rows {len(ok_rows)}, duplicate ok rows "
          f"{len(ok_rows) - len(set(ok_rows))}; "
          f"{time.monotonic() - started:.0f} s wall")
