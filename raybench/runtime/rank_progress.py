"""How far each rank of a running trial got, so that a trial ended at its timeout says whether it was slow or hung.

Each rank of raybench's loop keeps one small JSON file, `CACHE/progress/TRIAL_ID/rank-R.json` (the store's cache:
on a cluster, the shared file system every node writes), replaced whole at each stage and after timed steps: the
stage it reached, the steps done, its last step times and the wall time of the mark. The driver reads them when the
trial ends at its timeout (`describe`) and removes them (`clear`). Writing is between steps, never inside the timed
interval, and at most every MARK_EVERY_S.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path

MARK_EVERY_S = 0.5
LAST_STEPS = 3  # step times kept in a mark
# No step finished for this many typical steps (and at least HUNG_MIN_S): the trial was hung, not slow.
HUNG_STEPS = 5
HUNG_MIN_S = 10.0


def _directory(cache_dir: str, trial_id: str) -> Path:
    return Path(cache_dir) / "progress" / trial_id


class Marks:
    """One rank's marks; a no-op without a cache directory (a trial run outside a store)."""

    def __init__(self, cache_dir: str | None, trial_id: str, rank: int, steps_total: int):
        self.path = _directory(cache_dir, trial_id) / f"rank-{rank}.json" if cache_dir else None
        self.rank, self.steps_total = rank, steps_total
        self.steps_done, self.last_steps_s, self.stage = 0, [], "started"
        self._written_at = 0.0

    def reached(self, stage: str) -> None:
        self.stage = stage
        self._write()

    def step(self, seconds: float) -> None:
        """A timed step ended (called between steps); written at most every MARK_EVERY_S, and at the last step."""
        self.steps_done += 1
        self.last_steps_s = [*self.last_steps_s, seconds][-LAST_STEPS:]
        self.stage = "steps"
        if time.monotonic() - self._written_at >= MARK_EVERY_S or self.steps_done == self.steps_total:
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        self._written_at = time.monotonic()
        mark = {"rank": self.rank, "stage": self.stage, "steps_done": self.steps_done,
                "steps_total": self.steps_total, "last_steps_s": self.last_steps_s, "at": time.time()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_text(json.dumps(mark))
            os.replace(partial, self.path)  # a reader never sees half a mark
        except OSError:
            pass  # a mark is a diagnosis aid: a full or read-only cache never fails the trial


def read(cache_dir: str, trial_id: str) -> list[dict]:
    marks = []
    for path in sorted(_directory(cache_dir, trial_id).glob("rank-*.json")):
        try:
            marks.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(marks, key=lambda m: m["rank"])


def clear(cache_dir: str, trial_id: str) -> None:
    shutil.rmtree(_directory(cache_dir, trial_id), ignore_errors=True)


def describe(marks: list[dict], world_size: int, now: float) -> str:
    """How far the trial got, for its timeout row: each rank's stage or steps, and whether it was still stepping
    (slow: more time, fewer train.steps or a faster configuration would finish it) or no step had ended for a
    while (hung: a rank stuck, or a collective waiting for one; the rank behind the others is named)."""
    if not marks:
        return "how far: no rank marked its progress (stuck before its process group formed, or before its first mark)"
    missing = sorted(set(range(world_size)) - {m["rank"] for m in marks})
    before_steps = [m for m in marks if m["stage"] != "steps"]
    parts = [f"rank {m['rank']} {m['stage']}" if m["stage"] != "steps" else
             f"rank {m['rank']} step {m['steps_done']}/{m['steps_total']}" for m in marks]
    text = "how far: " + ", ".join(parts) + (f"; ranks {missing} never marked" if missing else "")
    stepping = [m for m in marks if m["stage"] == "steps"]
    if not stepping:
        return text + " (no timed step ended)"
    silent_s = now - max(m["at"] for m in stepping)
    step_s = statistics.median(s for m in stepping for s in m["last_steps_s"])
    text += f"; last steps {', '.join(f'{s:.2f}' for s in stepping[0]['last_steps_s'])} s (rank {stepping[0]['rank']})"
    if silent_s > max(HUNG_STEPS * step_s, HUNG_MIN_S) or before_steps or missing:
        behind = min(stepping, key=lambda m: (m["steps_done"], m["at"]))
        who = (f"; rank {behind['rank']} is behind (step {behind['steps_done']})"
               if behind["steps_done"] < max(m["steps_done"] for m in stepping) else "")
        return text + f"; hung: no step ended in the last {silent_s:.0f} s{who}"
    left = max(m["steps_total"] - m["steps_done"] for m in stepping)
    return text + (f"; slow, not hung: steps were still ending ({step_s:.2f} s each); the {left} left would take "
                   f"about {left * step_s:.0f} s more (resources.timeout_s, train.steps)")
