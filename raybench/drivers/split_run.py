"""`raybench run` in two processes where a stop may end the sweep's driver without a word: the driver runs in a
child, and this process outlives it.

Two such runs: `run --cluster NAME` (the warm cluster's allocation may end under it: its time limit, scancel) and
the `raybench run` of a one-shot SLURM job (`slurm submit`; the job's payload passes the hidden `--slurm-job`),
which SLURM stops by sending SIGTERM to every process of the job (the time limit, scancel, a requeue). The driver's
own handlers stop the sweep, store the trials it cut as `interrupted` and exit 130 (slurm.watch_allocation,
ray_cluster.terminate_on_sigterm). But Ray can end the driver first, from its C++ core, as the head's Ray goes down
under the same stop: exit status 1, no Python cleanup, no word, no `interrupted` row (seen in the test suite as
scancel shut a warm cluster's head down, and once at a one-shot job's time limit). So the child keeps its trials'
states in a journal (SweepProgress.keep_journal), and if it dies without closing it after a stop (the cluster's
allocation ended, or this process received SIGTERM), this process stores what the child had running as
`interrupted` and reports the stop as the child would have. This process never imports Ray.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from raybench.drivers import slurm
from raybench.drivers.progress import SweepProgress
from raybench.drivers.sweep import EXIT_INTERRUPTED, STOP_GRACE_S, write_interrupted_rows
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.sweep_spec import SweepSpec

JOURNAL_ENV = "RAYBENCH_RUN_JOURNAL"  # set for the child: where its SweepProgress keeps the trials' states
# After SIGTERM, how long the child may take to stop: its own bound (sweep.STOP_GRACE_S) and a margin. Then it is
# killed and this process stores its running trials: within SLURM's KillWait (30 s by default) of the signal.
CHILD_STOP_S = STOP_GRACE_S + 5.0


def child_journal() -> Path | None:
    """In the child: the journal its progress keeps; None in a `run` that no raybench process started."""
    value = os.environ.get(JOURNAL_ENV)
    return Path(value) if value else None


def splits(cluster: str | None, slurm_job: bool) -> bool:
    """Whether this `run` runs its sweep's driver in a child: under `--cluster` and in a one-shot SLURM job, unless
    it is that child. A plain `run` (its own embedded Ray, or `--address`) stays one process."""
    return bool(cluster or slurm_job) and child_journal() is None


def run_in_child(argv: list[str], spec: SweepSpec, store_path: str, source: str,
                 cluster: str | None = None) -> tuple[int, tuple[str, str] | None]:
    """Run `raybench *argv` in a child and wait for it. Returns its exit status and None, or, when it died without
    a word after a stop (`cluster`'s allocation ended, or SIGTERM reached this process), EXIT_INTERRUPTED and the
    stop's reason and tally (its running trials are then stored as `interrupted`)."""
    return supervise([sys.executable, "-m", "raybench", *argv], spec, store_path, source, cluster)


def supervise(command: list[str], spec: SweepSpec, store_path: str, source: str,
              cluster: str | None = None) -> tuple[int, tuple[str, str] | None]:
    """run_in_child for any child `command` that keeps the journal JOURNAL_ENV names."""
    listed = set(store.result_files(store_path, spec.name))  # before the child runs: its rows are added to these
    with tempfile.TemporaryDirectory(prefix="raybench-run-") as tmp:
        journal_path = Path(tmp) / "trials.json"
        child = subprocess.Popen(command, env={**os.environ, JOURNAL_ENV: str(journal_path)})
        code, terminated = _wait(child)
        journal = json.loads(journal_path.read_text()) if journal_path.exists() else None
    if journal is None or journal["closed"] or code == EXIT_INTERRUPTED:
        return code, None  # it ended on its own terms (or before its sweep started), and said so
    why = _stop_reason(cluster, terminated)
    if why is None:  # died for another reason (the OOM killer, a signal): what it printed is all there is
        return code if code > 0 else 1, None
    # Said apart from the stop's own words (the same as the driver's): which process recorded the stop.
    print(f"raybench: the sweep's driver ended without a word (exit status {code}); the trials it had running are "
          "stored as interrupted by `raybench run`", file=sys.stderr, flush=True)
    progress = SweepProgress.from_journal(journal)
    running = {trial_id for trial_id, status in journal["states"].items() if status in ("running", "interrupted")}
    trials = [t for t in plan(spec, source=source) if t.trial_id in running]
    cut = write_interrupted_rows(trials, spec.name, store_path, spec.runs_with, listed, why)
    progress.trials_interrupted(cut, finished_ok=running - cut)
    return EXIT_INTERRUPTED, (why, progress.tally())


def _stop_reason(cluster: str | None, terminated: bool) -> str | None:
    """Why the child's sweep was stopped, in the words its own handlers use; None if nothing stopped it."""
    if cluster:
        job_id = slurm.load_record(cluster)["job_id"]
        try:
            ended = slurm.ended_state(job_id, running_only=True)
        except slurm.SlurmError:  # squeue not answering is no news of the job
            ended = None
        if ended:
            return slurm.say_allocation_ended(cluster, job_id, ended)
    # ray_cluster.terminate_on_sigterm's words: the child got the same signal (from this process, or from SLURM)
    return f"received signal {signal.SIGTERM.value}" if terminated else None


def _wait(child: subprocess.Popen) -> tuple[int, bool]:
    """The child's exit status, and whether SIGTERM reached this process meanwhile. SIGTERM is passed on to the
    child (it stops the sweep; in a SLURM job it gets SLURM's own as well: the same stop to it), which is killed
    should it still run CHILD_STOP_S later. Ctrl-C reaches the child directly (one process group), so this process
    ignores it and waits for the child to stop."""
    deadline: list[threading.Timer] = []  # started by the first SIGTERM

    def forward(signum, frame) -> None:
        if not deadline:
            deadline.append(threading.Timer(CHILD_STOP_S, child.kill))  # hung past its own bound
            deadline[0].daemon = True
            deadline[0].start()
        child.send_signal(signal.SIGTERM)

    on_term = signal.signal(signal.SIGTERM, forward)
    on_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return child.wait(), bool(deadline)
    finally:
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_int)
        for timer in deadline:
            timer.cancel()
