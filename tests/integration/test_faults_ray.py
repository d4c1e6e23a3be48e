"""Faults of a real Ray sweep (`raybench run` in a subprocess, embedded Ray): a hung Ray Train trial, a killed
Ray Train worker, SIGTERM and kill -9 of the driver followed by a resume. Each sweep keeps to a few trials.
What ended Ray Train trials leave behind is checked in test_faults_ray_leftovers.py (a file of its own, so that it can
run in another test process than the driver's kill and resume)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from raybench.drivers.ray_cluster import OWNER_FILE, TEMP_ROOT
from raybench.results import store

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path, body: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"name: faults\nmodel: {{preset: tiny}}\nstore: {tmp_path / 'store'}\n{body}")
    return path


def _start(sweep: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.Popen([sys.executable, "-m", "raybench", "run", str(sweep)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_line(proc: subprocess.Popen, needle: str, limit_s: float = 240) -> list[str]:
    """Read the driver's output (blocking reads, no polling) until a line contains `needle`."""
    lines, deadline = [], time.time() + limit_s
    for line in proc.stdout:
        lines.append(line)
        if needle in line or time.time() > deadline:
            break
    assert any(needle in line for line in lines), "".join(lines[-30:])
    return lines


def _finish(proc: subprocess.Popen, limit_s: float = 300) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the driver shuts its Ray down; never leave it running
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"sweep still running after {limit_s} s:\n{out[-3000:]}") from None
    return proc.returncode, out


def _temp_dirs_of(pid: int) -> set[Path]:
    """Embedded-Ray temp dirs owned by raybench process `pid` (other raybench runs on the host are ignored)."""
    found = set()
    for p in Path(TEMP_ROOT).glob("rb-*"):
        try:
            if (p / OWNER_FILE).read_text().split()[0] == str(pid):
                found.add(p)
        except (OSError, IndexError):
            continue
    return found


def _rows(tmp_path):
    return store.read_results(tmp_path / "store", "faults", latest=False)


def _assert_complete_once(tmp_path, planned: int):
    rows = _rows(tmp_path)
    ok = rows[rows.status == "ok"]
    assert ok.trial_id.nunique() == planned and len(ok) == planned, rows[["trial_id", "status", "message"]]
    assert len(store.read_results(tmp_path / "store", "faults")) == planned


TORCHRUN_SWEEP = """executor: torchrun
train: {steps: 4, warmup_steps: 1, seq_len: 32, precision: fp32}
resources: {workers: 2, timeout_s: 120}
axes: {train.seed: [0, 1]}
"""


@pytest.mark.slow  # ~45 s; resume after a dead driver stays in the default run (kill -9 below)
def test_sigterm_flushes_rows_then_resume_completes(tmp_path):
    sweep = _write(tmp_path, TORCHRUN_SWEEP)
    proc = _start(sweep)
    _wait_for_line(proc, "[1/2]")
    assert len(_temp_dirs_of(proc.pid)) == 1
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    code, out = _finish(proc, 60)
    assert code == 130 and "run the same command again" in out, out[-2000:]
    assert time.perf_counter() - t0 < 30  # prompt
    stored = _rows(tmp_path)
    # The finished row kept, nothing half-made: the trial that was running (if Tune had started it) is
    # `interrupted`, never a partial ok.
    assert sorted(stored.status) in (["ok"], ["interrupted", "ok"]), stored[["status", "message"]]
    assert not _temp_dirs_of(proc.pid)  # its embedded Ray was shut down and its temp dir removed
    code, out = _finish(_start(sweep))
    assert code == 0, out[-3000:]
    assert "1 trial(s) already stored as ok" in out
    _assert_complete_once(tmp_path, 2)


def test_kill_driver_then_resume_completes_without_duplicates(tmp_path):
    sweep = _write(tmp_path, TORCHRUN_SWEEP)
    proc = _start(sweep)
    _wait_for_line(proc, "[1/2]")
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    proc.kill()  # kill -9: no handler, no finally
    proc.wait()
    orphaned = _temp_dirs_of(proc.pid)
    assert len(orphaned) == 1  # the dead driver's embedded Ray left its temp dir behind
    code, out = _finish(_start(sweep))
    assert code == 0, out[-3000:]
    _assert_complete_once(tmp_path, 2)
    assert not any(d.exists() for d in orphaned)  # the next run reaped it ...
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, alive  # ... and no process of the killed run survives (Ray agents, torchrun, ranks)


@pytest.mark.slow  # ~55 s; the timeout path stays in the default run through torchrun (test_faults_torchrun)
def test_timeout_ray_train_trial_frees_its_workers(tmp_path):
    # Each trial needs both CPUs: the second can only start once the timed-out one gave its workers back.
    sweep = _write(tmp_path, """executor: train
train: {warmup_steps: 1, seq_len: 32, precision: fp32}
resources: {workers: 2}
axes: {train.steps: [1000000, 4], resources.timeout_s: [25, 150]}
exclude: [{train.steps: 1000000, resources.timeout_s: 150}, {train.steps: 4, resources.timeout_s: 25}]
""")
    t0 = time.perf_counter()
    code, out = _finish(_start(sweep))
    assert code == 1, out[-3000:]
    rows = store.read_results(tmp_path / "store", "faults").set_index("train_steps")
    assert rows.loc[1000000, "status"] == "timeout" and "timeout_s=25" in rows.loc[1000000, "message"]
    assert rows.loc[4, "status"] == "ok", rows.loc[4, "message"]
    assert time.perf_counter() - t0 < 200


# Slow (~60 s). It once failed under load: a worker killed while Train started its group leaked the group's
# placement group, and the next trial waited for CPUs until its timeout (fixed: executors.train.orphan_reaper).
@pytest.mark.slow
def test_kill_ray_train_worker_gives_error_row_and_sweep_continues(tmp_path):
    sweep = _write(tmp_path, """executor: train
train: {warmup_steps: 1, seq_len: 32, precision: fp32}
resources: {workers: 2, timeout_s: 150}
axes: {train.steps: [1000000, 4]}
""")
    proc = _start(sweep)
    victim = _wait_for_train_worker(proc.pid)
    time.sleep(3)  # let it get into the training loop
    victim.kill()
    code, out = _finish(proc)
    assert code == 1, out[-3000:]
    rows = store.read_results(tmp_path / "store", "faults").set_index("train_steps")
    assert rows.loc[1000000, "status"] == "error" and rows.loc[1000000, "message"]
    assert rows.loc[4, "status"] == "ok", (rows.loc[1000000, "message"], rows.loc[4, "message"], out[-3000:])
    assert len(_rows(tmp_path)) == 2


def _wait_for_train_worker(driver_pid: int, limit_s: float = 120) -> psutil.Process:
    """A Ray Train worker process of this driver's embedded Ray (found through its process tree)."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        for p in psutil.Process(driver_pid).children(recursive=True):
            with_name = _safe_name(p)
            if with_name.startswith("ray::RayTrainWorker"):
                return p
        time.sleep(0.5)  # the worker appears after Ray and Tune start; a half-second poll of the table
    raise AssertionError("no Ray Train worker appeared")


def _safe_name(p: psutil.Process) -> str:
    try:
        return p.name() if p.name().startswith("ray::") else " ".join(p.cmdline())
    except psutil.Error:
        return ""
