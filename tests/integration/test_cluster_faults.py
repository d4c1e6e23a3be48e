"""What a cluster does to a sweep, on the real 2-node local SLURM of the tests (two slurmd on 127.0.0.1), with the
fault injected for real and the rows read back by an independent reader (duckdb):
- a worker node dies mid-trial (every process of node 2 killed -9), on a warm cluster and on a one-shot job: the
  trial's row is `error` naming the lost node, trials that need both nodes end at once as "not enough nodes",
  trials that fit the remaining node run, the warm cluster stays up and `cluster status` names the lost node, and
  the next run on a healed cluster runs exactly the missing trials;
- the allocation's time limit expires mid-sweep (`--time 1`): finished rows kept, the running trial `interrupted`
  or absent (never ok), and a resubmission completes the sweep with no trial stored ok twice.

Each node has os.cpu_count() CPUs and each worker asks for all of them, so a 2-worker trial spans both nodes.
"""

from __future__ import annotations

import json
import os
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
from slurm_cluster import NODE_PREFIX, missing_reason, slurm_cluster  # noqa: E402

from test_slurm import _free_port_block, _job_processes, _raybench  # noqa: E402

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
RAYBENCH = [sys.executable, "-m", "raybench"]
NODE2 = f"{NODE_PREFIX}2"
SWEEP = "faults"


@pytest.fixture(scope="module")
def slurm2(tmp_path_factory):
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with slurm_cluster(nodes=2) as env:
        env["RAYBENCH_HOME"] = str(tmp_path_factory.mktemp("raybench-home"))
        yield env


def _sweep(path: Path, axes: dict, steps: int = 4) -> Path:
    """The smoke sweep's tiny ddp trial, each worker filling a node; `axes` decide the trials (grid order)."""
    spec = yaml.safe_load((REPO / "sweeps" / "smoke-cpu.yaml").read_text())
    spec.update(name=SWEEP, axes=axes)
    spec["train"].update(strategy="ddp", steps=steps, warmup_steps=1, seq_len=64)
    spec["resources"]["cpus_per_worker"] = os.cpu_count()
    spec["resources"]["timeout_s"] = 600  # a trial that waited for a lost node would show as a 10-minute wait
    path.write_text(yaml.safe_dump(spec))
    return path


def _options(nodes: int, time_limit: str = "20") -> list[str]:
    return ["--nodes", str(nodes), "--cpus-per-node", str(os.cpu_count()), "--time", time_limit,
            "--port", str(_free_port_block())]


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


def _node2_processes(job_id: str) -> list[psutil.Process]:
    return [p for p in _job_processes(job_id) if _environ(p).get("SLURMD_NODENAME") == NODE2
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
    """The 4-trial grid after node 2 died in its first (2-worker) trial."""
    latest = list(_latest(attempts).values())
    by_workers = {w: [a for a in latest if a["resources_workers"] == w] for w in (1, 2)}
    lost, rest = [a for a in by_workers[2] if "was lost during the trial" in a["message"]], by_workers[2]
    assert len(latest) == 4 and len(lost) == 1, latest
    assert lost[0]["status"] == "error" and f"Ray node {NODE2} (" in lost[0]["message"], lost[0]
    short = [a for a in rest if a is not lost[0]]
    assert [a["status"] for a in short] == ["error"] and short[0]["message"].startswith("not enough nodes"), short
    assert NODE2 in short[0]["message"] and short[0]["trial_wall_s"] < 30  # at once, not at timeout_s (600 s)
    assert [a["status"] for a in by_workers[1]] == ["ok", "ok"], by_workers[1]


def test_worker_node_lost_on_a_warm_cluster_then_healed(slurm2, tmp_path):
    sweep, store = _sweep(tmp_path / "s.yaml", {"resources.workers": [2, 1], "train.micro_batch": [1, 2]}), \
        tmp_path / "store"
    assert _raybench(slurm2, "cluster", "up", "faulty", *_options(2)).returncode == 0
    try:
        _node_lost_on_warm_cluster(slurm2, sweep, store)
    finally:  # a failed check must not leave the cluster holding both nodes for the next test
        _raybench(slurm2, "cluster", "down", "faulty")


def _node_lost_on_warm_cluster(slurm2: dict, sweep: Path, store: Path) -> None:
    job_id, killed = _job_id_of(slurm2, "faulty"), {}
    killer = threading.Thread(target=_kill_node2_mid_trial, args=(job_id, killed))
    killer.start()
    done = _raybench(slurm2, "run", str(sweep), "--cluster", "faulty", "--store", str(store), "--quiet")
    killer.join()
    assert killed.get("count"), "no rank ever ran on node 2"
    assert done.returncode == 1, done.stderr  # some trials not ok; the run finished with its table
    attempts = _attempts(store)
    _check_node_loss_rows(attempts)

    status = _raybench(slurm2, "cluster", "status", "faulty")
    assert status.returncode == 0 and "RUNNING" in status.stdout  # up, degraded
    assert f"node {NODE2} (" in status.stdout and "GONE" in status.stdout and "degraded" in status.stdout

    # Healed: a fresh 2-node allocation. The same sweep runs exactly the two trials that were not ok.
    assert _raybench(slurm2, "cluster", "down", "faulty").returncode == 0
    assert _raybench(slurm2, "cluster", "up", "faulty", *_options(2)).returncode == 0
    again = _raybench(slurm2, "run", str(sweep), "--cluster", "faulty", "--store", str(store), "--quiet")
    assert again.returncode == 0, again.stderr
    after = _attempts(store)
    missing = {a["trial_id"] for a in _latest(attempts).values() if a["status"] != "ok"}
    added = [a["trial_id"] for a in after[len(attempts):]]
    assert sorted(added) == sorted(missing) and len(missing) == 2
    assert {a["status"] for a in _latest(after).values()} == {"ok"}
    print(f"FIGURES warm: faults 1 ({killed['count']} processes of {NODE2} killed -9), rows expected 4, "
          f"first run {len(attempts)}, healed run added {len(added)}, latest ok {len(_latest(after))}, "
          f"duplicate ok rows {len([a for a in after if a['status'] == 'ok']) - len(_latest(after))}")


# slow until it has run green once (its first run never started: a leftover cluster held the nodes)
@pytest.mark.slow
def test_worker_node_lost_in_a_one_shot_job(slurm2, tmp_path):
    sweep, store = _sweep(tmp_path / "s.yaml", {"resources.workers": [2, 1], "train.micro_batch": [1, 2]}), \
        tmp_path / "store"
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
    print(f"FIGURES one-shot: faults 1 ({killed['count']} processes of {NODE2} killed -9), rows expected 4, "
          f"rows found {len(attempts)}, duplicates {len(attempts) - len(_latest(attempts))}")


# slow until it has run green once (its first run never started: a leftover cluster held the nodes)
@pytest.mark.slow
def test_time_limit_expires_then_resubmission_completes(slurm2, tmp_path):
    # Six 1-worker trials of ~15 s each after a ~15 s start: longer than the 1-minute limit (SLURM enforces it
    # within 30 s after it passes).
    sweep, store = _sweep(tmp_path / "s.yaml", {"train.micro_batch": [1, 2, 3, 4, 5, 6]}, steps=12), \
        tmp_path / "store"
    sweep_spec = yaml.safe_load(sweep.read_text())
    sweep_spec["resources"]["workers"] = 1
    sweep.write_text(yaml.safe_dump(sweep_spec))
    started = time.monotonic()
    first = _raybench(slurm2, "slurm", "submit", str(sweep), "--store", str(store), "--wait", *_options(1, "1"))
    first_s = time.monotonic() - started
    assert first.returncode == 1 and "ended before the sweep finished" in first.stderr, first.stderr
    attempts = _attempts(store)
    statuses = [a["status"] for a in attempts]
    assert set(statuses) <= {"ok", "interrupted"} and statuses.count("interrupted") <= 1, attempts
    assert 1 <= len(attempts) < 6, attempts  # some finished before the limit, not all
    assert all(a["steps_timed"] == 11 for a in attempts if a["status"] == "ok")  # whole windows only
    interrupted = [a for a in attempts if a["status"] == "interrupted"]
    assert all("the sweep was stopped while this trial ran" in a["message"] for a in interrupted)

    second = _raybench(slurm2, "slurm", "submit", str(sweep), "--store", str(store), "--wait", *_options(1))
    assert second.returncode == 0, second.stderr
    after = _attempts(store)
    ok = [a["trial_id"] for a in after if a["status"] == "ok"]
    assert len(ok) == len(set(ok)) == 6  # complete, none twice
    assert {a["status"] for a in _latest(after).values()} == {"ok"}
    print(f"FIGURES time limit: faults 1 (limit expired after {first_s:.0f} s), rows expected 6, first job "
          f"{statuses.count('ok')} ok + {statuses.count('interrupted')} interrupted, after resubmission "
          f"{len(ok)} ok, duplicate ok rows {len(ok) - len(set(ok))}")
