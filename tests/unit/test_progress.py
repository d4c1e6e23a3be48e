"""Live progress: the view as a pure function, the live view in a real pseudo-terminal (a child process draws it,
the test reads what the terminal receives and replays it on a small screen model), plain lines when stdout is no
terminal, quiet mode."""

from __future__ import annotations

import io
import json
import math
import os
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from raybench.drivers.progress import SweepProgress, TrialState, as_progress, duration, eta_s, live_view, peak_gib

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 30


def states() -> list[TrialState]:
    return [
        TrialState("a-r0", "strategy=ddp micro_batch=1", started_s=0, ended_s=40, status="ok",
                   tok_per_s_per_device=12345.6, peak_gib=3.25),
        TrialState("b-r0", "strategy=fsdp2 micro_batch=1", started_s=5, ended_s=50, status="oom", peak_gib=79.5),
        TrialState("c-r0", "strategy=ddp micro_batch=2", started_s=41, ended_s=90, status="ok",
                   tok_per_s_per_device=23456.0, peak_gib=math.nan),
        TrialState("d-r0", "strategy=fsdp2 micro_batch=2", started_s=51),
        TrialState("e-r0", "strategy=ddp micro_batch=4", started_s=91),
    ]


def as_text(renderable, width: int = 120) -> list[str]:
    """What a colourless console of `width` columns prints for `renderable`, line by line."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=False).print(renderable)
    return [line.rstrip() for line in out.getvalue().splitlines()]


def test_live_view_bar_counts_eta_and_table():
    bar, blank, header, rule, *rows = as_text(live_view(states(), total=6, elapsed_s=90, now_s=100))
    # 3 of 6 finished, taking 44.7 s on average; d has outrun that, e has 35.7 s to go, 1 not started: 80.3 s of
    # trials left, 2 at a time -> ETA 40 s. The bar is half full.
    assert bar.endswith("3/6 trials  ok 2  failed 1  running 2  elapsed 1m30s  ETA 40s")
    assert bar.count("━") == 12
    assert blank == "" and header.split() == ["trial_id", "status", "time", "tok/s/device", "peak", "GiB", "axes"]
    assert set(rule) == {"─"}
    # Running trials first (oldest first), then finished ones, latest first.
    assert [r.split()[0] for r in rows] == ["d-r0", "e-r0", "c-r0", "b-r0", "a-r0"]
    assert rows[0].split()[1:5] == ["running", "49s", "-", "-"]  # running for now - started
    assert rows[2].split()[1:5] == ["ok", "49s", "23,456", "-"]  # unknown peak (NaN) shows as -
    assert rows[3].split()[1:5] == ["oom", "45s", "-", "79.50"]
    assert rows[4].endswith("strategy=ddp micro_batch=1")


def test_live_view_limits_rows_and_never_wraps():
    lines = as_text(live_view(states(), total=5, elapsed_s=90, now_s=100, max_rows=2), width=60)
    assert lines[-1] == "... 3 more" and len(lines) == 1 + 1 + 2 + 2 + 1
    assert lines[-2].split()[:2] == ["e-r0", "running"] and lines[-2].endswith(" strat…")  # axes give way first
    narrow = as_text(live_view(states(), total=5, elapsed_s=90, now_s=100, max_rows=2), width=30)
    assert len(narrow) == len(lines) and all(len(line) <= 30 for line in narrow)  # cut short, never wrapped
    assert as_text(live_view([], total=4, elapsed_s=0, now_s=0)) == [
        " " * 25 + "0/4 trials  ok 0  failed 0  running 0  elapsed 0s  ETA -"]


def test_durations_eta_and_peak():
    assert [duration(s) for s in (None, math.nan, 0.4, 59, 61, 3599, 3600, 7322)] == [
        "-", "-", "0s", "59s", "1m01s", "59m59s", "1h00m", "2h02m"]
    assert eta_s([], 10, 5.0) is None
    # Two trials of 20 s and 40 s done (mean 30 s), one running for 10 s, 6 not started: 20 s + 6 x 30 s left.
    done = [TrialState("a", "", 0.0, 20.0, "ok"), TrialState("b", "", 20.0, 60.0, "ok")]
    assert eta_s([*done, TrialState("c", "", 60.0)], 9, 70.0) == 200.0
    # The running trial going on brings the sweep's end no later, and once it outlasts the mean, no nearer either.
    assert eta_s([*done, TrialState("c", "", 60.0)], 9, 80.0) == 190.0
    assert eta_s([*done, TrialState("c", "", 60.0)], 9, 100.0) == 180.0
    assert peak_gib({"device_type": "cuda", "peak_reserved_gib": 70.0, "peak_rss_gib": 2.0}) == 70.0
    assert peak_gib({"device_type": "cpu", "peak_reserved_gib": None, "peak_rss_gib": 2.0}) == 2.0
    assert math.isnan(peak_gib({"status": "error"}))


def run_events(progress: SweepProgress) -> None:
    progress("2 trial(s) already stored as ok; skipping them")
    progress.start(2, "http://127.0.0.1:8265")
    progress.trial_started("a-r0", {"train.strategy": "ddp"})
    progress.trial_started("b-r0", {"train.strategy": "fsdp2"})
    progress.trial_finished("a-r0", {"status": "ok", "tok_per_s_per_device": 1000.0, "peak_gib": 1.5,
                                     "summary": "a-r0 ok  strategy=ddp  1000 tok/s/device"})
    progress.trial_failed("b-r0", "trial driver died before reporting")
    progress.close()


EXPECTED_LINES = ["2 trial(s) already stored as ok; skipping them",
                  "Ray dashboard: http://127.0.0.1:8265",
                  "[1/2] a-r0 ok  strategy=ddp  1000 tok/s/device",
                  "[2/2] b-r0 error  trial driver died before reporting"]


def test_lines_mode_prints_dashboard_once_then_one_line_per_finished_trial():
    lines: list[str] = []
    progress = SweepProgress("lines", write=lines.append)
    run_events(progress)
    assert lines == EXPECTED_LINES
    assert progress.states["b-r0"].status == "error" and progress.done == 2


def test_plain_function_keeps_the_old_line_interface():
    lines: list[str] = []
    progress = as_progress(lines.append)
    assert progress.mode == "lines" and as_progress(progress) is progress
    run_events(progress)
    assert lines[-1].startswith("[2/2] b-r0 error")


def test_quiet_prints_nothing():
    out = io.StringIO()
    run_events(SweepProgress("quiet", stream=out))
    assert out.getvalue() == ""


def test_the_journal_holds_each_trials_status_and_gives_back_the_tally(tmp_path):
    # What `run --cluster` reads when its sweep's driver dies without a word: which trials ran, and the tally.
    journal = tmp_path / "trials.json"
    progress = SweepProgress("quiet")
    progress.keep_journal(journal)
    progress.start(total=4)
    progress.trial_started("a", {})
    progress.trial_finished("a", {"status": "ok"})
    progress.trial_started("b", {})
    kept = json.loads(journal.read_text())
    assert kept == {"total": 4, "states": {"a": "ok", "b": "running"}, "closed": False}
    back = SweepProgress.from_journal(kept)
    back.trials_interrupted({"b"})
    assert back.tally() == "of 4 trials: 1 interrupted, 1 ok, 2 not started"
    progress.close()
    assert json.loads(journal.read_text())["closed"] and [p.name for p in tmp_path.iterdir()] == ["trials.json"]


# ----- the view a child process draws on a real terminal -----

# Runs in the child: the mode comes from SweepProgress.for_terminal, i.e. from what its stdout is.
CHILD = textwrap.dedent("""
    import sys, time
    from raybench.drivers.progress import SweepProgress

    quiet, running = sys.argv[1] == "quiet", int(sys.argv[2])
    with SweepProgress.for_terminal(quiet=quiet) as progress:
        print("mode", progress.mode, flush=True)
        progress.refresh_s = 0.02  # redraw often: the test waits for frames, not for seconds
        progress("2 trial(s) already stored as ok; skipping them")
        progress.start(running, "http://127.0.0.1:8265")
        for i in range(running):
            progress.trial_started(f"t{i}-r0", {"train.strategy": "ddp", "train.micro_batch": i})
        time.sleep(0.3)
        print("a library's stray print", flush=True)  # not torn into the view: it goes above it
        progress.trial_finished("t0-r0", {"status": "ok", "tok_per_s_per_device": 1000.0, "peak_gib": 1.5,
                                          "summary": "t0-r0 ok  strategy=ddp  1000 tok/s/device"})
        for i in range(1, running):
            progress.trial_failed(f"t{i}-r0", "trial driver died before reporting")
        time.sleep(0.3)
    print("after the view", flush=True)
""")


def child_env(term: str) -> dict[str, str]:
    """The child's environment with the terminal chosen here: the variables by which rich would otherwise
    follow the environment of whoever runs the tests are removed."""
    env = {k: v for k, v in os.environ.items() if k not in {
        "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES", "JUPYTER_COLUMNS",
        "JUPYTER_LINES"}}
    env.update(TERM=term, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return env


def run_in_terminal(mode: str, columns: int, rows: int, running: int = 2, term: str = "xterm-256color") -> str:
    """Run CHILD on a new pseudo-terminal of columns x rows; everything the terminal received, decoded."""
    import fcntl
    import struct
    import termios

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(running)], stdin=follower, stdout=follower,
                             stderr=follower, env=child_env(term), close_fds=True)
    os.close(follower)  # the child holds it now: its exit is the end of the terminal's output
    received = bytearray()
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 0.1)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: Linux's way of saying the other side is closed
                    break
                if not chunk:  # the BSDs' way
                    break
                received += chunk
            elif child.poll() is not None and not select.select([leader], [], [], 0)[0]:
                break
    finally:
        os.close(leader)
        child.kill()
        child.wait()
    assert child.returncode == 0, received.decode(errors="replace")
    return received.decode()


CSI = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])")


class Screen:
    """The part of a terminal the live view uses: text, carriage return, line feed, cursor up, erase line,
    colours and cursor visibility. Any other control sequence fails the test."""

    def __init__(self, columns: int):
        self.columns = columns
        self.lines: list[str] = [""]
        self.row = self.col = 0
        self.tallest_frame = 0  # the most lines one redraw went back over, plus the line it ends on
        self.cursor_hidden = False

    def feed(self, text: str) -> Screen:
        pos = 0
        for match in CSI.finditer(text):
            self._text(text[pos:match.start()])
            self._control(*match.groups())
            pos = match.end()
        self._text(text[pos:])
        return self

    def _control(self, args: str, command: str) -> None:
        if command == "A":
            self.row -= int(args or 1)
            assert self.row >= 0, "the view moved the cursor above the screen's top"
            self.tallest_frame = max(self.tallest_frame, len(self.lines) - self.row)
        elif command == "K" and args == "2":
            self.lines[self.row] = ""
        elif command in "hl" and args == "?25":
            self.cursor_hidden = command == "l"
        else:
            assert command == "m", f"unexpected control sequence ESC[{args}{command}"

    def _text(self, text: str) -> None:
        for char in text:
            if char == "\r":
                self.col = 0
            elif char == "\n":
                self.row, self.col = self.row + 1, 0
                self.lines += [""] * (self.row + 1 - len(self.lines))
            else:
                assert self.col < self.columns, f"a line ran past {self.columns} columns: {self.lines[self.row]!r}"
                line = self.lines[self.row].ljust(self.col)
                self.lines[self.row] = line[:self.col] + char + line[self.col + 1:]
                self.col += 1

    def text(self) -> list[str]:
        return [line.rstrip() for line in self.lines if line.strip()]


pseudo_terminal = pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a POSIX pseudo-terminal")


@pseudo_terminal
def test_live_view_redraws_in_place_on_a_terminal_and_leaves_the_final_counts():
    received = run_in_terminal("live", columns=100, rows=30)
    # While the trials ran, the view showed them in a table (its status in colour) ...
    assert re.search(r"t0-r0 +\x1b\[36mrunning\x1b\[0m .*strategy=ddp micro_batch=0", received)
    assert "\x1b[1A\x1b[2K" in received  # ... redrawn in place: cursor up, erase the line
    screen = Screen(100).feed(received)
    # ... and nothing of the frames is left: the messages, the stray print above the view, the final counts.
    *above, final, after = screen.text()
    assert above == ["mode live", "2 trial(s) already stored as ok; skipping them",
                     "Ray dashboard: http://127.0.0.1:8265", "a library's stray print"]
    assert re.search(r"━ +2/2 trials  ok 1  failed 1  running 0  elapsed \d+s  ETA 0s$", final)
    assert after == "after the view"
    assert not screen.cursor_hidden  # hidden while drawing, shown again at the end


@pseudo_terminal
def test_live_view_fits_a_small_terminal():
    received = run_in_terminal("live", columns=44, rows=10, running=12)
    screen = Screen(44).feed(received)  # fails on any line longer than the terminal is wide
    assert 0 < screen.tallest_frame <= 10  # the table was cut to the terminal's height
    assert "... " in received and " more" in received
    assert screen.text()[-2].endswith("…") and "12/12 trials" in screen.text()[-2]


@pseudo_terminal
def test_dumb_terminal_and_quiet_get_no_live_view():
    dumb = run_in_terminal("live", columns=80, rows=24, term="dumb")
    assert "\x1b[" not in dumb
    assert dumb.replace("\r\n", "\n").splitlines() == [
        "mode lines", *EXPECTED_LINES[:2], "a library's stray print",
        "[1/2] t0-r0 ok  strategy=ddp  1000 tok/s/device", "[2/2] t1-r0 error  trial driver died before reporting",
        "after the view"]
    assert run_in_terminal("quiet", columns=80, rows=24).replace("\r\n", "\n") == (
        "mode quiet\na library's stray print\nafter the view\n")


def test_not_a_terminal_gets_one_line_per_finished_trial():
    out = subprocess.run([sys.executable, "-c", CHILD, "live", "2"], capture_output=True, text=True,
                         env=child_env("xterm-256color"), timeout=CHILD_TIMEOUT_S, check=True).stdout
    assert out.splitlines() == [
        "mode lines", *EXPECTED_LINES[:2], "a library's stray print",
        "[1/2] t0-r0 ok  strategy=ddp  1000 tok/s/device", "[2/2] t1-r0 error  trial driver died before reporting",
        "after the view"]


def test_the_live_throughput_column_is_named_as_the_results_table_names_it():
    """tok/s/GPU on GPU sweeps, tok/s/worker on CPU ones (a CPU rank is a worker process), in the live table and in
    a finished trial's line alike."""
    from raybench.drivers.trial import summary

    header = as_text(live_view(states(), total=6, elapsed_s=90, now_s=100, per="worker"))[2]
    assert header.split()[:4] == ["trial_id", "status", "time", "tok/s/worker"]
    row = {"trial_id": "a-r0", "status": "ok", "axis_values_json": '{"train.strategy": "ddp"}',
           "tok_per_s_per_device": 1000.0, "step_time_p50_s": 0.5, "device_type": "cpu"}
    assert "1000 tok/s/worker" in summary(row) and "1000 tok/s/GPU" in summary({**row, "device_type": "cuda"})
