"""The rehearsal's figures on a fixed subset of the public corpus (bench/rehearse_public.py PINNED: eager and
compiled FSDP2, 128 ranks on 16 nodes, TP x FSDP2, pure TP, LoRA, ZeRO-3) re-predicted through `raybench
rehearse`'s own path and held to the committed ones (bench/public_pinned.json) within 1%: a change that moves a
prediction must say so, by re-pinning with a line saying why (`bench/rehearse_public.py --pin WHY`), in the same
commit. Rehearses on fake tensors only: nothing runs on a GPU, nothing is fitted."""

from __future__ import annotations

import json
import tempfile

import pytest

from tests import bench_script

rp = bench_script.load(bench_script.BENCH / "rehearse_public.py")
# Figures are written rounded (seconds to the millisecond, GiB to 0.01): 1% is far above the rounding.
TOLERANCE = 0.01


def test_the_pinned_entries_predict_their_committed_figures():
    pinned = json.loads(rp.PINNED_FILE.read_text())
    assert sorted(pinned["entries"]) == sorted(rp.PINNED) and pinned["why"]
    entries = {e.id: e for e in rp.public_results.load()}
    traces: dict = {}
    with tempfile.TemporaryDirectory() as store:
        rows = [rp.predict(entries[i], store, traces) for i in rp.PINNED]
    assert all(r["method"] == "traced" for r in rows)  # ZeRO-3 too: its FSDP2 twin's trace
    moved = []
    for entry_id, now in rp.pinned_figures(rows).items():
        for figure, committed in pinned["entries"][entry_id].items():
            if now[figure] != pytest.approx(committed, rel=TOLERANCE):
                moved.append(f"{entry_id} {figure}: committed {committed}, now {now[figure]}")
    assert not moved, ("predictions moved more than 1% from bench/public_pinned.json:\n" + "\n".join(moved) +
                       "\nif the change means it, run `bench/rehearse_public.py --pin \"why\"` and commit the file")
