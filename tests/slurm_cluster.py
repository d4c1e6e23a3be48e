"""A real, private, single-node SLURM cluster for tests: Debian's slurm-wlm + munge on 127.0.0.1.

Daemons are started by hand in the foreground (munged as user munge, slurmctld, slurmd) with a test-private
SLURM_CONF, munge socket, state and spool directories and free ports, so nothing touches a system SLURM; they
are stopped by PID. Run `python tests/slurm_cluster.py [NODES [CRED_EXPIRE_S]]` to get one in a shell for debugging (Ctrl-C stops).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from raybench.drivers.nodes import ports_in_use

PACKAGES = ("slurm-wlm", "munge")
# The daemons live in /usr/sbin, which a non-login PATH may lack.
PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
NODE_PREFIX = "rbnode"
PARTITION = "rbtest"


def missing_reason() -> str | None:
    """Why a SLURM cluster cannot be made here, or None. Installs the packages when they are missing."""
    if all(shutil.which(b, path=PATH) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return None
    if os.geteuid() != 0:
        return "slurm-wlm/munge are not installed and installing them needs root (apt-get install slurm-wlm munge)"
    if not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and apt-get is not available to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode:
            return f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr.strip()[-300:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return kb // 1024 * 9 // 10  # slurmd refuses to register a node whose RealMemory exceeds what it sees


def _node_lines(nodes: int) -> str:
    """One NodeName per slurmd; all on 127.0.0.1, so each slurmd needs its own port (`slurmd -N NAME`)."""
    return "\n".join(
        f"NodeName={NODE_PREFIX}{i} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} Port={_free_port()} "
        f"CPUs={os.cpu_count()} RealMemory={_memory_mb() // nodes}" for i in range(1, nodes + 1))


def _first_job_id() -> int:
    """Job ids of their own: a job's Ray keeps its files in /tmp/rbs-JOBID-*, so two test clusters on this host at
    once (two test processes) must never both run a job 1 (SLURM's default first id). Below SLURM's limit of
    0x03ff0000."""
    return random.randrange(1_000, 60_000_000, 1_000)


def write_config(root: Path, nodes: int = 1, cred_expire_s: int | None = None) -> Path:
    """`cred_expire_s`: the step credentials' lifetime, which is also how long SLURM holds a requeued job before it
    may start again (SLURM's default: 120 s)."""
    conf = root / "slurm.conf"
    cred = f",cred_expire={cred_expire_s}" if cred_expire_s else ""
    conf.write_text(f"""\
ClusterName=raybenchtest
FirstJobId={_first_job_id()}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock{cred}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=30
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
{_node_lines(nodes)}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _start_munged(root: Path) -> subprocess.Popen:
    """munged as user munge with a private key and socket (a host munged, if any, is left alone)."""
    mdir = root / "munge"
    mdir.mkdir()
    mdir.chmod(0o755)  # munged insists that every client can reach its socket
    key = mdir / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    subprocess.run(["chown", "-R", "munge:munge", str(mdir)], check=True)
    as_munge = [shutil.which("setpriv", path=PATH), "--reuid=munge", "--regid=munge", "--init-groups"]
    return subprocess.Popen([*as_munge, shutil.which("munged", path=PATH), "--foreground", f"--key-file={key}",
                             f"--socket={mdir}/munge.sock", f"--pid-file={mdir}/munged.pid",
                             f"--log-file={mdir}/munged.log", f"--seed-file={mdir}/munged.seed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for(ready, failure: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.1)


def _wait_nodes_idle(env: dict, nodes: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%t"], env=env, capture_output=True,
                              text=True)
        if done.stdout.split() == ["idle"] * nodes:
            return
        time.sleep(0.5)
    raise RuntimeError(f"SLURM nodes never became idle: sinfo says {done.stdout.split()} {done.stderr}")


def _end_jobs(env: dict, conf: Path) -> None:
    """Cancel this cluster's jobs and kill what they left: once slurmd is gone nothing else would (a failed
    test must not leave a Ray cluster running into the next test or CI step)."""
    subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=30)
    for _ in range(30):
        leftovers = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("SLURM_CONF") == str(conf) and proc.pid != os.getpid():
                    leftovers.append(proc)
        if not leftovers:
            return
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        time.sleep(1)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):  # slurmd, slurmctld, then munged
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def slurm_cluster(nodes: int = 1, cred_expire_s: int | None = None):
    """Start munged, slurmctld and one slurmd per node in a fresh directory; yield the environment clients need
    (SLURM_CONF). Several nodes are several slurmd on this host, all at 127.0.0.1 with their own ports.

    The directory is made directly under /tmp, not in pytest's tmp_path: munged runs as user munge and must
    reach its socket directory, and pytest's base directory is private to root.
    """
    root = Path(tempfile.mkdtemp(prefix="rbslurm-", dir="/tmp"))
    root.chmod(0o755)
    conf = write_config(root, nodes, cred_expire_s)
    (root / "ctld").mkdir()
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": PATH}
    procs = [_start_munged(root)]
    try:
        _wait_for(lambda: (root / "munge" / "munge.sock").exists(), "munged did not create its socket")
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        for i in range(1, nodes + 1):
            procs.append(subprocess.Popen(["slurmd", "-D", "-N", f"{NODE_PREFIX}{i}"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_nodes_idle(env, nodes)
        yield env
    finally:
        _end_jobs(env, conf)
        _stop(procs)
        shutil.rmtree(root, ignore_errors=True)



# ---- what the tests of raybench on this cluster share ---------------------------------------------------------

RAYBENCH = [sys.executable, "-m", "raybench"]


@contextlib.contextmanager
def raybench_slurm(home: Path, **cluster):
    """slurm_cluster's environment with a RAYBENCH_HOME of its own (`cluster up` keeps its records there); skips
    the test where SLURM cannot run here."""
    import pytest

    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with slurm_cluster(**cluster) as env:
        env["RAYBENCH_HOME"] = str(home)
        yield env


def raybench_cli(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`raybench ARGS` as a user of this cluster runs it; its output is printed for the test's log."""
    done = subprocess.run([*RAYBENCH, *args], env=env, capture_output=True, text=True, timeout=timeout)
    print(done.stdout, done.stderr, sep="\n")
    return done


# Blocks below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default), from which
# every outgoing connection and every server bound to port 0 (the other test worker's embedded Rays) takes its
# port at any moment, and above Ray's default worker ports (10002-19999): a block found free here stays free (one
# in the ephemeral range was found taken by the job's own check-ports, in 1 clean-clone run of 17). Each block
# serves two nodes (node i's ports are base+1000*i ... +999) and is held by one test process at a time (a lock).
PORT_BLOCKS = range(20000, 31000, 2000)
_held: dict[int, int] = {}  # base -> its lock file's descriptor, held until this process exits


def free_port_block() -> int:
    """A Ray base port of a block this process holds whose ports the job's template checks (the base and the next
    8, on each of 2 nodes: cluster_yaml/raybench.sbatch.tmpl) are free now."""
    for base in [*_held, *random.sample(PORT_BLOCKS, len(PORT_BLOCKS))]:
        if (base in _held or _hold(base)) and not ports_in_use([n + p for n in (base, base + 1000) for p in range(9)]):
            return base
    raise RuntimeError("no free port block")


def _hold(base: int) -> bool:
    fd = os.open(Path(tempfile.gettempdir()) / f"raybench-test-ports-{base}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other test worker's, while it runs
    except OSError:
        os.close(fd)
        return False
    _held[base] = fd
    return True


def job_processes(job_id: str) -> list[psutil.Process]:
    """Every process SLURM started for this job (they all carry its SLURM_JOB_ID), Ray's included."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SLURM_JOB_ID") == job_id:
                found.append(proc)
        except psutil.Error:
            continue
    return found

if __name__ == "__main__":
    reason = missing_reason()
    if reason:
        sys.exit(reason)
    with slurm_cluster(int(sys.argv[1]) if sys.argv[1:] else 1,
                       int(sys.argv[2]) if sys.argv[2:] else None) as slurm_env:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run the teardown on kill too
        print(f"export SLURM_CONF={slurm_env['SLURM_CONF']}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
