"""The Ray temp dirs a SLURM job leaves on a node when its head is killed -9 (no cleanup runs): the next job's
template reaps those nothing uses, and only those. The real head death on SLURM is
tests/integration/test_cluster_faults.py's (`-m slow -k head_node`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from raybench.drivers.ray_cluster import reap_stale_job_dirs


def _job_dir(root, name: str, age_s: float):
    path = root / name
    (path / "session_latest").mkdir(parents=True)
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_only_an_earlier_jobs_unused_dirs_are_reaped(tmp_path):
    dead = _job_dir(tmp_path, "rbs-1000-0", 600)  # an earlier job's head, killed -9
    own = _job_dir(tmp_path, "rbs-2000-1", 600)  # this job's other node's (same host in the tests)
    longer_id = _job_dir(tmp_path, "rbs-20001-0", 600)  # another job whose id starts with this one's: reaped
    starting = _job_dir(tmp_path, "rbs-3000-0", 1)  # a job starting now: its Ray has not opened its files yet
    running = _job_dir(tmp_path, "rbs-4000-0", 600)  # a job that runs: its Ray holds files open there
    log = running / "session_latest" / "gcs_server.out"
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(log)!r}, 'w'); import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.utime(running, (time.time() - 600,) * 2)  # the file's creation touched the dir
        assert sorted(p.name for p in reap_stale_job_dirs("2000", str(tmp_path))) == ["rbs-1000-0", "rbs-20001-0"]
    finally:
        holder.kill()
        holder.wait()
    assert not dead.exists() and not longer_id.exists()
    assert own.is_dir() and starting.is_dir() and running.is_dir()
