"""What a running sweep shows: the Ray dashboard address once, then either a live view on a terminal (progress
bar with counts, elapsed time and ETA over a table of running and recent trials, redrawn in place every second),
one plain line per finished trial when stdout is not a terminal (batch jobs, SLURM logs), or nothing (quiet).

The view is drawn with plain ANSI escapes (cursor up, clear to end of screen); `render_live` is a pure function
of the trial states so that it can be tested without a terminal.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TextIO

from raybench.results.report import render

Mode = Literal["live", "lines", "quiet"]
REFRESH_S = 1.0
MAX_TABLE_ROWS = 20


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


def eta_s(done: int, total: int, elapsed_s: float) -> float | None:
    """Remaining time at the average pace of the finished trials so far (None before the first one ends)."""
    return None if done == 0 else elapsed_s / done * (total - done)


def render_live(states: list[TrialState], total: int, elapsed_s: float, now_s: float, width: int = 120,
                max_rows: int = MAX_TABLE_ROWS) -> str:
    """The live view: a progress bar line, then running trials (oldest first) and the latest finished ones."""
    finished = [s for s in states if s.status != "running"]
    running = sorted((s for s in states if s.status == "running"), key=lambda s: s.started_s)
    ok = sum(s.status == "ok" for s in finished)
    bar_width = 24
    filled = bar_width * len(finished) // total if total else bar_width
    bar = (f"[{'#' * filled}{'.' * (bar_width - filled)}] {len(finished)}/{total} trials  ok {ok}  "
           f"failed {len(finished) - ok}  running {len(running)}  elapsed {duration(elapsed_s)}  "
           f"ETA {duration(eta_s(len(finished), total, elapsed_s))}")
    recent = sorted(finished, key=lambda s: s.ended_s, reverse=True)
    shown = (running + recent)[:max_rows]
    lines = [bar]
    if shown:
        rows = [[s.trial_id, s.status, duration((s.ended_s or now_s) - s.started_s),
                 _number(s.tok_per_s_per_device, ",.0f"), _number(s.peak_gib, ".2f"), s.label] for s in shown]
        lines += ["", *render(["trial_id", "status", "time", "tok/s/device", "peak GiB", "axes"], rows).splitlines()]
        hidden = len(running) + len(recent) - len(shown)
        if hidden:
            lines.append(f"... {hidden} more")
    return "\n".join(line[:width - 1] for line in lines)


class SweepProgress:
    """Receives a sweep's events (from the Tune callback in sweep.run_planned) and shows them in one mode."""

    def __init__(self, mode: Mode = "lines", write: Callable[[str], None] | None = None,
                 stream: TextIO | None = None, refresh_s: float = REFRESH_S):
        self.mode = mode
        self.refresh_s = refresh_s  # the live view's clock (elapsed, ETA, running times) ticks this often
        self.stream = stream or sys.stdout
        self.write = write or (lambda line: print(line, file=self.stream, flush=True))
        self.total = 0
        self.done = 0
        self.states: dict[str, TrialState] = {}
        self._t0 = time.monotonic()
        self._drawn_lines = 0
        self._started = False  # nothing is drawn before start(): messages may come before the sweep does
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    @classmethod
    def for_terminal(cls, quiet: bool = False, verbose: bool = False) -> SweepProgress:
        """Live on an interactive terminal; plain lines in logs and with --verbose (Ray's own log lines would
        tear a redrawn view); nothing with --quiet."""
        if quiet:
            return cls("quiet")
        live = sys.stdout.isatty() and not verbose and os.environ.get("TERM", "") != "dumb"
        return cls("live" if live else "lines")

    def __call__(self, message: str) -> None:
        """A message line (e.g. trials skipped); shown above the live view."""
        if self.mode == "quiet":
            return
        if self.mode == "lines":
            self.write(message)
            return
        with self._lock:
            self._erase()
            self.stream.write(message + "\n")
            self._draw()

    def start(self, total: int, dashboard: str | None = None) -> None:
        self.total, self._t0, self._started = total, time.monotonic(), True
        if dashboard:
            self(f"Ray dashboard: {dashboard}")
        else:
            with self._lock:
                self._redraw()
        if self.mode == "live" and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="raybench-progress", daemon=True)
            self._ticker.start()

    def trial_started(self, trial_id: str, axis_values: dict) -> None:
        with self._lock:
            self.states[trial_id] = TrialState(trial_id, axes_label(axis_values), time.monotonic())
            self._redraw()

    def trial_finished(self, trial_id: str, result: dict) -> None:
        """`result`: what the trial driver reported to Tune (status, tok_per_s_per_device, peak_gib, summary)."""
        with self._lock:
            now = time.monotonic()
            state = self.states.setdefault(trial_id, TrialState(trial_id, "", now))
            state.status, state.ended_s = result["status"], now
            state.tok_per_s_per_device = result.get("tok_per_s_per_device") if result["status"] == "ok" else None
            state.peak_gib = result.get("peak_gib")
            self.done += 1
            if self.mode == "lines":
                self.write(f"[{self.done}/{self.total}] {result.get('summary') or f'{trial_id} {state.status}'}")
            self._redraw()

    def trial_failed(self, trial_id: str, message: str) -> None:
        """The trial's driver died (Tune saw an error): no result came back."""
        self.trial_finished(trial_id, {"status": "error", "summary": f"{trial_id} error  {message}"})

    def __enter__(self) -> SweepProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2 * self.refresh_s)
        with self._lock:
            if self.mode == "live" and self._started:
                self._erase()
                self._draw(max_rows=0)  # the final counts stay; the results table follows
            self._drawn_lines = 0

    def _tick(self) -> None:
        while not self._stop.wait(self.refresh_s):
            with self._lock:
                self._redraw()

    def _redraw(self) -> None:
        if self.mode == "live" and self._started:
            self._erase()
            self._draw()

    def _erase(self) -> None:
        if self._drawn_lines:
            self.stream.write(f"\x1b[{self._drawn_lines}F\x1b[J")  # to the view's first line; clear below

    def _draw(self, max_rows: int | None = None) -> None:
        if not self._started:
            return
        size = shutil.get_terminal_size()
        now = time.monotonic()
        rows = max(1, min(MAX_TABLE_ROWS, size.lines - 5)) if max_rows is None else max_rows
        text = render_live(list(self.states.values()), self.total, now - self._t0, now, size.columns, rows)
        self.stream.write(text + "\n")
        self.stream.flush()
        self._drawn_lines = text.count("\n") + 1


def as_progress(progress: SweepProgress | Callable[[str], None]) -> SweepProgress:
    """run_planned accepts a SweepProgress or, as before, a function given one line per finished trial."""
    return progress if isinstance(progress, SweepProgress) else SweepProgress("lines", write=progress)
