"""A real local Ray sweep: Tune schedules 4 trials, each a Ray Train V2 run of 2 gloo workers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import pytest

from raybench import read_results
from raybench.cli import main as cli

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    sweep = tmp / "smoke-cpu.yaml"
    shutil.copy(REPO / "sweeps" / "smoke-cpu.yaml", sweep)
    code = cli.main(["run", str(sweep), "--store", str(tmp / "store")])
    return code, tmp / "store"


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
