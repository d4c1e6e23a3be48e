"""Plain torchrun on this machine, no Ray: the debugging path and the fallback where Ray is absent.

torchrun and its ranks run in a process group of their own, so a trial past `resources.timeout_s` (a stuck
collective, a deadlock) is ended by killing torchrun and every rank: no rank outlives its trial.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from raybench.drivers.executors import failure
from raybench.spec.payload import TrialPayload
from raybench.spec.schema import RankResult

# After SIGTERM, torchrun and its ranks get this long to exit before they are SIGKILLed.
GRACE_S = 5
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the process that started torchrun dies (a Ray Tune driver
    killed with its cluster), so torchrun stops its ranks instead of running on as an orphan."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM torchrun and every rank, SIGKILL whatever is left after GRACE_S, reap torchrun.

    The tree is listed first: torchrun starts each rank in a session of its own, so neither a signal to
    torchrun's process group nor torchrun itself (killed before it escalates) reaches a wedged rank.
    """
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=GRACE_S)
    for p in alive:  # a stopped or wedged rank ignores SIGTERM
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=GRACE_S)
    proc.wait()


def wait_or_kill(proc: subprocess.Popen, timeout_s: float, killed: str) -> int:
    """proc's exit code; past timeout_s its whole tree is killed and TimeoutError says so (`killed`: what went),
    and an interrupted wait (Tune stopping the trial, SIGTERM, Ctrl-C) takes the tree along."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise TimeoutError(f"trial exceeded resources.timeout_s={timeout_s:g} s; {killed}") from None
    except BaseException:
        kill_tree(proc)
        raise


def _failure_text(returncode: int, log: str) -> str:
    """What a failed torchrun says. A rank a signal killed: the log's tail, then, last (the row's message), the rank,
    the signal and the log's last error line. Otherwise the ranks' own exception lines first (torchrun's summary
    traceback, which only says that a child failed, would otherwise bury them), then the log's tail."""
    tail = "\n".join(log.splitlines()[-40:])
    killed = failure.signal_death(log, returncode, "torchrun")
    if killed:
        return f"torchrun exited {returncode}; the end of its log:\n{tail}\n\n{killed}"
    rank_errors = failure.exception_lines(log)
    found = failure.last_line(log)
    cause = rank_errors[-1] if rank_errors else found[1] if found else "its log holds no output"
    return f"torchrun exited {returncode}: {cause}\n" + "\n".join(rank_errors[-5:]) + f"\n{tail}"


def launch_env(payload: TrialPayload) -> dict[str, str]:
    """The ranks' environment: this process's, each rank's CPU threads as Ray would give them (a trial times
    alike under both), and the trial's worker environment (train.env: this trial only, its threads too)."""
    return {**os.environ, **payload.threads_env(), **payload.worker_env()}


def execute(payload: TrialPayload) -> RankResult:
    """Run the trial's ranks under torchrun; rank 0's result, from the JSON file it wrote (`worker.main`)."""
    resources = payload.config.resources
    with tempfile.TemporaryDirectory(prefix="raybench-trial-") as tmp:
        payload_path, result_path = Path(tmp, "payload.json"), Path(tmp, "result.json")
        log_path = Path(tmp, "stderr.log")
        payload_path.write_text(json.dumps(payload.to_dict()))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={resources.workers}", "-m", "raybench.runtime.worker", str(payload_path),
               str(result_path)]
        # stderr goes to a file, not a pipe: a chatty rank can never block on a full pipe.
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                                    env=launch_env(payload),
                                    preexec_fn=_die_with_parent)
            returncode = wait_or_kill(proc, resources.timeout_s, "its processes were killed")
        if returncode != 0 or not result_path.exists():
            raise RuntimeError(_failure_text(returncode, log_path.read_text(errors="replace")))
        return RankResult.from_dict(json.loads(result_path.read_text()))
