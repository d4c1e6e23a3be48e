"""A timeout row says how far the trial got: each rank's marks (runtime.rank_progress), written between steps and
read by the driver, tell a trial too slow for its budget from one that hangs."""

from __future__ import annotations

import time

from raybench.runtime import rank_progress


def _marks(tmp_path, steps: dict[int, list[float]], total: int = 100) -> list[dict]:
    for rank, times in steps.items():
        marks = rank_progress.Marks(str(tmp_path), "t-r0", rank, total)
        marks.reached("warm-up")
        for seconds in times:
            marks._written_at = 0.0  # every step written, as if MARK_EVERY_S had passed
            marks.step(seconds)
    return rank_progress.read(str(tmp_path), "t-r0")


def test_steps_still_ending_at_the_timeout_read_as_slow_with_what_is_left(tmp_path):
    marks = _marks(tmp_path, {0: [0.5, 0.6, 0.5, 0.5], 1: [0.5, 0.6, 0.5, 0.5]})
    text = rank_progress.describe(marks, 2, now=time.time() + 1.0)
    assert text.startswith("how far: rank 0 step 4/100, rank 1 step 4/100; last steps 0.60, 0.50, 0.50 s (rank 0)")
    assert "slow, not hung" in text and "the 96 left would take about 48 s more" in text


def test_no_step_for_a_while_reads_as_hung_and_names_the_rank_behind(tmp_path):
    marks = _marks(tmp_path, {0: [0.5] * 7, 1: [0.5] * 6})
    text = rank_progress.describe(marks, 2, now=time.time() + 60)
    assert "hung: no step ended in the last 60 s; rank 1 is behind (step 6)" in text


def test_a_rank_that_never_reached_its_steps_or_never_marked_is_said(tmp_path):
    marks = _marks(tmp_path, {0: [0.5, 0.5], 1: []})
    assert "rank 1 warm-up" in rank_progress.describe(marks, 3, now=time.time())
    assert "ranks [2] never marked" in rank_progress.describe(marks, 3, now=time.time())
    assert "hung" in rank_progress.describe(marks, 3, now=time.time())
    assert "no rank marked its progress" in rank_progress.describe([], 2, now=time.time())


def test_marks_are_written_at_most_every_interval_and_at_the_last_step_then_cleared(tmp_path):
    marks = rank_progress.Marks(str(tmp_path), "t-r0", 0, 3)
    marks.step(0.1)  # the first write: none before
    marks.step(0.1)  # within MARK_EVERY_S: not written
    assert rank_progress.read(str(tmp_path), "t-r0")[0]["steps_done"] == 1
    marks.step(0.1)  # the last step: always written
    assert rank_progress.read(str(tmp_path), "t-r0")[0]["steps_done"] == 3
    rank_progress.clear(str(tmp_path), "t-r0")
    assert rank_progress.read(str(tmp_path), "t-r0") == []
    rank_progress.Marks(None, "t-r0", 0, 3).reached("build")  # no cache directory: nothing written, no error
