"""Prediction intervals (planning/uncertainty.py) and where `raybench best --predict`'s choice could flip inside
them (rehearse/flips.py), on planted rehearsals: stored rehearsal files with chosen peaks and step times, so
nothing is traced."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from raybench.cli.main import main
from raybench.planning import uncertainty
from raybench.planning.plan import plan
from raybench.rehearse import flips
from raybench.rehearse.choice import predicted_best
from raybench.results import rehearsals
from raybench.spec.load import load_sweep

TRAIN = {"steps": 20, "warmup_steps": 2, "seq_len": 64, "micro_batch": 2, "strategy": "fsdp2"}
TOKENS = 2 * 64  # per GPU and step
TRACED = uncertainty.BANDS["traced"].rows  # the tiny model on one GPU is within the derivation rows' reach


def planted(tmp_path, memory_gib: float, points: dict[str, tuple[float, float]]) -> str:
    """A one-GPU sweep over the sAC ratios of `points` ({ratio: (reserved GiB, step s)}), each with a stored
    traced rehearsal of those figures; memory_gib with no margin is the limit (the CUDA context: 1 GiB)."""
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps({
        "name": "planted", "model": {"preset": "tiny"}, "train": TRAIN, "resources": {"gpus_per_worker": 1},
        "estimate": {"gpu": "H100 SXM", "device_memory_gib": memory_gib, "margin_gib": 0},
        "store": str(tmp_path / "store"), "axes": {"train.ac_ratio": list(points)}}))
    for t in plan(load_sweep(path)):
        reserved, step_s = points[t.axis_values["train.ac_ratio"]]
        rehearsals.save_rehearsal(tmp_path / "store", t.config_id, {
            "method": "traced", "peak_gib": reserved / 1.16, "reserved_gib": reserved, "step_time_s": step_s,
            "compute_s": step_s})
    return str(path)


def group(sweep: str) -> dict:
    (result,) = predicted_best(plan(load_sweep(sweep), store_path=load_sweep(sweep).store))
    return result


def test_an_interval_holds_every_measured_value_the_band_allows():
    low, high = uncertainty.interval(100.0, 0.25)
    assert (low, high) == pytest.approx((80.0, 133.333), rel=1e-4)
    # At either end the prediction errs by exactly the band (error = predicted / measured - 1).
    assert (100 / low - 1, 100 / high - 1) == pytest.approx((0.25, -0.25))
    # A fixed part (the CUDA context) is outside the band and shifts both ends.
    assert uncertainty.interval(21.0, 0.06, fixed=1.0) == pytest.approx((20 / 1.06 + 1, 20 / 0.94 + 1))
    assert uncertainty.interval(1.0, 1.0)[1] == math.inf
    assert uncertainty.interval(None, 0.1) is None
    assert uncertainty.reciprocal((0.5, 2.0), 100.0) == (50.0, 200.0)
    assert uncertainty.with_interval(72.9, (70.12, 75.84), ".1f") == "72.9 [70.1-75.8]"


def test_a_peak_whose_interval_straddles_the_limit_is_in_doubt_and_the_emitted_sweep_settles_it(tmp_path, capsys):
    # Ratio 0 fits by 0.5 GiB (21 of 21.5) but its interval reaches past the limit; 1/2 surely fits and is not
    # surely slower; 1 surely fits and is surely slower than 1/2: never the choice.
    sweep = planted(tmp_path, 21.5, {"0": (20.0, 0.10), "1/2": (15.0, 0.11), "1": (10.0, 0.30)})
    result = group(sweep)
    assert result["best"]["value"] == "0"
    assert result["best"]["peak_interval_gib"] == pytest.approx((20 / (1 + TRACED.reserved_peak) + 1,
                                                                 20 / (1 - TRACED.reserved_peak) + 1))
    doubts = {d["value"]: d["why"] for d in result["in_doubt"]}
    assert list(doubts) == ["0", "1/2"]
    assert doubts["0"].startswith("may not fit: peak 21.0 [") and "21.5 GiB limit" in doubts["0"]
    assert "overlaps 0" in doubts["1/2"]

    emitted = tmp_path / "settle.yaml"
    assert main(["best", sweep, "--predict", "--emit-sweep", str(emitted)]) == 0
    out = capsys.readouterr().out
    doubt = (f"in doubt (bands: step time {TRACED.step_time:.1%}, reserved peak {TRACED.reserved_peak:.1%}); "
             "settle: run these 2 for 8 steps")
    assert "21.0 [" in out and doubt in out and "0: may not fit" in out
    settle = plan(load_sweep(emitted))  # raybench's own loader and plan
    assert [t.axis_values for t in settle] == [{"train.ac_ratio": "0"}, {"train.ac_ratio": "1/2"}]
    assert [t.status for t in settle] == ["planned", "planned"]  # not pruned, though predicted close to the limit
    assert {(t.config.train.steps, t.config.train.warmup_steps) for t in settle} == {(flips.SETTLE_STEPS, 3)}
    assert yaml.safe_load(emitted.read_text())["name"] == "planted-settle"


def test_overlapping_step_times_are_in_doubt_and_a_clear_choice_stands(tmp_path, capsys):
    roomy = {"0": (20.0, 0.10), "1": (10.0, 0.105)}  # 5% apart: inside the step-time band
    result = group(planted(tmp_path, 40.0, roomy))
    assert [d["value"] for d in result["in_doubt"]] == ["0", "1"]
    assert all("tok/s/GPU" in d["why"] for d in result["in_doubt"])
    assert result["best"]["tok_interval"] == pytest.approx((TOKENS / (0.10 / (1 - TRACED.step_time)),
                                                            TOKENS / (0.10 / (1 + TRACED.step_time))))

    clear = planted(tmp_path / "clear", 40.0, {"0": (20.0, 0.10), "1": (10.0, 0.20)})
    assert group(clear)["in_doubt"] == []
    emitted = tmp_path / "none.yaml"
    assert main(["best", clear, "--predict", "--json", "--emit-sweep", str(emitted)]) == 0
    captured = capsys.readouterr()
    (line,) = captured.out.splitlines()
    assert json.loads(line)["in_doubt"] == [] and len(json.loads(line)["best"]["peak_interval_gib"]) == 2
    assert "nothing in doubt" in captured.err and not emitted.exists()
    assert main(["best", clear, "--emit-sweep", str(emitted)]) == 2  # only with --predict


def test_fields_that_vary_together_are_one_axis(tmp_path):
    """A bundle of strategy and tp_size: `--axis train.strategy,train.tp_size` compares its points in one group."""
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps({
        "name": "bundle", "model": {"preset": "tiny"}, "train": TRAIN,
        "resources": {"gpus_per_worker": 1, "workers": 2},
        "estimate": {"gpu": "H100 SXM", "device_memory_gib": 80, "margin_gib": 0}, "store": str(tmp_path / "store"),
        "axes": {"parallelism": [{"train.strategy": "tp", "train.tp_size": 2}, {"train.strategy": "fsdp2"}]}}))
    spec = load_sweep(path)
    for t, step_s in zip(plan(spec), (0.5, 0.4)):
        rehearsals.save_rehearsal(tmp_path / "store", t.config_id, {
            "method": "traced", "peak_gib": 10.0, "reserved_gib": 11.6, "step_time_s": step_s, "compute_s": step_s})
    (result,) = predicted_best(plan(spec, store_path=spec.store), axis="train.strategy,train.tp_size")
    assert [v["value"] for v in result["values"]] == ["tp/2", "fsdp2/-"]
    # tok/s per GPU: a TP pair shares its tokens, so fsdp2 at 0.4 s beats tp at 0.5 s by 2.5x, not 1.25x.
    assert result["best"]["value"] == "fsdp2/-"
    tok = {v["value"]: v["tok_per_s_per_device"] for v in result["values"]}
    assert tok["fsdp2/-"] / tok["tp/2"] == pytest.approx(2.5)
