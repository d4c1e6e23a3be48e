"""Faults of a real Ray sweep (`raybench run` in a subprocess, embedded Ray): a hung Ray Train trial, a killed
Ray Train worker, SIGTERM, and kill -9 of the driver with its Ray head (the head node dies) followed by a resume;
the store's filesystem filling mid-sweep (a tmpfs, as root); two sweeps from two drivers writing one store while
`raybench query` and `report` read it. Each sweep keeps to a few trials.
What ended Ray Train trials leave behind is checked in test_faults_ray_leftovers.py (a file of its own, so that it can
run in another test process than the driver's kill and resume)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import psutil
import pyarrow.parquet as pq
import pytest

from raybench.drivers.ray_cluster import OWNER_FILE, TEMP_ROOT
from raybench.results import store
from tests.tmpfs import fill, mounted_tmpfs

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path, body: str, name: str = "faults") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nmodel: {{preset: tiny}}\nstore: {tmp_path / 'store'}\n{body}")
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


HEAD_PROCESSES = ("gcs_server", "raylet")  # the Ray head itself: its control store and its node manager


def test_kill_driver_and_ray_head_then_resume_completes_without_duplicates(tmp_path):
    # The head node dies: the driver and its Ray head's own processes are killed -9 at once (no handler, no
    # finally, no Ray shutdown). What they leave (Ray's agents and workers, torchrun and its ranks, the temp dir)
    # must die or be reaped, and must not block the next run.
    sweep = _write(tmp_path, TORCHRUN_SWEEP)
    proc = _start(sweep)
    _wait_for_line(proc, "[1/2]")
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    head = [p for p in tree if _process_name(p) in HEAD_PROCESSES]
    assert sorted(_process_name(p) for p in head) == sorted(HEAD_PROCESSES), [_safe_name(p) for p in tree]
    for victim in (proc, *head):
        victim.kill()
    proc.wait()
    orphaned = _temp_dirs_of(proc.pid)
    assert len(orphaned) == 1  # the dead driver's embedded Ray left its temp dir behind
    before = store.result_files(tmp_path / "store", "faults")
    assert before and all(pq.read_table(path).num_rows == 1 for path in before)  # rows written before: whole
    code, out = _finish(_start(sweep))
    assert code == 0, out[-3000:]
    assert f"{len(before)} trial(s) already stored as ok" in out  # resumed: only the missing trial ran
    _assert_complete_once(tmp_path, 2)
    assert all(path.exists() for path in before)
    assert not any(d.exists() for d in orphaned)  # the next run reaped it ...
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, alive  # ... and no process of the killed run survives (Ray agents, torchrun, ranks)
    print(f"\nhead killed: faults 1, rows expected 2, found {len(_rows(tmp_path))}, "
          f"duplicates {len(_rows(tmp_path)) - _rows(tmp_path).trial_id.nunique()}")


# One trial at a time (each takes both CPUs): a full disk stops the sweep at the first row it cannot write.
ONE_AT_A_TIME_SWEEP = TORCHRUN_SWEEP.replace("[0, 1]", "[0, 1, 2]")


@pytest.mark.slow  # ~2 min; the default run covers the store's and the CLI's side: tests/unit/test_store_full.py
def test_full_store_stops_the_sweep_loudly_then_a_rerun_fills_the_gap(tmp_path):
    with mounted_tmpfs(tmp_path / "store", "2m") as mount:
        sweep = _write(tmp_path, ONE_AT_A_TIME_SWEEP)
        proc = _start(sweep)
        _wait_for_line(proc, "[1/3]")
        filler = fill(mount)  # the disk fills while the second trial runs
        code, out = _finish(proc)
        assert code == 1, out[-3000:]
        assert "cannot write the result file" in out and "No space left on device" in out, out[-3000:]
        assert "MiB free of 2.0 MiB" in out and "run the same command again" in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        stored = [p for p in mount.rglob("*") if p.is_file() and p != filler and "_cache" not in p.parts]
        assert stored == store.result_files(mount, "faults")  # no temp file, torn or empty, left behind
        assert 1 <= len(stored) < 3 and all(pq.read_table(path).num_rows == 1 for path in stored)
        filler.unlink()
        code, out = _finish(_start(sweep))
        assert code == 0, out[-3000:]
        assert f"{len(stored)} trial(s) already stored as ok" in out  # only the missing trials ran
        _assert_complete_once(tmp_path, 3)
        rows = _rows(tmp_path)
        print(f"\nfull disk: faults 1, rows before {len(stored)}, rows expected 3, found {len(rows)}, "
              f"duplicates {len(rows) - rows.trial_id.nunique()}")


@pytest.mark.slow  # ~2 min; the default run covers the store's side: test_store_concurrency.py (8 writers, a reader)
def test_two_sweeps_write_one_store_at_once_while_query_and_report_read_it(tmp_path):
    # Two jobs: two `raybench run` drivers, each with its own embedded Ray, write two sweeps into one store, while
    # `raybench query` and `raybench report` read that store over and over.
    body = TORCHRUN_SWEEP.replace("workers: 2", "workers: 1").replace("[0, 1]", "[0, 1, 2]")
    drivers = [_start(_write(tmp_path, body, name)) for name in ("left", "right")]
    root = str(tmp_path / "store")
    readers = {"query": [sys.executable, "-m", "raybench", "query", root, "--format", "csv",
                         "select sweep, count(*) as n, count(distinct trial_id) as ids from attempts group by 1"],
               "report": [sys.executable, "-m", "raybench", "report", root]}
    reads = {name: 0 for name in readers}
    while any(d.poll() is None for d in drivers):
        for name, argv in readers.items():
            if not Path(root).is_dir():
                continue  # no row yet: the first trials are still running
            done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300,
                                  check=False)
            assert done.returncode == 0 and "Traceback" not in done.stderr, (name, done.stderr[-3000:])
            if name == "query":  # each trial once (one attempt each), never more than its sweep has
                for line in done.stdout.splitlines()[1:]:
                    _, n, ids = line.split(",")
                    assert n == ids and int(n) <= 3, done.stdout
            reads[name] += 1
    for driver in drivers:
        code, out = _finish(driver)
        assert code == 0, out[-3000:]
    rows = duckdb.sql(f"select sweep, trial_id, status from read_parquet('{root}/*/*.parquet')").fetchall()
    assert len(rows) == len(set(rows)) == 6 and {status for _, _, status in rows} == {"ok"}, rows
    assert {sweep for sweep, _, _ in rows} == {"left", "right"}
    assert all(reads.values()), reads
    print(f"\ntwo sweeps: rows expected 6, found {len(rows)}, duplicates {len(rows) - len(set(rows))}, "
          f"reads while writing {reads}")


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


def _process_name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""
