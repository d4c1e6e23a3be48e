"""What a SLURM job's Ray leaves on a node when its head is killed -9 (no cleanup runs; Ray's agents outlive
their raylet by a minute, holding the job's ports): the next job's template reaps it, and nothing of a job that
runs. The real head death on SLURM is tests/integration/test_cluster_faults.py's (`-m slow -k head_node`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from raybench.drivers.ray_cluster import JOB_MARKER, reap_stale_job_dirs, slurm_identity


def _job_dir(root, name: str, age_s: float, slurm: str | None = None):
    path = root / name
    (path / "session_latest").mkdir(parents=True)
    if slurm is not None:
        (path / JOB_MARKER).write_text(slurm + "\n")
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def _hold_a_file_in(path) -> subprocess.Popen:
    """A process with a log file open in `path`, as a Ray process has; the dir's time is put back after."""
    log = path / "session_latest" / "gcs_server.out"
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(log)!r}, 'w'); import time; time.sleep(60)"])
    deadline = time.monotonic() + 30
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # opened, not only created
    os.utime(path, (time.time() - 600,) * 2)
    return holder


def test_earlier_jobs_leftovers_are_reaped_and_nothing_of_a_job_that_runs(tmp_path):
    dead = _job_dir(tmp_path, "rbs-1000-0", 600)  # an earlier job's head, killed -9: nothing uses it
    own = _job_dir(tmp_path, "rbs-2000-1", 600)  # this job's other node's (same host in the tests)
    longer_id = _job_dir(tmp_path, "rbs-20001-0", 600)  # another job whose id starts with this one's
    starting = _job_dir(tmp_path, "rbs-3000-0", 1)  # a job starting now
    running = _job_dir(tmp_path, "rbs-4000-0", 600, slurm_identity())  # a job of this SLURM that runs
    other_slurm = _job_dir(tmp_path, "rbs-5000-0", 600, "raybenchtest /tmp/other/slurm.conf")  # unknown here
    agents_left = _job_dir(tmp_path, "rbs-6000-0", 600, slurm_identity())  # over, its Ray agents still up
    holders = {path: _hold_a_file_in(path) for path in (running, other_slurm, agents_left)}
    over = {"1000", "20001", "5000", "6000"}  # what SLURM says of each job id (5000: another SLURM's, unknown)
    try:
        reaped = reap_stale_job_dirs("2000", job_over=lambda job: job in over, root=str(tmp_path))
        assert sorted(p.name for p in reaped) == ["rbs-1000-0", "rbs-20001-0", "rbs-6000-0"]
        assert holders[agents_left].wait(timeout=15) is not None  # stopped with its dir
        assert holders[running].poll() is None and holders[other_slurm].poll() is None
    finally:
        for holder in holders.values():
            holder.kill()
            holder.wait()
    assert not dead.exists() and not longer_id.exists() and not agents_left.exists()
    assert own.is_dir() and starting.is_dir() and running.is_dir() and other_slurm.is_dir()
