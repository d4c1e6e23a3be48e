"""Live progress: the renderer as a pure function, the plain-line output for logs, quiet mode, the live redraw."""

from __future__ import annotations

import io
import math
import time

from raybench.drivers.progress import SweepProgress, TrialState, as_progress, duration, eta_s, peak_gib, render_live


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


def test_render_live_bar_counts_eta_and_table():
    text = render_live(states(), total=6, elapsed_s=90, now_s=100)
    bar, blank, header, rule, *rows = text.splitlines()
    # 3 of 6 finished in 90 s: 30 s each, 3 to go -> ETA 90 s.
    assert bar == ("[############............] 3/6 trials  ok 2  failed 1  running 2  elapsed 1m30s  ETA 1m30s")
    assert blank == "" and header.split() == ["trial_id", "status", "time", "tok/s/device", "peak", "GiB", "axes"]
    # Running trials first (oldest first), then finished ones, latest first.
    assert [r.split()[0] for r in rows] == ["d-r0", "e-r0", "c-r0", "b-r0", "a-r0"]
    assert rows[0].split()[1:4] == ["running", "49s", "-"]  # running for now - started
    assert rows[2].split()[1:5] == ["ok", "49s", "23,456", "-"]  # unknown peak (NaN) shows as -
    assert rows[3].split()[1:5] == ["oom", "45s", "-", "79.50"]
    assert rows[4].endswith("strategy=ddp micro_batch=1")


def test_render_live_limits_rows_and_width():
    text = render_live(states(), total=5, elapsed_s=90, now_s=100, width=40, max_rows=2)
    lines = text.splitlines()
    assert lines[-1] == "... 3 more" and len(lines) == 1 + 1 + 2 + 2 + 1
    assert all(len(line) <= 39 for line in lines)  # never wraps (a wrapped line breaks the in-place redraw)
    assert render_live([], total=4, elapsed_s=0, now_s=0).splitlines() == [
        "[........................] 0/4 trials  ok 0  failed 0  running 0  elapsed 0s  ETA -"]


def test_durations_eta_and_peak():
    assert [duration(s) for s in (None, math.nan, 0.4, 59, 61, 3599, 3600, 7322)] == [
        "-", "-", "0s", "59s", "1m01s", "59m59s", "1h00m", "2h02m"]
    assert eta_s(0, 10, 5.0) is None and eta_s(2, 10, 60.0) == 240.0
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


def test_lines_mode_prints_dashboard_once_then_one_line_per_finished_trial():
    lines: list[str] = []
    progress = SweepProgress("lines", write=lines.append)
    run_events(progress)
    assert lines == ["2 trial(s) already stored as ok; skipping them",
                     "Ray dashboard: http://127.0.0.1:8265",
                     "[1/2] a-r0 ok  strategy=ddp  1000 tok/s/device",
                     "[2/2] b-r0 error  trial driver died before reporting"]
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


def test_live_mode_redraws_in_place_and_leaves_the_final_bar():
    out = io.StringIO()
    progress = SweepProgress("live", stream=out, refresh_s=3600)  # no clock ticks: only event redraws
    progress("before the sweep")  # not drawn yet: no view before start()
    assert out.getvalue() == "before the sweep\n"
    progress.start(2, None)
    first = out.getvalue()[len("before the sweep\n"):]
    assert first.startswith("[") and "0/2 trials" in first and first.count("\n") == 1
    progress.trial_started("a-r0", {"train.strategy": "ddp"})
    # Each redraw moves the cursor up over the previous view (1 line: the bar) and clears to the end.
    after_start = out.getvalue()[len("before the sweep\n") + len(first):]
    assert after_start.startswith("\x1b[1F\x1b[J[") and "a-r0" in after_start and "running" in after_start
    drawn = after_start.count("\n")  # bar, blank, header, rule, one row
    assert drawn == 5
    progress("a message")  # printed above the view, the view is redrawn below it
    assert out.getvalue().endswith(f"\x1b[{drawn}F\x1b[Ja message\n" + out.getvalue().split("a message\n")[-1])
    progress.trial_finished("a-r0", {"status": "ok", "tok_per_s_per_device": 1000.0, "peak_gib": 1.5})
    progress.trial_finished("b-r0", {"status": "timeout"})
    progress.close()
    final = out.getvalue().rsplit("\x1b[J", 1)[1]
    assert final.startswith("[########################] 2/2 trials  ok 1  failed 1  running 0")
    assert final.count("\n") == 1  # only the bar stays; the results table follows it


def test_live_clock_ticks_between_events_and_stops_on_close():
    out = io.StringIO()
    with SweepProgress("live", stream=out, refresh_s=0.02) as progress:
        progress.start(3)
        progress.trial_started("a-r0", {})
        deadline = time.monotonic() + 10
        while out.getvalue().count("\x1b[J") < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert out.getvalue().count("\x1b[J") >= 4  # redrawn by the clock, not only by the 2 events
    assert not progress._ticker.is_alive()
    drawn = out.getvalue().count("\x1b[J")
    time.sleep(0.1)
    assert out.getvalue().count("\x1b[J") == drawn  # nothing more after close
