"""Grid expansion, stable content-hash ids, sAC placement."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from raybench.planning.plan import plan
from raybench.spec.load import load_sweep, parse_sweep
from raybench.spec.sac import checkpointed_blocks

REPO = Path(__file__).resolve().parents[2]
# User sweeps (sweeps/) and the project's own regression sweeps (bench/sweeps/): every shipped sweep plans.
BENCH_SWEEPS = REPO / "bench" / "sweeps"
SWEEPS = sorted((REPO / "sweeps").glob("*.yaml")) + sorted(BENCH_SWEEPS.glob("*.yaml"))


@pytest.mark.parametrize("ratio, layers, expected", [
    (Fraction(1, 2), 6, [0, 2, 4]),
    (Fraction(1, 3), 6, [1, 4]),
    (Fraction(2, 3), 6, [0, 2, 3, 5]),
    (Fraction(0), 4, []),
    (Fraction(1), 4, [0, 1, 2, 3]),
    (Fraction(1, 4), 16, [1, 5, 9, 13]),
])
def test_sac_placement_matches_design(ratio, layers, expected):
    assert checkpointed_blocks(ratio, layers) == expected


@pytest.mark.parametrize("layers", [1, 7, 16, 80])
def test_sac_count_is_rounded_share(layers):
    for num in range(0, 9):
        ratio = Fraction(num, 8)
        assert len(checkpointed_blocks(ratio, layers)) == int(layers * ratio + Fraction(1, 2))


def test_grid_expands_in_declared_order_with_repeats():
    spec = parse_sweep({"name": "g", "model": {"preset": "tiny"}, "repeats": 2,
                        "axes": {"train.strategy": ["ddp", "fsdp2"], "train.micro_batch": [1, 2, 4]},
                        "exclude": [{"train.strategy": "fsdp2", "train.micro_batch": 4}]})
    trials = plan(spec)
    points = [(t.axis_values["train.strategy"], t.axis_values["train.micro_batch"]) for t in trials[::2]]
    assert points == [("ddp", 1), ("ddp", 2), ("ddp", 4), ("fsdp2", 1), ("fsdp2", 2)]
    assert [t.repeat for t in trials[:2]] == [0, 1]
    assert trials[0].config_id == trials[1].config_id and trials[0].trial_id != trials[1].trial_id
    assert len({t.trial_id for t in trials}) == len(trials) == 10


def test_ids_depend_on_config_not_on_order_or_name():
    a = plan(parse_sweep({"name": "a", "model": {"preset": "tiny"}, "axes": {"train.micro_batch": [1, 2]}}))
    b = plan(parse_sweep({"name": "b", "model": {"preset": "tiny"}, "axes": {"train.micro_batch": [2, 1]}}))
    assert {t.trial_id for t in a} == {t.trial_id for t in b}
    c = plan(parse_sweep({"name": "a", "model": {"preset": "tiny"}, "train": {"lr": 2e-5},
                          "axes": {"train.micro_batch": [1, 2]}}))
    assert not {t.trial_id for t in a} & {t.trial_id for t in c}


def test_committed_gpu_rows_keep_their_ids():
    """Trial ids hash the config: a field added later (train.ac_saved_ops) must not change the ids of configs
    that leave it unset, or stored rows would no longer match their trials (resume, rehearse validation)."""
    import pandas as pd

    for sweep in ("gpu-sac-1b", "gpu-seed000-1gpu"):
        rows = pd.read_parquet(REPO / "docs" / "results" / "gpu-2026-11-22" / f"{sweep}.parquet")
        planned = {t.config_id for t in plan(load_sweep(BENCH_SWEEPS / f"{sweep}.yaml"))}
        assert planned <= set(rows.config_id), sweep


def test_plan_output_identical_across_processes():
    cmd = [sys.executable, "-m", "raybench", "plan", str(REPO / "sweeps" / "smoke-cpu.yaml")]
    first = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    second = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert first == second and "0,2" in first


def test_ten_thousand_point_grid_plans():
    trials = plan(load_sweep(BENCH_SWEEPS / "grid-10k.yaml"))
    assert len(trials) == 10_000
    assert len({t.trial_id for t in trials}) == 10_000


@pytest.mark.parametrize("path", SWEEPS, ids=[str(p.relative_to(REPO)) for p in SWEEPS])
def test_every_shipped_sweep_validates_and_plans(path):
    trials = plan(load_sweep(path))
    assert trials
