"""What a failed command line's output says about why it failed: the ranks' own exception lines, or a rank killed
by a signal, named with the last real error line the output holds.

The command and torchrun executors both read a launcher's captured output (torchrun's, usually): each rank's own
lines, torchrun's log lines ("E1127 22:28:05.751000 8399 .../api.py:1002] failed (exitcode: -6) local_rank: 1"),
its traceback ending in ChildFailedError, and its failure summary, whose "Root Cause" names the rank that failed
first and its exit code (negative: the signal that killed it). A rank's progress bar rewrites its line with
carriage returns, each a line break to Python (`str.splitlines`, files read as text): the output's lines hold bar
fragments, which never make a message.
"""

from __future__ import annotations

import re
import signal

from raybench.drivers.trial import EXCEPTION_LINE, signal_line

# torchrun's own log lines: "E1122 05:44:07.832000 17449 file.py:1002] ...".
_TORCHRUN_LOG = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S+\] ")
# torchrun prefixes rank output "[rank1]: " (with --tee, "[default0]:"), and its log lines as above.
_RANK_PREFIX = re.compile(r"^(\[(default)?(rank)?\d+\]:\s?|[EWI]\d{4} [\d:.]+ \d+ \S+\] )")
# torchrun's mark of a rank's own line: "[rank1]: ...".
_RANK_MARK = re.compile(r"^\[rank(\d+)\]:")
# A progress bar's fragment: "45%|####  |", "| 9/20 [", "4.2it/s", "1.3s/it".
_PROGRESS = re.compile(r"\d+%\||\|\s*\d+/\d+\s*\[|\d\s*(it/s|s/it)\b")
# Lines that say something went wrong (a C++ abort says "terminate called ..."; glibc "double free ...").
_ERROR_WORDS = re.compile(r"error|exception|terminate called|abort|fatal|segmentation fault|core dumped|"
                          r"double free|corrupted|killed", re.IGNORECASE)
# torchrun's summary of the first failure: "Root Cause (first observed failure):", then "rank : 1 (local_rank:
# 1)" and "exitcode : -6 (pid: 8465)  (SIGABRT)".
_ROOT_CAUSE = re.compile(r"Root Cause.*?\brank\s*:\s*(\d+).*?\bexitcode\s*:\s*(-?\d+)", re.DOTALL)
# Where torchrun starts reporting a failure: what follows is its own, not a rank's.
_TORCHRUN_REPORT = re.compile(r"failed \(exitcode: -?\d+\)|ChildFailedError")


def _bare(line: str) -> str:
    """A line without torchrun's prefixes."""
    return _RANK_PREFIX.sub("", line.strip()).strip()


def exception_lines(output: str, rank: int | None = None) -> list[str]:
    """The ranks' own exception lines ("ValueError: ..."), prefixes removed, torchrun's ChildFailedError left out
    (it only says that a rank failed); given `rank`, without the lines torchrun marks as another rank's."""
    lines = (_bare(line) for line in output.splitlines() if rank is None or _marked_rank(line) in (None, rank))
    return [line for line in lines if EXCEPTION_LINE.match(line) and "ChildFailedError" not in line]


def last_line(output: str, rank: int | None = None) -> tuple[str, str] | None:
    """The last line of the ranks' output that says what went wrong, ("error", line), before torchrun's own
    report, with progress-bar fragments, torchrun's log lines, blanks and (given `rank`) the lines torchrun marks
    as another rank's skipped: the ranks a dead one leaves behind fail too, in its wake ("Connection closed by
    peer"). Without such a line the last line left, ("output", line); None when none is left."""
    lines = output.splitlines()
    end = next((i for i, line in enumerate(lines) if _TORCHRUN_REPORT.search(line)), len(lines))
    kept = [_bare(line) for line in lines[:end]
            if not _TORCHRUN_LOG.match(line.strip()) and _marked_rank(line) in (None, rank)]
    kept = [line for line in kept if line and not _PROGRESS.search(line) and not set(line) <= set("*=-")]
    errors = [line for line in kept if _ERROR_WORDS.search(line)]
    return ("error", errors[-1]) if errors else ("output", kept[-1]) if kept else None


def signal_death(output: str, returncode: int, command: str) -> str | None:
    """The message of a command whose first failed rank (torchrun's root cause), or which itself, was killed by a
    signal: who, the signal, and the output's last error line; the exception the rank raised before the signal,
    should it have raised one, leads. None when no signal killed it."""
    root = _ROOT_CAUSE.search(output)
    if root and int(root.group(2)) < 0:
        who, code = f"rank {root.group(1)}", int(root.group(2))
    elif returncode < 0:
        who, code = f"the command {command}", returncode
    else:
        return None
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = str(-code)
    rank = int(root.group(1)) if root else None
    # A rank that raised before the signal (a refused allocation, then an abort on its way out, gloo's threads still
    # running): its exception is the cause, so it leads the message, and the row's status is read from it (oom).
    raised = exception_lines(output, rank)
    if raised:
        return f"{raised[-1]} ({who} raised it, then was killed by signal {name} on its way out: exit code {code})"
    found = last_line(output, rank)
    return signal_line(who, name, code) + (f"; its last {found[0]} line: {found[1]}" if found else "")


def _marked_rank(line: str) -> int | None:
    """The rank torchrun marked the line as coming from; None: unmarked."""
    mark = _RANK_MARK.match(line.strip())
    return int(mark.group(1)) if mark else None
