"""Real SLURM (Debian slurm-wlm + munge, one node on 127.0.0.1) running real Ray clusters through raybench:
a one-shot `slurm submit`, and a warm `cluster up` that takes two `run --cluster`s, then `cluster down`.

raybench commands run as subprocesses, as a user runs them: `run --cluster` must put the cluster's token in
the environment before Ray is imported, which this test process did long ago.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from raybench import read_results
from raybench.results import health

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_cluster import (free_port_block, job_processes, missing_reason, raybench_cli,  # noqa: E402
                           raybench_slurm, slurm_cluster)

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Environment for SLURM clients and raybench: a private SLURM_CONF and RAYBENCH_HOME."""
    with raybench_slurm(tmp_path_factory.mktemp("raybench-home")) as env:
        yield env


def _sweep(path: Path, strategies: list[str], executor: str = "train") -> Path:
    """The shipped smoke sweep cut down to one trial per strategy (ac_ratio 0) to keep the test short."""
    spec = yaml.safe_load((REPO / "sweeps" / "smoke-cpu.yaml").read_text())
    spec["axes"] = {"train.strategy": strategies}
    spec["executor"] = executor
    path.write_text(yaml.safe_dump(spec))
    return path


def _slurm_options() -> list[str]:
    return ["--cpus-per-node", str(os.cpu_count()), "--time", "20", "--port", str(free_port_block())]


def _squeue(env: dict) -> str:
    return subprocess.run(["squeue", "--noheader", "--states=all"], env=env, capture_output=True,
                          text=True).stdout.strip()


def test_bad_input_submits_nothing(slurm, tmp_path):
    bad = REPO / "tests" / "data" / "bad_sweeps" / "ac_ratio_above_one.yaml"
    done = raybench_cli(slurm, "slurm", "submit", str(bad), "--wait")
    assert done.returncode == 2 and "nothing was launched" in done.stderr
    done = raybench_cli(slurm, "slurm", "submit", str(_sweep(tmp_path / "s.yaml", ["ddp"])), "--nodes", "0",
                     "--time", "1h")
    assert done.returncode == 2
    assert "--nodes = 0" in done.stderr and "--time = '1h'" in done.stderr
    done = raybench_cli(slurm, "cluster", "up", "bad/name")
    assert done.returncode == 2 and "NAME = 'bad/name'" in done.stderr
    assert _squeue(slurm) == ""
    assert not (Path(slurm["RAYBENCH_HOME"]) / "jobs").exists()


def test_cluster_whose_ray_cannot_start_reports_the_job_log(slurm):
    # A container wrapper that cannot run anything: the head never starts; `up` says so with the job's log.
    done = raybench_cli(slurm, "cluster", "up", "broken", "--container-cmd", "/bin/false", *_slurm_options())
    assert done.returncode == 1 and "the Ray head failed to start" in done.stderr
    status = raybench_cli(slurm, "cluster", "status", "broken")
    assert status.returncode == 1 and "GONE" in status.stdout
    assert raybench_cli(slurm, "cluster", "down", "broken").returncode == 0


# Slow (~40-60 s): in the default run, test_cluster_faults.py's time-limit test submits with --wait twice and
# checks the rows and that neither job leaves a process or Ray's files; the warm-cluster test below runs Ray Train
# trials on the job's Ray.
@pytest.mark.slow
def test_submit_runs_the_sweep_and_lands_ok_rows(slurm, tmp_path):
    sweep, store = _sweep(tmp_path / "smoke1.yaml", ["fsdp2"]), tmp_path / "store"
    done = raybench_cli(slurm, "slurm", "submit", str(sweep), "--store", str(store), "--wait", *_slurm_options())
    assert done.returncode == 0, done.stderr
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)
    rows = read_results(str(store), "smoke-cpu")
    assert list(rows.status) == ["ok"] and list(rows.executor) == ["train"] and list(rows.train_strategy) == ["fsdp2"]
    assert job_processes(job_id) == []
    assert not list(Path("/tmp").glob(f"rbs-{job_id}-*"))


def test_warm_cluster_takes_two_runs_then_goes_down_leaving_nothing(slurm, tmp_path):
    store = tmp_path / "store"
    done = raybench_cli(slurm, "cluster", "up", "warm", "--store", str(store), *_slurm_options())
    assert done.returncode == 0, done.stderr
    # Its pre-flight measured the node's CPU and stored the row beside the sweeps' (tests/unit/test_preflight.py
    # checks the judgement; test_cluster_faults.py, with -m slow, a node held back for real).
    assert "pre-flight of cluster warm" in done.stdout and "all 1 node(s) within 80%" in done.stdout, done.stdout
    (check,) = health.read_checks(store).to_pylist()
    assert check["cluster"] == "warm" and check["device"] == "cpu" and check["matmul_tflops"] > 0
    record_path = Path(slurm["RAYBENCH_HOME"]) / "clusters" / "warm.json"
    record = json.loads(record_path.read_text())
    assert stat.S_IMODE(record_path.stat().st_mode) == 0o600  # it holds the token
    job_id = record["job_id"]
    names = {p.name() for p in job_processes(job_id)}
    assert {"raylet", "gcs_server"} <= names, names

    status = raybench_cli(slurm, "cluster", "status", "warm", "--json")
    assert json.loads(status.stdout)["state"] == "RUNNING"
    again = raybench_cli(slurm, "cluster", "up", "warm", *_slurm_options())  # a live name is not taken twice
    assert again.returncode == 2 and f"already up (job {job_id})" in again.stderr
    live = [line for line in _squeue(slurm).splitlines() if line.split()[4] in ("R", "PD", "CF")]
    assert len(live) == 1  # earlier tests' ended jobs may still be listed (CD, F)
    # Two sweeps, one after the other, on the same warm cluster and its warm pool (detached actors, which
    # `down` must take down too).
    for strategy in ("ddp", "fsdp2"):
        sweep = _sweep(tmp_path / f"{strategy}.yaml", [strategy], executor="pool")
        done = raybench_cli(slurm, "run", str(sweep), "--cluster", "warm", "--store", str(store), "--quiet")
        assert done.returncode == 0, done.stderr
    rows = read_results(str(store), "smoke-cpu").sort_values("ended_at")
    assert list(rows.train_strategy) == ["ddp", "fsdp2"] and set(rows.status) == {"ok"}
    assert list(rows.process_trial_index) == [0, 1]  # the second sweep's trial ran in the first one's actors

    done = raybench_cli(slurm, "cluster", "down", "warm")
    assert done.returncode == 0, done.stderr
    # SLURM reports the job CANCELLED at once and signals its processes asynchronously (KillWait): on a busy
    # host the last Ray processes take some seconds more to exit.
    deadline = time.monotonic() + 60
    while job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(1)
    assert job_processes(job_id) == []
    assert not list(Path("/tmp").glob(f"rbs-{job_id}-*"))
    assert not record_path.exists()
    assert raybench_cli(slurm, "run", str(sweep), "--cluster", "warm").returncode == 2


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
        assert raybench_cli(env, "cluster", "up", "two", "--nodes", "2", *_slurm_options()).returncode == 0
        job_id = json.loads((tmp_path / "home" / "clusters" / "two.json").read_text())["job_id"]
        assert [p.name() for p in job_processes(job_id)].count("raylet") == 2
        done = raybench_cli(env, "run", str(sweep), "--cluster", "two", "--store", str(store), "--quiet")
        assert done.returncode == 0, done.stderr
        assert raybench_cli(env, "cluster", "down", "two").returncode == 0
        assert job_processes(job_id) == []
    rows = read_results(str(store), "smoke-cpu")
    assert list(rows.status) == ["ok"] and list(rows.world_size) == [2]


def test_a_taken_port_is_named_and_the_cluster_refused(slurm):
    """`cluster up --port P` with P taken on the node: the node's pre-start check names the port and the fix, `up`
    exits 2 with that line (not Ray's GCS traceback), and its job is over."""
    options = _slurm_options()
    port = int(options[options.index("--port") + 1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        # As a server binds: the block served this process's earlier clusters, whose connections may linger.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("", port))
        taken.listen()
        done = raybench_cli(slurm, "cluster", "up", "taken", *options)
    assert done.returncode == 2
    assert f"raybench: port {port} on " in done.stderr and "--port P" in done.stderr
    assert "Traceback" not in done.stderr
    assert json.loads(raybench_cli(slurm, "cluster", "status", "taken", "--json").stdout)["state"] == "GONE"
