"""`raybench slurm submit --requeue`: a one-shot job that requeues itself until its sweep is done.

SLURM warns the job's batch shell before the time limit (sbatch `--signal=B:USR1@S`). USR1, not TERM: SLURM sends
TERM itself when it ends a job (scancel, the time limit, a requeue or preemption), and only the warning must
requeue. The warning may come up to a minute early (SLURM checks time limits periodically), so the job reads its
end time and, at exactly S seconds before it, stops `raybench run` alone (it stores the trials in flight as
`interrupted`, never as ok with a partial window, while its Ray cluster is still up) and then requeues itself
(`scontrol requeue`), unless the sweep has finished by then. The next allocation of the same job runs the sweep
again, which skips every trial stored ok. A requeue from outside (preemption, an operator's `scontrol requeue`) is
resumed the same way; SLURM then signals every process of the job at once, and the trials in flight may be stored
as `error` (their workers die with the node) or not at all, never as ok.

A trial that cannot finish within one allocation would be interrupted in every allocation, forever: such a sweep
is refused before anything is submitted (`fit_problems`).
"""

from __future__ import annotations

import re

from raybench.planning.plan import PlannedTrial
from raybench.spec.errors import Problem

DEFAULT_SIGNAL_S = 60  # SLURM's warning comes at most ~30 s late on a busy controller: the job acts before its end
MAX_SIGNAL_S = 65535  # sbatch --signal's limit on sig_time
# What a job spends before its first trial starts: the Ray cluster up on every node, `raybench run` planning and
# connecting. Measured 15-20 s on the tests' SLURM (2-core host, docs/results/cluster-faults-2026-11-27.md).
STARTUP_S = 30
_TIME_FORMS = [  # sbatch --time: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS[:MINUTES[:SECONDS]]
    (re.compile(r"^(\d+)$"), (60,)),
    (re.compile(r"^(\d+):(\d+)$"), (60, 1)),
    (re.compile(r"^(\d+):(\d+):(\d+)$"), (3600, 60, 1)),
    (re.compile(r"^(\d+)-(\d+)$"), (86400, 3600)),
    (re.compile(r"^(\d+)-(\d+):(\d+)$"), (86400, 3600, 60)),
    (re.compile(r"^(\d+)-(\d+):(\d+):(\d+)$"), (86400, 3600, 60, 1)),
]


def time_limit_s(text: str) -> int | None:
    """An sbatch --time value in seconds; None for a value sbatch would not take."""
    for form, units in _TIME_FORMS:
        if match := form.match(text):
            return sum(int(part) * unit for part, unit in zip(match.groups(), units))
    return None


def fit_problems(trials: list[PlannedTrial], time: str, signal_s: int) -> list[Problem]:
    """Why some trial of the sweep might not finish within one allocation of `time`, with the numbers and the fix.

    raybench has no estimate of a trial's wall time (the analytic step time needs a GPU's peak and leaves out the
    build and the warm-up), so each trial's bound is its resources.timeout_s, which ends it anyway, start-up
    included. Bad --time values are option_problems' to report."""
    if not 1 <= signal_s <= MAX_SIGNAL_S:
        return [Problem("--signal-time", signal_s, f"seconds before the time limit: 1 … {MAX_SIGNAL_S}")]
    limit_s = time_limit_s(time)
    runnable = [t for t in trials if t.status == "planned"]
    if limit_s is None or not runnable:
        return []
    bound_s = max(t.config.resources.timeout_s for t in runnable)
    need_s = bound_s + STARTUP_S + signal_s
    if need_s <= limit_s:
        return []
    over = sum(t.config.resources.timeout_s + STARTUP_S + signal_s > limit_s for t in runnable)
    return [Problem("resources.timeout_s", bound_s, (
        f"with --requeue every trial must fit one allocation, and {over} of {len(runnable)} may not: "
        f"resources.timeout_s {bound_s:g} s (a trial's bound; raybench has no estimate of its wall time) + job "
        f"start-up {STARTUP_S} s + --signal-time {signal_s} s = {need_s:g} s > --time {time} ({limit_s} s), and "
        f"such a trial would be interrupted in every allocation; lower resources.timeout_s to at most "
        f"{max(limit_s - STARTUP_S - signal_s, 0)} s, or ask for --time of at least {_hms(need_s)}"))]


def _hms(seconds: float) -> str:
    whole = int(-(-seconds // 1))
    return f"{whole // 3600:02d}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def directives(signal_s: int) -> list[str]:
    """The sbatch lines of a requeued job: SLURM's warning, permission to requeue, one log for every allocation."""
    return [f"#SBATCH --signal=B:USR1@{signal_s}", "#SBATCH --requeue", "#SBATCH --open-mode=append"]


def payload(run: str, signal_s: int) -> str:
    """The template payload of a requeued job: `run` (the `raybench run` command line) in the background, the
    warning acted on while it runs, the sweep's exit code written only once the sweep has ended by itself.

    At the end less `signal_s` the job stops the sweep first (SIGTERM to `raybench run` alone: it stores the trials
    in flight as interrupted while its Ray cluster is still up), then requeues itself. Should the sweep not stop
    within half of `signal_s`, the job requeues itself anyway, and SLURM stops it as it stops a preempted job."""
    return f"""\
echo "raybench: allocation $((${{SLURM_RESTART_COUNT:-0}} + 1)) of job $SLURM_JOB_ID (requeued until the sweep is done)"
stop_before_end() {{  # SLURM's warning may come up to a minute early: act at the end less {signal_s} s, by the clock
  local end
  end=$(date -d "$(squeue --noheader --jobs="$SLURM_JOB_ID" --format=%e)" +%s) || end=$(date +%s)
  sleep $(( end - {signal_s} - $(date +%s) > 0 ? end - {signal_s} - $(date +%s) : 0 ))
  echo "raybench: {signal_s} s before the time limit: the sweep stops and goes on in the job's next allocation" >&2
  kill -USR2 $$
  sleep {max(signal_s // 2, 1)}
  scontrol requeue "$SLURM_JOB_ID" && echo "raybench: the sweep did not stop within {max(signal_s // 2, 1)} s" >&2
}}
timer= stop_asked=0
on_warning() {{ [[ -n $timer ]] || {{ stop_before_end & timer=$!; }}; }}
trap on_warning USR1
{run} &
run_pid=$!
trap 'stop_asked=1; kill -TERM "$run_pid" 2>/dev/null' USR2
# SLURM signals every process of the job itself (a requeue from outside, scancel, the limit): wait while the
# sweep stores the trials it cuts as interrupted.
trap 'stopped_by_slurm=1' TERM INT
((end_warned)) && on_warning  # the warning came while Ray started
while :; do  # a trapped signal ends a wait early
  wait "$run_pid"; rc=$?
  kill -0 "$run_pid" 2>/dev/null || break
done
wait "$run_pid" 2>/dev/null; again=$?  # a signal trapped as it exited: its status is still to be collected
((again != 127)) && rc=$again
[[ -n $timer ]] && kill "$timer" 2>/dev/null
((stopped_by_slurm)) && exit 143  # requeued from outside (the next allocation resumes), cancelled or out of time
if ((stop_asked && rc != 0 && rc != 1)); then  # stopped before the end, not done: the rest in the next allocation
  scontrol requeue "$SLURM_JOB_ID" && exit 143
  echo "raybench: scontrol requeue failed: the sweep stops here; submit it again to run the rest" >&2
fi
echo $rc > "$RAYBENCH_JOB_DIR/exit_code"
exit $rc
"""
