"""What a running sweep shows: the Ray dashboard address once, then either a live view on a terminal (progress
bar with counts, elapsed time and ETA over a table of running and recent trials, redrawn in place), one plain
line per finished trial when stdout is not a terminal (batch jobs, SLURM logs), or nothing (quiet).

The live view is drawn by rich: its Live redraws in place, fits the view to the terminal's width and height as
they are at each redraw (rows cropped, cells shortened with an ellipsis), puts messages and stray prints above
it, and knows which terminals can take it. `live_view` is a pure function of the trial states, so that what it
shows can be tested without a terminal.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

Mode = Literal["live", "lines", "quiet"]
REFRESH_S = 0.5  # the live view's clock (elapsed, ETA, running times) and new events show this often
MAX_TABLE_ROWS = 20
BAR_WIDTH = 24
# Lines of the view that are not trial rows: the bar, a blank line, the table's header and rule, "N more", and
# the line the cursor rests on. The table gets what is left of the terminal's height.
VIEW_CHROME_LINES = 6
STATUS_STYLES = {"running": "cyan", "ok": "green", "timeout": "yellow"}  # every other status is a failure
FAILED_STYLE = "red"
# The throughput column is named per GPU or per worker process (CPU trials) as the results table names it.
TABLE_COLUMNS = ("trial_id", "status", "time", "tok/s/{per}", "peak GiB", "axes")


@dataclass
class TrialState:
    trial_id: str
    label: str  # the trial's axis values, "strategy=ddp micro_batch=2"
    started_s: float  # time.monotonic() when it started
    ended_s: float | None = None
    status: str = "running"
    tok_per_s_per_device: float | None = None
    peak_gib: float | None = None


def axes_label(axis_values: dict) -> str:
    return " ".join(f"{key.split('.')[-1]}={value}" for key, value in axis_values.items())


def peak_gib(row: dict) -> float:
    """A row's peak memory for the live table: reserved GPU memory, host RSS on CPU; NaN when unknown (a Tune
    result is a flat dict of numbers)."""
    peak = row.get("peak_reserved_gib") if row.get("device_type") == "cuda" else row.get("peak_rss_gib")
    return math.nan if peak is None else peak


def duration(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "-"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def eta_s(states: list[TrialState], total: int, now_s: float) -> float | None:
    """Remaining time (None before the first trial ends): each trial not started takes the finished trials' mean
    duration, each running one that less what it has run, as many at once as run now. The sweep's elapsed time
    over its finished trials would grow while a long trial runs; rich's own estimate looks at a recent window,
    which holds no finished trial for most of a sweep whose trials take minutes."""
    took = [s.ended_s - s.started_s for s in states if s.ended_s is not None]
    if not took:
        return None
    mean_s = sum(took) / len(took)
    ran = [now_s - s.started_s for s in states if s.ended_s is None]
    left_s = sum(max(mean_s - r, 0.0) for r in ran) + mean_s * max(total - len(states), 0)
    return left_s / max(len(ran), 1)


def progress_line(states: list[TrialState], total: int, elapsed_s: float, now_s: float) -> Table:
    """The bar and the counts, on one line; the counts are shortened with an ellipsis when the line is narrow."""
    finished = sum(s.status != "running" for s in states)
    ok = sum(s.status == "ok" for s in states)
    running = len(states) - finished
    counts = (f"{finished}/{total} trials  ok {ok}  failed {finished - ok}  running {running}  "
              f"elapsed {duration(elapsed_s)}  ETA {duration(eta_s(states, total, now_s))}")
    line = Table.grid(padding=(0, 1))
    line.add_column(width=BAR_WIDTH, no_wrap=True)
    line.add_column(no_wrap=True, overflow="ellipsis")
    line.add_row(ProgressBar(total=max(total, 1), completed=finished if total else 1, width=BAR_WIDTH), counts)
    return line


def trial_table(shown: list[TrialState], hidden: int, now_s: float, per: str = "device") -> Table:
    table = Table(*(c.format(per=per) for c in TABLE_COLUMNS), box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, header_style="bold", caption=f"... {hidden} more" if hidden else None,
                  caption_justify="left")
    # A wrapped row would push the view off the screen: the axes column gives up its width first (rich narrows
    # the columns that may wrap before the others), and its cells are cut short with an ellipsis, not wrapped.
    for column in table.columns[:-1]:
        column.no_wrap, column.overflow = True, "ellipsis"
    for name in ("time", "tok/s/{per}", "peak GiB"):
        table.columns[TABLE_COLUMNS.index(name)].justify = "right"
    for s in shown:
        table.add_row(s.trial_id, Text(s.status, style=STATUS_STYLES.get(s.status, FAILED_STYLE)),
                      duration((s.ended_s or now_s) - s.started_s), _number(s.tok_per_s_per_device, ",.0f"),
                      _number(s.peak_gib, ".2f"), Text(s.label, no_wrap=True, overflow="ellipsis"))
    return table


def live_view(states: list[TrialState], total: int, elapsed_s: float, now_s: float,
              max_rows: int = MAX_TABLE_ROWS, per: str = "device") -> RenderableType:
    """The live view: the progress line, then running trials (oldest first) and the latest finished ones."""
    running = sorted((s for s in states if s.status == "running"), key=lambda s: s.started_s)
    recent = sorted((s for s in states if s.status != "running"), key=lambda s: s.ended_s, reverse=True)
    shown = (running + recent)[:max_rows]
    bar = progress_line(states, total, elapsed_s, now_s)
    if not shown:
        return bar
    return Group(bar, Text(), trial_table(shown, len(running) + len(recent) - len(shown), now_s, per))


class SweepProgress:
    """Receives a sweep's events (from the Tune callback in sweep.run_planned) and shows them in one mode."""

    def __init__(self, mode: Mode = "lines", write: Callable[[str], None] | None = None,
                 stream: TextIO | None = None, refresh_s: float = REFRESH_S):
        self.mode = mode
        self.refresh_s = refresh_s
        self.stream = stream or sys.stdout
        self.write = write or (lambda line: print(line, file=self.stream, flush=True))
        # The real stream, not whatever sys.stdout is later: the live view redirects sys.stdout to itself.
        self.console = Console(file=self.stream, highlight=False)
        self.total = 0
        self.per = "device"
        self.done = 0
        self.states: dict[str, TrialState] = {}
        self._t0 = time.monotonic()
        self._live: Live | None = None  # from start() to close() in live mode
        self._closing = False  # the last redraw shows the bar only: the results table follows it
        self._lock = threading.Lock()  # events come from Tune's thread, redraws from rich's
        self._journal: Path | None = None  # keep_journal

    @classmethod
    def for_terminal(cls, quiet: bool = False, verbose: bool = False) -> SweepProgress:
        """Live on a terminal that can redraw (rich decides: a tty not named dumb, or FORCE_COLOR /
        TTY_COMPATIBLE); plain lines in logs and with --verbose (Ray's own log lines would tear a redrawn
        view); nothing with --quiet."""
        if quiet:
            return cls("quiet")
        console = Console(file=sys.stdout)
        live = console.is_terminal and not console.is_dumb_terminal and not verbose
        return cls("live" if live else "lines")

    def __call__(self, message: str) -> None:
        """A message line (e.g. trials skipped); shown above the live view."""
        if self.mode == "lines":
            self.write(message)
        elif self.mode == "live":
            self.console.print(Text(message))  # Text: brackets in a message are not markup

    def keep_journal(self, path: Path) -> None:
        """Keep every trial's status in `path` (JSON, replaced whole at each change) and mark it closed when this
        view closes. The process that started this one reads it should this one die without a word: which trials
        it had running, and the tally (drivers.split_run)."""
        with self._lock:
            self._journal = path
            self._save_journal()

    def _save_journal(self, closed: bool = False) -> None:
        """Under the lock."""
        if self._journal is None:
            return
        states = {trial_id: state.status for trial_id, state in self.states.items()}
        partial = self._journal.with_name(self._journal.name + ".partial")
        partial.write_text(json.dumps({"total": self.total, "states": states, "closed": closed}))
        os.replace(partial, self._journal)  # a reader never sees half a journal

    @classmethod
    def from_journal(cls, journal: dict) -> SweepProgress:
        """A quiet view holding what a journal (keep_journal) says: its tally is the journal's process's."""
        progress = cls("quiet")
        progress.total = journal["total"]
        progress.states = {trial_id: TrialState(trial_id, "", 0.0, status=status)
                           for trial_id, status in journal["states"].items()}
        return progress

    def start(self, total: int, dashboard: str | None = None, per: str = "device") -> None:
        """`per`: what throughput is per, "GPU" or "worker" (CPU trials), as the results table says it."""
        with self._lock:
            self.total, self._t0, self.per = total, time.monotonic(), per
            self._save_journal()
        if dashboard:
            self(f"Ray dashboard: {dashboard}")
        if self.mode == "live" and self._live is None:
            self._live = Live(get_renderable=self._view, console=self.console,
                              refresh_per_second=1 / self.refresh_s)
            self._live.start(refresh=True)

    def trial_started(self, trial_id: str, axis_values: dict) -> None:
        with self._lock:
            self.states[trial_id] = TrialState(trial_id, axes_label(axis_values), time.monotonic())
            self._save_journal()

    def trial_finished(self, trial_id: str, result: dict) -> None:
        """`result`: what the trial driver reported to Tune (status, tok_per_s_per_device, peak_gib, summary)."""
        with self._lock:
            now = time.monotonic()
            state = self.states.setdefault(trial_id, TrialState(trial_id, "", now))
            # A trial the stop cut stays `interrupted` (as its latest row) whatever failure its dying driver reports;
            # one that finished ok just as the stop came keeps its ok row (sweep.write_interrupted_rows).
            cut = state.status == "interrupted" and result["status"] != "ok"
            state.status = "interrupted" if cut else result["status"]
            state.ended_s = now
            state.tok_per_s_per_device = result.get("tok_per_s_per_device") if result["status"] == "ok" else None
            state.peak_gib = result.get("peak_gib")
            self.done += 1
            self._save_journal()
            if self.mode == "lines":
                self.write(f"[{self.done}/{self.total}] {result.get('summary') or f'{trial_id} {state.status}'}")

    def trial_failed(self, trial_id: str, message: str) -> None:
        """The trial's driver died (Tune saw an error): no result came back."""
        self.trial_finished(trial_id, {"status": "error", "summary": f"{trial_id} error  {message}"})

    def trials_interrupted(self, trial_ids: set[str], finished_ok: set[str] = frozenset()) -> None:
        """These running trials were cut by a stop and stored as `interrupted`; those of `finished_ok`, which the
        stop took for running, had stored ok just before it (however their finish reached this view)."""
        with self._lock:
            for trial_id in trial_ids:
                if trial_id in self.states and self.states[trial_id].status == "running":
                    self.states[trial_id].status = "interrupted"
            for trial_id in finished_ok:
                if trial_id in self.states:
                    self.states[trial_id].status = "ok"
            self._save_journal()

    def tally(self) -> str:
        """What this run did to its trials so far, for a stopped sweep's last words: "of 3 trials: 1 ok, 1
        interrupted, 1 not started"."""
        with self._lock:
            counts: dict[str, int] = {}
            for state in self.states.values():
                counts[state.status] = counts.get(state.status, 0) + 1
            not_started = self.total - len(self.states)
        parts = [f"{n} {status}" for status, n in sorted(counts.items())]
        parts += [f"{not_started} not started"] if not_started > 0 else []
        return f"of {self.total} trials: {', '.join(parts) or 'none started'}"

    def __enter__(self) -> SweepProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the live view, leaving its final counts on the screen."""
        with self._lock:
            self._save_journal(closed=True)
        if self._live is not None:
            self._closing = True
            self._live.stop()  # redraws once more (the bar only), then gives sys.stdout back
            self._live = None

    def _view(self) -> RenderableType:
        """What rich draws at each refresh, fitted to the terminal's height now (it may have been resized)."""
        with self._lock:
            now = time.monotonic()
            rows = 0 if self._closing else max(1, min(MAX_TABLE_ROWS, self.console.height - VIEW_CHROME_LINES))
            return live_view(list(self.states.values()), self.total, now - self._t0, now, rows, self.per)


def as_progress(progress: SweepProgress | Callable[[str], None]) -> SweepProgress:
    """run_planned accepts a SweepProgress or, as before, a function given one line per finished trial."""
    return progress if isinstance(progress, SweepProgress) else SweepProgress("lines", write=progress)
