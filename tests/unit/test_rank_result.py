"""What rank 0 returns (`RankResult`): built in one place (`rank_metrics.rank_result`), plain data only at a process
boundary (torchrun's result file), and made the row by `build_row`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.runtime import fingerprint, rank_metrics
from raybench.runtime.rank_metrics import TrialFacts
from raybench.spec.load import parse_sweep
from raybench.spec.schema import RankResult, TrialMetrics
from raybench.spec.sweep_spec import TrainSpec

ENV = {"NCCL_DEBUG": "WARN", "TORCH_FAKE_API_KEY": "secret", "HOME": "/root"}


def _record(starts, times, losses):
    return {"step_times_s": times, "step_starts_wall": starts, "tokens": [64] * len(times),
            "nonpad_tokens": [60] * len(times), "losses": losses,
            "peaks": {"rss_gib": 1.5, "alloc_gib": None, "reserved_gib": None}}


def _result() -> RankResult:
    ranks = [_record([100.0, 101.0, 102.0], [1.0, 1.0, 1.5], [2.0, 1.5, None]),
             _record([100.0, 101.0, 102.5], [1.0, 1.25, 1.0], [2.5, 1.25, 1.0])]
    reduced = rank_metrics.combine(ranks, tp_size=1, warmup_steps=1)
    facts = TrialFacts(train=TrainSpec(steps=3, warmup_steps=1), world_size=2, dp_size=2, params_total=10,
                       params_trainable=10, flops_per_token=None, peak_tflops=None, comm_exposed_p50_s=None,
                       weights_cache=None, weights_copy_s=None, worker_wall_s=9.0, process_trial_index=0)
    provenance = {"device_type": "cpu", "gpu_name": None, "hostnames": ["a", "b"], "cpu_count": 8,
                  "allreduce_busbw_json": None, "torch_version": "2.13.0"}
    return rank_metrics.rank_result(reduced, facts, provenance, env=ENV, stack_version="trl 1.16",
                                    data_taken="samples")


def test_the_result_round_trips_through_plain_data_exactly():
    result = _result()
    back = RankResult.from_dict(json.loads(json.dumps(result.to_dict())))  # torchrun's result file
    assert back == result and isinstance(back.metrics, TrialMetrics)


def test_the_result_holds_typed_fields_and_null_compile_columns_by_default():
    result = _result()
    assert result.env == {"NCCL_DEBUG": "WARN"}  # allow-listed, secrets dropped
    assert result.system == fingerprint.system_label() and result.stack_version == "trl 1.16"
    assert result.data_taken == "samples" and "system" not in result.provenance and "env" not in result.provenance
    assert result.metrics.compile_graphs is None and result.metrics.compile_graph_break_reasons_json is None
    assert result.metrics.loss_by_step == [pytest.approx(2.25), pytest.approx(1.375), None]  # a rank had none


def test_build_row_makes_the_typed_result_the_row():
    (trial,) = plan(parse_sweep({"name": "typed", "model": {"preset": "tiny"}, "resources": {"workers": 2}}))
    result = _result()
    row = build_row(trial.payload, "typed", "ok", "", result)
    assert row["tok_per_s"] == result.metrics.tok_per_s and row["hostnames"] == ["a", "b"]
    assert json.loads(row["env_json"]) == {"NCCL_DEBUG": "WARN"} and row["system"] == result.system
    assert row["stack_version"] == "trl 1.16" and row["compile_graphs"] is None
    misspelled = dataclasses.replace(result, provenance={**result.provenance, "gpu_nmae": "H100"})
    with pytest.raises(ValueError, match="gpu_nmae"):  # a column outside the schema fails loudly
        build_row(trial.payload, "typed", "ok", "", misspelled)
    failed = build_row(trial.payload, "typed", "error", "boom")
    assert failed["env_json"] is None and failed["system"] == fingerprint.system_label() and "tok_per_s" not in failed


def test_a_trial_with_a_nan_loss_is_an_error_row_saying_so(tmp_path):
    """No nan loss ever ends as ok: the row keeps what was measured, with status error and the step."""
    import math

    import pyarrow.parquet as pq

    from raybench.drivers.trial import run_trial

    (trial,) = plan(parse_sweep({"name": "nan", "model": {"preset": "tiny"}, "resources": {"workers": 2}}))
    ranks = [_record([100.0, 101.0, 102.0], [1.0, 1.0, 1.5], [2.0, math.nan, 1.0]),
             _record([100.0, 101.0, 102.5], [1.0, 1.25, 1.0], [2.5, 1.25, 1.0])]
    facts = TrialFacts(train=TrainSpec(steps=3, warmup_steps=1), world_size=2, dp_size=2, params_total=10,
                       params_trainable=10, flops_per_token=None, peak_tflops=None, comm_exposed_p50_s=None,
                       weights_cache=None, weights_copy_s=None, worker_wall_s=9.0, process_trial_index=0)
    diverged = rank_metrics.rank_result(rank_metrics.combine(ranks, tp_size=1, warmup_steps=1), facts,
                                        {"device_type": "cpu"})
    row = run_trial(trial.payload, "nan", str(tmp_path), "torchrun", lambda payload: diverged)
    assert row["status"] == "error" and "the loss is nan at step 1 (1 of 3 steps not finite)" in row["message"]
    assert row["tok_per_s"] == diverged.metrics.tok_per_s  # what was measured is kept
    stored = pq.read_table(next(tmp_path.rglob("*.parquet"))).to_pylist()  # read back by pyarrow itself
    assert [r["status"] for r in stored] == ["error"] and math.isnan(stored[0]["loss_by_step"][1])
    fine = run_trial(trial.payload, "nan", str(tmp_path), "torchrun", lambda payload: _result())
    assert fine["status"] == "ok"  # a loss the stack did not report (None) is no finding


def test_the_summary_line_says_what_overflow_cut_above_one_percent_of_labels():
    from raybench.drivers.trial import summary

    row = {"trial_id": "t1", "status": "ok", "axis_values_json": '{"train.seq_len": 256}', "step_time_p50_s": 0.5,
           "tok_per_s_per_device": 1000.0, "data_overflow": None, "samples_cut": 27, "label_tokens_cut_frac": 0.166}
    assert summary(row).endswith("[data.overflow truncate cut 27 samples, 16.6% of label tokens]")
    assert "cut" not in summary({**row, "label_tokens_cut_frac": 0.01})
    assert "cut" not in summary({**row, "label_tokens_cut_frac": None})
