"""`raybench slurm submit --requeue --wait` on the real SLURM of the tests (one slurmd on 127.0.0.1): a sweep longer
than its allocation completes across several allocations of one job, every trial stored ok once, read back with
duckdb; and a `scontrol requeue` from outside (what preemption does) mid-trial is handled the same way.

The trials wait instead of computing (a command stack whose steps sleep, timed by raybench's probe): the host has
2 cores. SLURM holds a requeued job for its credential lifetime before it may start again (cred_expire, 120 s by
default); the test's SLURM sets 30 s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import psutil
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_cluster import RAYBENCH, free_port_block, job_processes, raybench_slurm  # noqa: E402


pytestmark = pytest.mark.integration
SWEEP = "requeue"
STEPS, WARMUP = 10, 1
IDLE_TRAIN = '''\
"""A trial that waits instead of computing: each optimizer step sleeps, timed by raybench's probe."""
import argparse
import time

from raybench.runtime.probe import StepProbe

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--step-s", type=float, required=True)
args = parser.parse_args()
probe = StepProbe()
probe.start()
for _ in range(args.steps):
    time.sleep(args.step_s)
    probe.step(tokens=64)
probe.finish()
'''


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with raybench_slurm(tmp_path_factory.mktemp("raybench-home"), cred_expire_s=30) as env:
        yield env


def _sweep(tmp_path: Path, step_s: list[str], timeout_s: float) -> Path:
    """One trial per step length: STEPS sleeps of that many seconds on one worker that takes the whole node, so
    trials run one at a time."""
    (tmp_path / "idle_train.py").write_text(IDLE_TRAIN)
    spec = {"name": SWEEP, "model": {"preset": "tiny"}, "train": {"steps": STEPS, "warmup_steps": WARMUP},
            "resources": {"workers": 1, "cpus_per_worker": os.cpu_count(), "timeout_s": timeout_s},
            "stack": {"kind": "command", "overrides": {"step_s": step_s[0]},
                      "command": ["{python}", "{sweep_dir}/idle_train.py", "--steps", "{steps}", "--step-s",
                                  "{step_s}"]},
            "axes": {"stack.overrides.step_s": step_s}}
    path = tmp_path / "requeue.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _submit(env: dict, sweep: Path, store: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen([*RAYBENCH, "slurm", "submit", str(sweep), "--store", str(store), "--requeue", "--wait",
                             "--cpus-per-node", str(os.cpu_count()), "--port", str(free_port_block()), *options],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _attempts(store: Path) -> list[dict]:
    """Every stored attempt of the sweep, oldest first, read by duckdb straight from the Parquet files."""
    files = str(store / f"sweep={SWEEP}" / "*.parquet")
    cursor = duckdb.connect().execute(
        f"select trial_id, status, message, steps_timed, epoch_ms(ended_at) as ended_ms "
        f"from read_parquet('{files}', union_by_name=true) order by ended_ms")
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row)) for row in cursor.fetchall()]


def _check_complete(attempts: list[dict], trials: int, cut: frozenset = frozenset({"interrupted"})) -> dict:
    """Every trial ok exactly once and ok last, over whole timed windows; the rest (`cut`: the statuses a stopped
    trial may have) `interrupted` with no figures."""
    ok = [a["trial_id"] for a in attempts if a["status"] == "ok"]
    assert len(ok) == len(set(ok)) == trials, attempts  # complete, none twice
    assert {a["status"] for a in attempts} <= {"ok", *cut}, attempts
    assert all(a["steps_timed"] is None for a in attempts if a["status"] != "ok"), attempts
    assert all(a["steps_timed"] == STEPS - WARMUP for a in attempts if a["status"] == "ok")
    interrupted = [a for a in attempts if a["status"] == "interrupted"]
    assert all("the sweep was stopped while this trial ran" in a["message"] and a["steps_timed"] is None
               for a in interrupted), interrupted
    assert {a["trial_id"]: a["status"] for a in attempts} == {t: "ok" for t in ok}  # the latest attempt is ok
    return {"ok": len(ok), "interrupted": len(interrupted), "duplicates": len(ok) - len(set(ok)),
            "error": sum(a["status"] == "error" for a in attempts)}


def _finish(submit: subprocess.Popen, timeout: float, read: str = "") -> tuple[str, str, str, Path]:
    """The submit command's output once it has returned (`read`: what was read of it already); the job id and
    directory it named."""
    stdout, stderr = submit.communicate(timeout=timeout)
    stdout = read + stdout
    print(stdout, stderr, sep="\n")
    found = re.search(r"submitted job (\d+); script, log and token in (\S+)", stdout)
    assert found, (stdout, stderr)
    return stdout, stderr, found.group(1), Path(found.group(2))


def _allocations(job_dir: Path) -> int:
    """How many times the job started: each allocation logs one line (the log is appended to across requeues)."""
    return sum(len(re.findall(r"raybench: allocation \d+ of job", p.read_text())) for p in job_dir.glob("slurm-*.out"))


def _nothing_left(job_id: str) -> None:
    deadline = time.monotonic() + 60  # SLURM signals the last processes asynchronously (KillWait)
    while job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(1)
    assert job_processes(job_id) == []
    assert not list(Path("/tmp").glob(f"rbs-{job_id}-*"))


@pytest.mark.slow
def test_scontrol_requeue_mid_trial_then_the_next_allocation_completes_the_sweep(slurm, tmp_path):
    # Two trials of ~15 s of waiting; a 10-minute limit, so only the requeue from outside cuts the first allocation.
    sweep, store = _sweep(tmp_path, ["1.5", "1.6"], timeout_s=120), tmp_path / "store"
    submit = _submit(slurm, sweep, store, "--time", "10")
    first_line = submit.stdout.readline()
    job_id = re.search(r"submitted job (\d+)", first_line).group(1)
    deadline, trial = time.monotonic() + 300, []
    while not trial and time.monotonic() < deadline and submit.poll() is None:
        trial = [p for p in job_processes(job_id) if "idle_train.py" in " ".join(_cmdline(p))]
        time.sleep(0.5)
    assert trial, "no trial ever ran"
    time.sleep(4)  # mid-trial: a few of its steps done
    requeued = subprocess.run(["scontrol", "requeue", job_id], env=slurm, capture_output=True, text=True)
    assert requeued.returncode == 0, requeued.stderr
    stdout, stderr, _, job_dir = _finish(submit, timeout=600, read=first_line)
    assert submit.returncode == 0 and "the sweep exited 0" in stdout, stderr
    assert f"job {job_id}: PENDING" in stdout  # --wait saw it requeued and went on waiting
    attempts = _attempts(store)
    # SLURM signals every process of the job at once: a trial's workers may die before the driver's handler runs,
    # and their failure row is then superseded by a second `interrupted` row (sweep.record_interrupted). The last
    # word on a stopped attempt is `interrupted`, never error; the next allocation runs it again.
    counts = _check_complete(attempts, trials=2, cut=frozenset({"interrupted", "error"}))
    for trial in {a["trial_id"] for a in attempts}:
        statuses = [a["status"] for a in attempts if a["trial_id"] == trial]
        cut = statuses[:statuses.index("ok")]
        assert not cut or cut[-1] == "interrupted", statuses
    assert _allocations(job_dir) == 2
    _nothing_left(job_id)
    print(f"FIGURES scontrol requeue: faults 1, allocations {_allocations(job_dir)}, rows expected 2, "
          f"rows found {len(attempts)} ({counts['ok']} ok, {counts['interrupted']} interrupted, {counts['error']} "
          f"error), duplicate ok rows {counts['duplicates']}")


@pytest.mark.slow
def test_a_sweep_longer_than_its_allocation_completes_across_three(slurm, tmp_path):
    # Three trials of ~48 s (10 sleeps of ~4.5 s, and the command's start), one at a time; a 2-minute limit, the job
    # stopping its sweep 30 s before it: after 12-25 s of start-up one trial fits an allocation, never two. The
    # bound: timeout_s 60 + start-up 30 + 30 = 120 s, the limit.
    sweep, store = _sweep(tmp_path, ["4.4", "4.5", "4.6"], timeout_s=60), tmp_path / "store"
    started = time.monotonic()
    submit = _submit(slurm, sweep, store, "--time", "2", "--signal-time", "30")
    stdout, stderr, job_id, job_dir = _finish(submit, timeout=1500)
    took_s = time.monotonic() - started
    assert submit.returncode == 0 and "the sweep exited 0" in stdout, stderr
    attempts = _attempts(store)
    counts = _check_complete(attempts, trials=3)
    allocations = _allocations(job_dir)
    assert allocations >= 3, allocations
    log = "\n".join(p.read_text() for p in job_dir.glob("slurm-*.out"))
    assert log.count("30 s before the time limit: the sweep stops and goes on in the job's next allocation") == allocations - 1
    _nothing_left(job_id)
    print(f"FIGURES requeue until done: allocations {allocations} ({allocations - 1} requeues by the job), "
          f"rows expected 3, rows found {len(attempts)} ({counts['ok']} ok, {counts['interrupted']} interrupted), "
          f"duplicate ok rows {counts['duplicates']}, {took_s:.0f} s from submit to the sweep's end")


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []
