"""The shipped smoke sweep as a user runs it: Tune schedules 4 trials on an embedded local Ray (the warm pool:
`executor: auto`); its rows read back by DuckDB, its HTML report as a browser (chromium) shows it, and (slow) its
run in a real terminal (tmux) as the screen shows it."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import duckdb
import pytest

from raybench import read_results
from raybench.cli import main as cli
from raybench.reports import plots
from tests import terminal

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
WIDTH = 110  # the terminal's columns
BAR_LINE = re.compile(r"(\d+)/4 trials  ok (\d+)  failed (\d+)  running (\d+)")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    sweep = tmp / "smoke-cpu.yaml"
    shutil.copy(REPO / "sweeps" / "smoke-cpu.yaml", sweep)
    return cli.main(["run", str(sweep), "--store", str(tmp / "store")]), tmp / "store"


def test_smoke_sweep_all_ok(smoke_run):
    code, store_path = smoke_run
    assert code == 0
    rows = read_results(str(store_path), "smoke-cpu")
    assert len(rows) == 4 and set(rows.status) == {"ok"}
    assert set(rows.train_strategy) == {"ddp", "fsdp2"}
    assert set(rows.executor) == {"pool"} and set(rows.world_size) == {2}  # executor auto: the warm pool
    by_ratio = {r.train_ac_ratio: list(r.ac_blocks) for r in rows.itertuples()}
    assert by_ratio == {"0": [], "1/2": [0, 2]}
    # Same seed, same data, same math: DDP and FSDP2 start from the same loss.
    first = rows.groupby("train_strategy").loss_first.first()
    assert first["ddp"] == pytest.approx(first["fsdp2"], rel=1e-4)


# Slow (a second run of the smoke sweep, about 25 s): the default run keeps the smoke sweep run in process above and
# the live view's own tests (tests/unit/test_progress.py); this one sees it as a person does.
@pytest.mark.slow
def test_the_live_view_redraws_in_place_on_a_real_terminal(tmp_path):
    """What a person sees while the sweep runs, `raybench run` in a real terminal (tmux): one view redrawn in place
    (never a stale copy left above it), no line wider than the terminal, the trials listed while they run, and at
    the end the results table below the bar's last frame."""
    if not terminal.have_tmux():
        pytest.skip("tmux is not installed (scripts/setup.sh --test installs it as root; apt-get install tmux)")
    shutil.copy(REPO / "sweeps" / "smoke-cpu.yaml", tmp_path / "smoke-cpu.yaml")
    argv = [sys.executable, "-m", "raybench", "run", str(tmp_path / "smoke-cpu.yaml"), "--store", str(tmp_path / "s")]
    seen = terminal.run_in_tmux(argv, tmp_path, width=WIDTH, height=32)
    assert seen.exit_code == 0, seen.final
    drawn = [[m for m in map(BAR_LINE.search, screen.splitlines()) if m] for screen in seen.screens]
    assert all(len(bars) <= 1 for bars in drawn), [s for s, b in zip(seen.screens, drawn) if len(b) > 1][:1]
    for screen in [*seen.screens, seen.final]:
        assert max(map(len, screen.splitlines()), default=0) <= WIDTH, screen  # -J: a wrapped line shows long
    counts = [tuple(int(g) for g in bars[0].groups()) for bars in drawn if bars]
    assert counts and all(a[0] <= b[0] for a, b in zip(counts, counts[1:])), counts  # finished never goes back
    assert any(running > 0 for *_, running in counts), counts
    final = seen.final.splitlines()
    last_bar = [i for i, line in enumerate(final) if BAR_LINE.search(line)]
    assert len(last_bar) == 1 and BAR_LINE.search(final[last_bar[0]]).groups() == ("4", "4", "0", "0"), seen.final
    rows = read_results(str(tmp_path / "s"), "smoke-cpu")
    below = "\n".join(final[last_bar[0] + 1:])
    assert len(rows) == 4 and all(trial_id in below for trial_id in rows.trial_id), seen.final


def test_the_html_report_reads_right_in_a_browser(smoke_run, tmp_path):
    """`raybench report --format html` opened in chromium: the results table as the browser lays it out holds each
    trial's throughput as DuckDB reads it from the store, every figure decodes, and nothing is wider than the
    window. RAYBENCH_SCREENSHOTS=DIR keeps a screenshot there (docs/results keeps one)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (scripts/setup.sh --test installs it as root; apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    _, store_path = smoke_run
    page_file = tmp_path / "report.html"
    assert cli.main(["report", str(store_path), "--format", "html", "--out", str(page_file)]) == 0
    stored = dict(duckdb.connect().execute(f"select trial_id, tok_per_s_per_device from "
                                           f"read_parquet('{store_path}/*/*.parquet')").fetchall())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(page_file.as_uri())
            table = page.locator("table").first
            headers = table.locator("thead th").all_inner_texts()
            cells = [row.locator("td").all_inner_texts() for row in table.locator("tbody tr").all()]
            images = page.evaluate("[...document.images].map(i => [i.alt, i.complete, i.naturalWidth])")
            overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            if os.environ.get("RAYBENCH_SCREENSHOTS"):
                page.screenshot(path=str(Path(os.environ["RAYBENCH_SCREENSHOTS"]) / "report-html.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    shown = {row[headers.index("trial_id")]: row[headers.index("tok/s/worker")] for row in cells}
    assert shown == {trial_id: f"{tok:,.0f}" for trial_id, tok in stored.items()}
    assert [alt for alt, *_ in images] == [caption for caption, _ in plots.PLOTS.values()]
    assert all(complete and width > 0 for _, complete, width in images), images
    assert overflow <= 0, f"the page is {overflow} px wider than the window"


def test_checkpointing_trains_with_the_same_loss_at_every_step(smoke_run, capsys):
    """sAC recomputes the same forward in fp32: `raybench losses` finds each step's loss equal to the same
    strategy's without checkpointing (within DDP and FSDP2's own start-loss bound above), and exits 0. An axis the
    sweep lacks exits 2."""
    _, store_path = smoke_run
    assert cli.main(["losses", str(store_path), "--axis", "train.ac_ratio", "--baseline", "0", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert {c["group"] for c in found} == {"strategy=ddp", "strategy=fsdp2"}
    assert all(c["steps"] == 8 and c["within"] and c["max_rel_diff"] <= 1e-4 for c in found), found
    assert cli.main(["losses", str(store_path), "--axis", "train.fp8", "--baseline", "off"]) == 2


def test_rows_read_back_unchanged_by_duckdb(smoke_run):
    _, store_path = smoke_run
    ours = read_results(str(store_path)).set_index("trial_id")
    con = duckdb.connect()
    theirs = con.execute(f"select trial_id, tok_per_s_per_device, step_time_p50_s, train_ac_ratio, status "
                         f"from read_parquet('{store_path}/*/*.parquet')").fetchall()
    assert len(theirs) == 4
    for trial_id, tok, p50, ratio, status in theirs:
        assert ours.loc[trial_id, "tok_per_s_per_device"] == tok and ours.loc[trial_id, "step_time_p50_s"] == p50
        assert ours.loc[trial_id, "train_ac_ratio"] == ratio and status == "ok"


def test_rerun_skips_stored_trials(smoke_run, tmp_path, capsys):
    _, store_path = smoke_run
    before = len(read_results(str(store_path), latest=False))
    assert cli.main(["run", str(REPO / "sweeps" / "smoke-cpu.yaml"), "--store", str(store_path)]) == 0
    assert "4 trial(s) already stored as ok" in capsys.readouterr().out
    assert len(read_results(str(store_path), latest=False)) == before
