"""Plain torchrun on this machine, no Ray: the debugging path and the fallback where Ray is absent.

torchrun and its ranks run in a process group of their own, so a trial past `resources.timeout_s` (a stuck
collective, a deadlock) is ended by killing torchrun and every rank: no rank outlives its trial.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from raybench.drivers.trial import EXCEPTION_LINE, one_line_message
from raybench.spec.payload import TrialPayload
from raybench.spec.schema import RankResult

# After SIGTERM, torchrun and its ranks get this long to exit before they are SIGKILLed.
GRACE_S = 5
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# torchrun prefixes rank output "[rank1]: " and its own log lines "E1122 05:44:07.832000 17449 file.py:1002] ".
_RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s?|^[EWI]\d{4} [\d:.]+ \d+ \S+\] ")


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
    """What a failed torchrun says: the ranks' own exception lines first (torchrun's summary traceback, which
    only says that a child failed, would otherwise bury them), then the log's tail."""
    lines = log.splitlines()
    bare = [_RANK_PREFIX.sub("", line).strip() for line in lines]
    rank_errors = [line for line in bare if EXCEPTION_LINE.match(line) and "ChildFailedError" not in line]
    tail = "\n".join(lines[-40:])
    cause = rank_errors[-1] if rank_errors else one_line_message("\n".join(bare[-40:]))
    return f"torchrun exited {returncode}: {cause}\n" + "\n".join(rank_errors[-5:]) + f"\n{tail}"


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
            env = {**os.environ, **payload.worker_env()}  # train.env: this trial only
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True, env=env,
                                    preexec_fn=_die_with_parent)
            returncode = wait_or_kill(proc, resources.timeout_s, "its processes were killed")
        if returncode != 0 or not result_path.exists():
            raise RuntimeError(_failure_text(returncode, log_path.read_text(errors="replace")))
        return RankResult.from_dict(json.loads(result_path.read_text()))
