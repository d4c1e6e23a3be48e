"""The Ray cluster a sweep runs on: a private embedded Ray (token auth, dashboard on localhost, its temp dir
reaped when the process that owned it died) or a remote one at an address; SIGTERM turned into an exception so
that the cluster is shut down on the way out; and `wait-nodes`, run inside a SLURM job by the sbatch template.

Ray is imported inside functions only: Ray fixes its auth mode when it is first imported (`use_token_auth`
must run before), and importing this module must not start that clock.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import psutil

from raybench.drivers.executors import RAY_WORKER_ENV

# Trial drivers only wait on their trainer; they hold one slot of this custom resource instead of real CPUs
# (a Tune trial cannot ask for zero resources), so drivers never steal cores from the workers.
DRIVER_RESOURCE = "raybench_driver"
DRIVER_SLOTS = 1000
# Embedded Ray clusters live in TEMP_ROOT/rb-*; OWNER_FILE there names the raybench process that owns one.
TEMP_ROOT = "/tmp"
OWNER_FILE = "raybench-owner"
# A SLURM job's Ray keeps its files in TEMP_ROOT/rbs-JOBID-NODE, and the template holds a file open there from the
# moment it makes the dir; one not touched for this long that no process uses is an earlier job's that died
# without its cleanup (reap_stale_job_dirs).
JOB_DIR_MIN_AGE_S = 5.0
JOB_MARKER = "raybench-node"  # in a job's dir: which SLURM the job runs under (slurm_identity)


class Terminated(BaseException):
    """SIGTERM (end of allocation, scancel) reached the sweep: stop now, keep what is stored."""


# The stops of the sweep this process runs, one per active terminate_on_sigterm (innermost last), and the reason
# stop_sweep gave (a SIGTERM from outside has none: "received signal 15").
_stops: list[Callable[..., None] | None] = []
_reason: list[str] = []
# Set by the first SIGTERM while a sweep runs: the ones that follow are the same stop (SLURM signals every process
# of a job, and a one-shot job's `raybench run` passes its own on to the sweep's driver), and raising again would
# cut short the teardown and the `interrupted` rows' second check (sweep.record_interrupted).
_stopping = threading.Event()
# How long a sweep whose cluster is gone waits for Ray's teardown before it exits without it: with its head gone,
# Tune's cleanup waits on it for good (a sweep stopped by SIGTERM waits sweep.STOP_GRACE_S: its head may be up).
GONE_CLUSTER_GRACE_S = 3.0


@contextlib.contextmanager
def terminate_on_sigterm(on_stop: Callable[..., None] | None = None):
    """Turn SIGTERM into `Terminated` in the main thread so that every `finally` (Ray shutdown) runs. `on_stop`,
    given the reason, runs first: what must be recorded before a teardown that may hang (the sweep's
    `interrupted` rows). Further SIGTERMs are ignored until the outermost of these contexts has ended."""
    def handler(signum, frame):
        if _stopping.is_set():
            return
        _stopping.set()
        why = _reason[0] if _reason else f"received signal {signum}"
        if on_stop is not None:
            on_stop(why)
        raise Terminated(why)

    previous = signal.signal(signal.SIGTERM, handler)
    _stops.append(on_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stops.pop()
        if not _stops:
            _reason.clear()
            _stopping.clear()


def stop_sweep(why: str, grace_s: float = GONE_CLUSTER_GRACE_S) -> None:
    """Stop this process's sweep from another thread as SIGTERM does, for `why` (a warm cluster's allocation
    ended). The stop's records are made here and now (the main thread may be blocked inside Ray, waiting on a
    head that is gone), and the process exits after `grace_s` if the teardown has not finished by then; SIGTERM to
    the main thread raises `Terminated(why)` there as soon as it can."""
    if not _stops:  # no sweep running any more (it ended as the allocation did): nothing to stop
        return
    if not _reason:
        _reason.append(why)
    recorders = [on_stop for on_stop in _stops if on_stop is not None]
    if recorders:
        recorders[-1](why, grace_s)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)


def _process_id(pid: int) -> str:
    """pid plus start time: a pid alone may be reused by an unrelated process."""
    return f"{pid} {psutil.Process(pid).create_time()}"


def _owner_alive(temp_dir: Path) -> bool:
    try:
        recorded = (temp_dir / OWNER_FILE).read_text().strip()
        return _process_id(int(recorded.split()[0])) == recorded
    except (OSError, ValueError, psutil.Error):
        return False


def _processes_using(directory: Path) -> list:
    """This user's processes with an open file or working directory inside `directory`."""
    prefix, found = str(directory) + "/", []
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"].real != os.getuid() or proc.pid == os.getpid():
                continue
            paths = [f.path for f in proc.open_files()] + [proc.cwd()]
            if any(p.startswith(prefix) or p == str(directory) for p in paths):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def reap_stale_clusters(root: str = TEMP_ROOT) -> list[Path]:
    """Kill what is left of embedded Rays whose raybench process died (kill -9, OOM killer) and delete their
    temp dirs. Only dirs with an owner file whose process is gone are touched; other Rays are never seen."""
    reaped = []
    for temp_dir in Path(root).glob("rb-*"):
        owned = (temp_dir / OWNER_FILE).is_file() and temp_dir.stat().st_uid == os.getuid()
        if not owned or _owner_alive(temp_dir):
            continue
        remove_cluster_dir(temp_dir)
        reaped.append(temp_dir)
    return reaped


def reap_stale_job_dirs(job_id: str, job_over: Callable[[str], bool], root: str = TEMP_ROOT,
                        min_age_s: float = JOB_DIR_MIN_AGE_S) -> list[Path]:
    """Remove what earlier SLURM jobs' Rays left on this node (`rbs-JOBID-NODE`, the sbatch template's dirs): a job
    whose head was killed -9 ran no cleanup, and Ray's runtime-env and dashboard agents outlive their raylet by a
    minute, holding the job's ports. A dir no process uses is deleted. One still in use is the Ray of a job that
    runs, unless its JOB_MARKER says it is this SLURM's and SLURM says (`job_over`) that the job is over: then its
    processes are stopped and it is deleted. Dirs made in the last `min_age_s` (a job starting now) are left alone.
    Run by the template on each node before its Ray starts."""
    now, reaped, this_slurm = time.time(), [], slurm_identity()
    for temp_dir in Path(root).glob("rbs-*-*"):
        try:
            info = temp_dir.stat()
        except OSError:
            continue
        dir_job = temp_dir.name.split("-")[1]
        if (not temp_dir.is_dir() or info.st_uid != os.getuid() or now - info.st_mtime <= min_age_s
                or dir_job == job_id):
            continue
        if not _processes_using(temp_dir):
            shutil.rmtree(temp_dir, ignore_errors=True)
        elif _marker(temp_dir) == this_slurm and job_over(dir_job):
            remove_cluster_dir(temp_dir)
        else:
            continue
        reaped.append(temp_dir)
    return reaped


def slurm_identity() -> str:
    """Which SLURM a job runs under, as the template writes it into JOB_MARKER: two test SLURMs on one host share a
    cluster name and not their SLURM_CONF."""
    return f"{os.environ.get('SLURM_CLUSTER_NAME', '')} {os.environ.get('SLURM_CONF', '')}".strip()


def _marker(temp_dir: Path) -> str | None:
    try:
        return (temp_dir / JOB_MARKER).read_text().strip()
    except OSError:
        return None


def remove_cluster_dir(temp_dir: Path) -> None:
    """Stop the processes that still use an embedded Ray's temp dir (SIGTERM, then SIGKILL), then delete it."""
    procs = _processes_using(temp_dir)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def ray_cluster(address: str | None, verbose: bool = False):
    """Connect to `address`, or start a private local Ray that touches no other Ray on this host; yields the
    Ray dashboard's URL (None when that Ray runs none, or was connected before)."""
    if not address:
        use_token_auth()  # before `import ray`
    import ray

    if ray.is_initialized():
        yield _dashboard.get("url")  # an outer ray_cluster's, or None when Ray was started by someone else
        return
    log = dict(log_to_driver=verbose, logging_level="INFO" if verbose else "WARNING")
    if address:
        context = ray.init(address=address, runtime_env={"env_vars": RAY_WORKER_ENV}, **log)
        try:
            yield _remember_dashboard(context.dashboard_url)
        finally:
            ray.shutdown()
            _dashboard.clear()
        return
    reap_stale_clusters()
    temp_dir = tempfile.mkdtemp(prefix="rb-", dir=TEMP_ROOT)  # short: Ray's unix sockets need paths <= 107 bytes
    Path(temp_dir, OWNER_FILE).write_text(_process_id(os.getpid()))
    try:
        # Ray's gRPC servers listen on every interface whatever the node IP: token auth is what keeps other
        # hosts out. The dashboard listens on localhost only. It must run: Train V2's placement-group cleaner
        # asks it whether a Train controller is alive, and without it a controller killed at a trial's timeout
        # leaves its placement group (the trial's CPUs/GPUs) reserved for good.
        context = ray.init(address="local", _temp_dir=temp_dir, resources={DRIVER_RESOURCE: DRIVER_SLOTS},
                           include_dashboard=_dashboard_installed(), dashboard_host="127.0.0.1",
                           runtime_env={"env_vars": RAY_WORKER_ENV}, **log)
        yield _remember_dashboard(context.dashboard_url)
    finally:
        ray.shutdown()
        _dashboard.clear()
        remove_cluster_dir(Path(temp_dir))  # Ray's agents can outlive shutdown and keep writing logs there


_dashboard: dict[str, str | None] = {}  # the dashboard of the Ray this process connected to last


def _remember_dashboard(address: str | None) -> str | None:
    _dashboard["url"] = f"http://{address}" if address and "://" not in address else address or None
    return _dashboard["url"]


def _dashboard_installed() -> bool:
    """Whether Ray's dashboard can start (ray[default]). Without it (a minimal Ray) runs still work, but the
    train executor cannot reclaim a timed-out trial's placement group: say so instead of failing ray.init."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401  (Ray's own test of a dashboard-capable install)
    except ImportError as err:
        warnings.warn(f"Ray dashboard dependencies are missing ({err}); running without the dashboard. Install "
                      "ray[default] for it: the train executor needs it to free a timed-out trial's resources.",
                      stacklevel=2)
        return False
    return True


def use_token_auth() -> None:
    """Embedded Ray runs with token auth and a fresh random token unless the user chose a mode explicitly
    (an implicit mode is a trap: a stray ~/.ray token switches token auth on silently).

    Ray fixes its auth mode when `ray` is first imported, so this must run before that import. If Ray was
    imported earlier without a mode, the mode it runs with (disabled) is made explicit and said out loud.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    if "ray" in sys.modules:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        warnings.warn("ray was imported before raybench could enable token auth; the embedded Ray runs without "
                      "it. Set RAY_AUTH_MODE (and RAY_AUTH_TOKEN) before importing ray to choose.", stacklevel=2)
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


# ----- run inside the job by the template -----

def wait_for_nodes(count: int, timeout: float) -> None:
    """Block until `count` Ray nodes are alive on the cluster at RAY_ADDRESS (the job's own cluster)."""
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="WARNING")
    try:
        deadline = time.monotonic() + timeout
        while sum(n["Alive"] for n in ray.nodes()) < count:
            if time.monotonic() > deadline:
                sys.exit(f"raybench: only {sum(n['Alive'] for n in ray.nodes())} of {count} Ray nodes joined")
            time.sleep(1)
    finally:
        ray.shutdown()


if __name__ == "__main__" and sys.argv[1:2] == ["wait-nodes"]:
    wait_for_nodes(int(sys.argv[2]), float(sys.argv[3]))
if __name__ == "__main__" and sys.argv[1:2] == ["reap-job-dirs"]:
    from raybench.drivers.slurm import job_state

    for reaped_dir in reap_stale_job_dirs(sys.argv[2], job_over=lambda job: job_state(job) is None):
        print(f"raybench: removed {reaped_dir}, the Ray files of an earlier job that ended without removing them")
