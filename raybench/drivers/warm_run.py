"""`raybench run --cluster NAME` in two processes: the sweep's driver runs in a child, and this process outlives it.

When SLURM ends a warm cluster's allocation (scancel, the time limit), the driver's own watcher
(slurm.watch_allocation) stops the sweep, records the trials it cut as `interrupted` and exits 130. But Ray can end
the driver first, from its C++ core and with no Python cleanup: exit status 1, no word, no `interrupted` row (seen
in the test suite as scancel shut the head's Ray down). So the child keeps its trials' states in a journal
(SweepProgress.keep_journal), and if it dies without closing it while the allocation has ended, this process
records what the child had running and reports the stop as the child would have.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from raybench.drivers import slurm
from raybench.drivers.progress import SweepProgress
from raybench.drivers.sweep import EXIT_INTERRUPTED, write_interrupted_rows
from raybench.planning.plan import plan
from raybench.results import store
from raybench.spec.sweep_spec import SweepSpec

JOURNAL_ENV = "RAYBENCH_RUN_JOURNAL"  # set for the child: where its SweepProgress keeps the trials' states


def child_journal() -> Path | None:
    """In the child: the journal its progress keeps; None in a `run` that no raybench process started."""
    value = os.environ.get(JOURNAL_ENV)
    return Path(value) if value else None


def run_in_child(argv: list[str], cluster: str, spec: SweepSpec, store_path: str,
                 source: str) -> tuple[int, tuple[str, str] | None]:
    """Run `raybench *argv` in a child and wait for it. Returns its exit status and None, or, when it died without
    a word after the cluster's allocation ended, EXIT_INTERRUPTED and the stop's reason and tally (its running
    trials are then stored as `interrupted`)."""
    listed = set(store.result_files(store_path, spec.name))  # before the child runs: its rows are added to these
    with tempfile.TemporaryDirectory(prefix="raybench-run-") as tmp:
        journal_path = Path(tmp) / "trials.json"
        child = subprocess.Popen([sys.executable, "-m", "raybench", *argv],
                                 env={**os.environ, JOURNAL_ENV: str(journal_path)})
        code = _wait(child)
        journal = json.loads(journal_path.read_text()) if journal_path.exists() else None
    if journal is None or journal["closed"] or code == EXIT_INTERRUPTED:
        return code, None  # it ended on its own terms (or before its sweep started), and said so
    job_id = slurm.load_record(cluster)["job_id"]
    ended = slurm.ended_state(job_id, running_only=True)
    if not ended:  # died for another reason (the OOM killer, a signal): what it printed is all there is
        return code if code > 0 else 1, None
    why = slurm.say_allocation_ended(cluster, job_id, ended)
    progress = SweepProgress.from_journal(journal)
    running = {trial_id for trial_id, status in journal["states"].items() if status in ("running", "interrupted")}
    trials = [t for t in plan(spec, source=source) if t.trial_id in running]
    cut = write_interrupted_rows(trials, spec.name, store_path, spec.executor, listed, why)
    progress.trials_interrupted(cut, finished_ok=running - cut)
    return EXIT_INTERRUPTED, (why, progress.tally())


def _wait(child: subprocess.Popen) -> int:
    """The child's exit status. SIGTERM to this process is passed on to it (it stops the sweep); Ctrl-C reaches it
    directly (one process group), so this process ignores it and waits for the child to stop."""
    on_term = signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signal.SIGTERM))
    on_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_int)
