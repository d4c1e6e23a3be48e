"""The probe a user's loop calls, and the reduction every trial's ranks go through (`rank_metrics.combine`)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from raybench.runtime import rank_metrics
from raybench.runtime.probe import RECORD_DIR_ENV, StepCounter, StepProbe
from raybench.runtime.rank_metrics import TrialFacts
from raybench.spec.sweep_spec import TrainSpec


def _record(starts, times, tokens, nonpad, losses, rss=1.0):
    return {"step_times_s": times, "step_starts_wall": starts, "tokens": tokens, "nonpad_tokens": nonpad,
            "losses": losses, "peaks": {"rss_gib": rss, "alloc_gib": None, "reserved_gib": None}}


def test_combine_takes_the_slowest_rank_per_step_and_the_real_window():
    # Rank 1 is slow in step 1, rank 0 in step 2: the window runs from the earliest timed start to the latest end.
    r0 = _record([100.0, 101.0, 102.0], [1.0, 1.0, 3.0], [64, 64, 64], [60, 50, 64], [2.0, 1.5, 1.0], rss=1.0)
    r1 = _record([100.0, 101.0, 103.5], [1.0, 2.5, 1.0], [64, 64, 64], [64, 64, 40], [2.2, 1.7, None], rss=3.0)
    reduced = rank_metrics.combine([r0, r1], tp_size=1, warmup_steps=1)
    assert reduced.step_times_s == [1.0, 2.5, 3.0]
    assert reduced.timed_window_s == pytest.approx(105.0 - 101.0)
    assert reduced.tokens == [128, 128, 128] and reduced.nonpad_tokens == [124, 114, 104]
    assert reduced.losses[:2] == pytest.approx([2.1, 1.6]) and reduced.losses[2] is None  # one rank did not know
    assert reduced.peak_rss_gib_by_rank == [1.0, 3.0] and reduced.phase_times_s == {}
    assert reduced.model_build_s is None and reduced.build_peak_rss_gib_by_rank is None

    facts = TrialFacts(train=TrainSpec(steps=3, warmup_steps=1), world_size=2, dp_size=2, params_total=10,
                       params_trainable=10, flops_per_token=None, peak_tflops=None, comm_exposed_p50_s=None,
                       weights_cache=None, weights_copy_s=None, worker_wall_s=9.0, process_trial_index=0)
    row = rank_metrics.trial_metrics(reduced, facts)
    assert row.tokens_per_step == 128 and row.steps_timed == 2
    assert row.tok_per_s == pytest.approx(256 / 4.0) and row.tok_per_s_per_device == pytest.approx(32.0)
    assert row.nonpad_tok_per_s == pytest.approx((114 + 104) / 4.0)
    assert row.loss_first == pytest.approx(2.1) and row.loss_final is None  # a loss the stack did not report
    assert row.phase_forward_p50_s is None and row.mfu is None and row.tflops_per_device is None


def test_combine_refuses_records_without_a_timed_step():
    r0 = _record([1.0], [1.0], [8], [8], [1.0])
    with pytest.raises(RuntimeError, match="no step was timed"):
        rank_metrics.combine([r0], tp_size=1, warmup_steps=1)


def test_probe_records_steps_and_writes_them_for_a_command_trial(tmp_path, monkeypatch):
    monkeypatch.setenv(RECORD_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    probe = StepProbe(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="before start"):
        probe.step(tokens=8)
    probe.start()
    for i in range(3):
        probe.step(tokens=16, nonpad_tokens=10 + i, loss=torch.tensor(2.0 - i))
    probe.step(tokens=16)  # no loss known, every token real
    record = probe.record
    assert record.tokens == [16] * 4 and record.nonpad_tokens == [10, 11, 12, 16]
    assert record.losses == [2.0, 1.0, 0.0, None]
    # Steps follow each other: each starts where the last ended (no gap is lost from the timed window).
    for (start, seconds), following in zip(zip(record.step_starts, record.step_times_s), record.step_starts[1:]):
        assert following >= start + seconds
    written = json.loads(probe.finish().read_text())
    assert written["rank"] == 1 and written["tokens"] == [16] * 4
    reduced = rank_metrics.combine([written], tp_size=1, warmup_steps=1)
    assert reduced.step_times_s == record.step_times_s and reduced.peak_rss_gib_by_rank[0] > 0


def test_probe_writes_nothing_outside_a_command_trial(monkeypatch):
    monkeypatch.delenv(RECORD_DIR_ENV, raising=False)
    probe = StepProbe(torch.device("cpu"))
    probe.start()
    probe.step(tokens=4)
    assert probe.finish() is None


def test_a_step_counter_adds_up_an_optimizer_steps_micro_batches():
    """The Trainer's and Lightning's way: each micro-batch's loss is its part of the step's; counts may be tensors."""
    probe = StepProbe(torch.device("cpu"))
    probe.start()
    counter = StepCounter()
    counter.add(8, torch.tensor(6))
    counter.add_loss(torch.tensor(0.5))
    counter.add(8, 4)
    counter.add_loss(torch.tensor(0.25))
    counter.end_step(probe)
    counter.end_step(probe)  # no micro-batch seen: recorded as it is, its loss not known
    record = probe.record
    assert record.tokens == [16, 0] and record.nonpad_tokens == [10, 0]
    assert record.losses == [0.75, None]


def test_a_token_weighted_step_counter_refuses_an_empty_step():
    """torchtune's and torchtitan's way: each loss added is a sum over its real tokens; the step's is their mean."""
    probe = StepProbe(torch.device("cpu"))
    probe.start()
    counter = StepCounter(loss_per_token=True, empty_step_error="no micro-batch counted")
    for nonpad, mean_loss in ((2, 1.0), (6, 3.0)):
        counter.add(8, torch.tensor(nonpad))
        counter.add_loss(torch.tensor(mean_loss) * counter.last_nonpad_tokens)
    counter.end_step(probe)
    assert probe.record.nonpad_tokens == [8] and probe.record.losses == [2.5]  # (1 x 2 + 3 x 6) / 8
    with pytest.raises(RuntimeError, match="no micro-batch counted"):
        counter.end_step(probe)


def test_a_nan_loss_stays_nan_and_not_known_stays_null():
    """A nan loss is a finding (the trial's row is then an error), not a loss the stack did not report."""
    r0 = _record([100.0, 101.0], [1.0, 1.0], [64, 64], [64, 64], [2.0, math.nan])
    reduced = rank_metrics.combine([r0], tp_size=1, warmup_steps=1)
    facts = TrialFacts(train=TrainSpec(steps=2, warmup_steps=1), world_size=1, dp_size=1, params_total=10,
                       params_trainable=10, flops_per_token=None, peak_tflops=None, comm_exposed_p50_s=None,
                       weights_cache=None, weights_copy_s=None, worker_wall_s=9.0, process_trial_index=0)
    row = rank_metrics.trial_metrics(reduced, facts)
    assert row.loss_by_step[0] == 2.0 and math.isnan(row.loss_by_step[1]) and math.isnan(row.loss_final)
    unknown = rank_metrics.combine([_record([100.0, 101.0], [1.0, 1.0], [64, 64], [64, 64], [None, None])],
                                   tp_size=1, warmup_steps=1)
    assert rank_metrics.trial_metrics(unknown, facts).loss_by_step is None


@pytest.mark.parametrize("labels, unlabelled, message", [
    ([[5, 0, 7], [3, 0, 2]], [[0, 1, 0], [0, 1, 0]], "step 1: the global batch holds no label tokens"),
    ([[5, 4, 7], [3, 0, 2]], [[0, 0, 0], [0, 1, 0]], "step 1: 1 micro-batch(es) of rank 1 hold no label tokens"),
])
def test_a_batch_without_label_tokens_fails_the_trial_naming_the_cause(labels, unlabelled, message):
    """raybench's loop counts each step's label tokens: a step whose global batch has none, or a micro-batch with
    none (its mean loss is nan), fails the trial on every rank with the step, the rank and the cause."""
    ranks = [{**_record([100.0, 101.0, 102.0], [1.0] * 3, [64] * 3, [64] * 3, [2.0, math.nan, 1.0]),
              "label_tokens": counts, "unlabelled_micro_batches": empty} for counts, empty in zip(labels, unlabelled)]
    with pytest.raises(ValueError, match="data.overflow") as err:
        rank_metrics.combine(ranks, tp_size=1, warmup_steps=1)
    assert message in str(err.value)
    fine = [{**rank, "label_tokens": [1, 1, 1], "unlabelled_micro_batches": [0, 0, 0]} for rank in ranks]
    assert rank_metrics.combine(fine, tp_size=1, warmup_steps=1).losses[0] == 2.0
