"""Whether a trial's ranks ran alike (raybench/runtime/stragglers.py), from planted per-rank records through the
same reduction as a trial's (`rank_metrics.combine`, `trial_metrics`). A rank held back for real on the 2-node
SLURM: tests/integration/test_cluster_faults.py::test_the_preflight_names_a_throttled_node (-m slow)."""

from __future__ import annotations

import pytest

from raybench.runtime import rank_metrics, stragglers
from raybench.runtime.rank_metrics import TrialFacts
from raybench.spec.sweep_spec import TrainSpec

STEPS = 4


def _rank(host: str, data_s: float, optimizer_s: float) -> dict:
    """A rank's record: every step 1 s long (all ranks wait for the slowest), its local work as given."""
    return {"step_times_s": [1.0] * STEPS, "step_starts_wall": [100.0 + i for i in range(STEPS)],
            "tokens": [64] * STEPS, "nonpad_tokens": [64] * STEPS, "losses": [2.0] * STEPS, "node": host,
            "phase_times_s": {"data": [data_s] * STEPS, "forward": [0.3] * STEPS, "backward": [0.5] * STEPS,
                              "optimizer": [optimizer_s] * STEPS},
            "peaks": {"rss_gib": 1.0, "alloc_gib": None, "reserved_gib": None}}


def _metrics(ranks: list[dict]):
    facts = TrialFacts(train=TrainSpec(steps=STEPS, warmup_steps=1), world_size=len(ranks), dp_size=len(ranks),
                       params_total=10, params_trainable=10, flops_per_token=None, peak_tflops=None,
                       comm_exposed_p50_s=None, weights_cache=None, weights_copy_s=None, worker_wall_s=5.0,
                       process_trial_index=0)
    return rank_metrics.trial_metrics(rank_metrics.combine(ranks, tp_size=1, warmup_steps=1), facts)


def test_a_rank_with_much_more_local_work_is_a_straggler_named_with_its_host():
    m = _metrics([_rank("n1", 0.01, 0.09), _rank("n1", 0.01, 0.10), _rank("n2", 0.05, 0.35), _rank("n2", 0.01, 0.1)])
    assert m.step_time_p50_s_by_rank == [1.0] * 4  # alike: they cannot name it
    assert m.local_time_p50_s_by_rank == pytest.approx([0.10, 0.11, 0.40, 0.11])
    assert (m.slowest_rank, m.slowest_rank_node, m.straggler) == (2, "n2", True)
    assert m.straggler_why.startswith("rank 2 on n2: its data and optimizer work took 400.0 ms a step at the median, "
                                      "3.6x the other ranks' median 110.0 ms (29% of the step)")


def test_ranks_that_differ_by_little_or_by_a_sliver_of_the_step_are_not():
    alike = _metrics([_rank("n1", 0.01, 0.10), _rank("n2", 0.01, 0.12)])
    assert alike.straggler is False and alike.straggler_why is None and alike.slowest_rank == 1
    # Twice the median, but 2 ms of a 1 s step: a loader's jitter, not a straggler.
    sliver = _metrics([_rank("n1", 0.001, 0.001), _rank("n2", 0.002, 0.002), _rank("n3", 0.001, 0.001)])
    assert sliver.straggler is False


def test_a_single_rank_or_a_loop_without_phases_says_nothing():
    assert _metrics([_rank("n1", 0.01, 0.1)]).straggler is False
    no_phases = [{k: v for k, v in _rank(h, 0.01, 0.1).items() if k not in ("phase_times_s", "node")}
                 for h in ("a", "b")]
    m = _metrics(no_phases)  # a user's stack: its probe times steps only
    assert m.local_time_p50_s_by_rank is None and m.straggler is None and m.step_time_p50_s_by_rank == [1.0, 1.0]
    assert stragglers.columns(None, [None], 1.0)["slowest_rank"] is None
