"""Real SLURM (Debian slurm-wlm + munge, one node on 127.0.0.1) running real Ray clusters through raybench:
a one-shot `slurm submit`, and a warm `cluster up` that takes two `run --cluster`s, then `cluster down`.

raybench commands run as subprocesses, as a user runs them: `run --cluster` must put the cluster's token in
the environment before Ray is imported, which this test process did long ago.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from raybench import read_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_cluster import missing_reason, slurm_cluster  # noqa: E402

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
RAYBENCH = [sys.executable, "-m", "raybench"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Environment for SLURM clients and raybench: a private SLURM_CONF and RAYBENCH_HOME."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with slurm_cluster() as env:
        env["RAYBENCH_HOME"] = str(tmp_path_factory.mktemp("raybench-home"))
        yield env


def _free_port_block(size: int = 1000) -> int:
    """A Ray base port whose first few ports are free (the node's block is port … port+999)."""
    for _ in range(50):
        base = random.randrange(20000, 60000, 1000)
        try:
            for port in (base, base + 1, base + 2, base + 7, base + 8):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block")


def _sweep(path: Path, strategies: list[str], executor: str = "train") -> Path:
    """The shipped smoke sweep cut down to one trial per strategy (ac_ratio 0) to keep the test short."""
    spec = yaml.safe_load((REPO / "sweeps" / "smoke-cpu.yaml").read_text())
    spec["axes"] = {"train.strategy": strategies}
    spec["executor"] = executor
    path.write_text(yaml.safe_dump(spec))
    return path


def _raybench(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([*RAYBENCH, *args], env=env, capture_output=True, text=True, timeout=timeout)
    print(done.stdout, done.stderr, sep="\n")
    return done


def _slurm_options() -> list[str]:
    return ["--cpus-per-node", str(os.cpu_count()), "--time", "20", "--port", str(_free_port_block())]


def _job_processes(job_id: str) -> list[psutil.Process]:
    """Every process SLURM started for this job (they all carry its SLURM_JOB_ID), Ray's included."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SLURM_JOB_ID") == job_id:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _squeue(env: dict) -> str:
    return subprocess.run(["squeue", "--noheader", "--states=all"], env=env, capture_output=True,
                          text=True).stdout.strip()


def test_bad_input_submits_nothing(slurm, tmp_path):
    bad = REPO / "tests" / "data" / "bad_sweeps" / "ac_ratio_above_one.yaml"
    done = _raybench(slurm, "slurm", "submit", str(bad), "--wait")
    assert done.returncode == 2 and "nothing was launched" in done.stderr
    done = _raybench(slurm, "slurm", "submit", str(_sweep(tmp_path / "s.yaml", ["ddp"])), "--nodes", "0",
                     "--time", "1h")
    assert done.returncode == 2
    assert "--nodes = 0" in done.stderr and "--time = '1h'" in done.stderr
    done = _raybench(slurm, "cluster", "up", "bad/name")
    assert done.returncode == 2 and "NAME = 'bad/name'" in done.stderr
    assert _squeue(slurm) == ""
    assert not (Path(slurm["RAYBENCH_HOME"]) / "jobs").exists()


def test_cluster_whose_ray_cannot_start_reports_the_job_log(slurm):
    # A container wrapper that cannot run anything: the head never starts; `up` says so with the job's log.
    done = _raybench(slurm, "cluster", "up", "broken", "--container-cmd", "/bin/false", *_slurm_options())
    assert done.returncode == 1 and "the Ray head failed to start" in done.stderr
    status = _raybench(slurm, "cluster", "status", "broken")
    assert status.returncode == 1 and "GONE" in status.stdout
    assert _raybench(slurm, "cluster", "down", "broken").returncode == 0


def test_submit_runs_the_sweep_and_lands_ok_rows(slurm, tmp_path):
    sweep, store = _sweep(tmp_path / "smoke1.yaml", ["fsdp2"]), tmp_path / "store"
    done = _raybench(slurm, "slurm", "submit", str(sweep), "--store", str(store), "--wait", *_slurm_options())
    assert done.returncode == 0, done.stderr
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)
    rows = read_results(str(store), "smoke-cpu")
    assert list(rows.status) == ["ok"] and list(rows.executor) == ["train"] and list(rows.train_strategy) == ["fsdp2"]
    assert _job_processes(job_id) == []
    assert not list(Path("/tmp").glob(f"rbs-{job_id}-*"))


def test_warm_cluster_takes_two_runs_then_goes_down_leaving_nothing(slurm, tmp_path):
    done = _raybench(slurm, "cluster", "up", "warm", *_slurm_options())
    assert done.returncode == 0, done.stderr
    record_path = Path(slurm["RAYBENCH_HOME"]) / "clusters" / "warm.json"
    record = json.loads(record_path.read_text())
    assert stat.S_IMODE(record_path.stat().st_mode) == 0o600  # it holds the token
    job_id = record["job_id"]
    names = {p.name() for p in _job_processes(job_id)}
    assert {"raylet", "gcs_server"} <= names, names

    status = _raybench(slurm, "cluster", "status", "warm", "--json")
    assert json.loads(status.stdout)["state"] == "RUNNING"
    again = _raybench(slurm, "cluster", "up", "warm", *_slurm_options())  # a live name is not taken twice
    assert again.returncode == 2 and f"already up (job {job_id})" in again.stderr
    live = [line for line in _squeue(slurm).splitlines() if line.split()[4] in ("R", "PD", "CF")]
    assert len(live) == 1  # earlier tests' ended jobs may still be listed (CD, F)
    store = tmp_path / "store"
    # Two sweeps, one after the other, on the same warm cluster and its warm pool (detached actors, which
    # `down` must take down too).
    for strategy in ("ddp", "fsdp2"):
        sweep = _sweep(tmp_path / f"{strategy}.yaml", [strategy], executor="pool")
        done = _raybench(slurm, "run", str(sweep), "--cluster", "warm", "--store", str(store), "--quiet")
        assert done.returncode == 0, done.stderr
    rows = read_results(str(store), "smoke-cpu").sort_values("ended_at")
    assert list(rows.train_strategy) == ["ddp", "fsdp2"] and set(rows.status) == {"ok"}
    assert list(rows.process_trial_index) == [0, 1]  # the second sweep's trial ran in the first one's actors

    done = _raybench(slurm, "cluster", "down", "warm")
    assert done.returncode == 0, done.stderr
    # SLURM reports the job CANCELLED at once and signals its processes asynchronously (KillWait): on a busy
    # host the last Ray processes take some seconds more to exit.
    deadline = time.monotonic() + 60
    while _job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(1)
    assert _job_processes(job_id) == []
    assert not list(Path("/tmp").glob(f"rbs-{job_id}-*"))
    assert not record_path.exists()
    assert _raybench(slurm, "run", str(sweep), "--cluster", "warm").returncode == 2


@pytest.mark.slow
def test_two_node_cluster_spreads_a_trial_over_both_nodes(tmp_path):
    """Two slurmd on this host make a 2-node allocation: head on one, a Ray worker node on the other."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    spec = yaml.safe_load((REPO / "sweeps" / "smoke-cpu.yaml").read_text())
    spec["axes"] = {"train.strategy": ["ddp"]}
    spec["resources"]["cpus_per_worker"] = os.cpu_count()  # one rank fills a node: the ranks must spread
    sweep, store = tmp_path / "spread.yaml", tmp_path / "store"
    sweep.write_text(yaml.safe_dump(spec))
    with slurm_cluster(nodes=2) as env:
        env["RAYBENCH_HOME"] = str(tmp_path / "home")
        assert _raybench(env, "cluster", "up", "two", "--nodes", "2", *_slurm_options()).returncode == 0
        job_id = json.loads((tmp_path / "home" / "clusters" / "two.json").read_text())["job_id"]
        assert [p.name() for p in _job_processes(job_id)].count("raylet") == 2
        done = _raybench(env, "run", str(sweep), "--cluster", "two", "--store", str(store), "--quiet")
        assert done.returncode == 0, done.stderr
        assert _raybench(env, "cluster", "down", "two").returncode == 0
        assert _job_processes(job_id) == []
    rows = read_results(str(store), "smoke-cpu")
    assert list(rows.status) == ["ok"] and list(rows.world_size) == [2]
