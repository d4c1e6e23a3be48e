"""`raybench rehearse` for steps of several micro-batches (train.grad_accum): the trace runs one micro-batch of
each kind the step has (the first, a middle one, the last) and counts the middle one for all of them. What a
rank holds is checked against real gloo ranks in tests/integration/test_rehearse_real_ranks.py (its *-accum cases)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raybench.rehearse import fake_world, rehearsal, trace
from raybench.runtime.strategies import RankContext
from raybench.spec.schema import GIB
from rehearse_cases import tiny_trial

GPU = "H100 SXM"
CASES = {"fsdp2": (2, {"strategy": "fsdp2"}), "ddp": (2, {"strategy": "ddp"}),
         "tp": (2, {"strategy": "tp", "tp_size": 2}), "tp_fsdp2": (4, {"strategy": "tp_fsdp2", "tp_size": 2})}


def traced(case: str, grad_accum: int, every_micro_batch: bool = False, **train) -> trace.StepTrace:
    world, strategy = CASES[case]
    trial = tiny_trial(world, gpus=1, grad_accum=grad_accum, **strategy, **train)
    fake_world.init_fake_world(0, world)
    try:
        ctx = RankContext(0, world, 0, torch.device("cpu"))
        kwargs = {"every_micro_batch": True} if every_micro_batch else {}
        return trace.trace_step(trial.config, trial.shape, ctx, fake=True, gpu=GPU, **kwargs)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES)
def test_an_accumulating_step_is_traced_under_every_traced_strategy(case):
    """grad_accum > 1 used to stop torch's trackers at the second micro-batch's forward ("does not support
    memory tracking for multiple iterative calls"), and the trial fell back to the analytic estimate."""
    world, strategy = CASES[case]
    trial = tiny_trial(world, gpus=1, grad_accum=4, **strategy)
    rehearsed = rehearsal.rehearse(trial.config, trial.shape, GPU, analytic=trial.assessment.analytic)
    assert rehearsed.method == "traced", rehearsed.notes
    assert rehearsed.step_time_s > 0 and rehearsed.grad_accum == 4


@pytest.mark.parametrize("case", ["fsdp2", "ddp"])
def test_the_counted_middle_micro_batch_is_every_middle_micro_batch(case):
    """Tracing every micro-batch of a 5-micro-batch step gives what tracing the first, one middle and the last
    and counting the middle one 3 times gives: the same memory, operators and collectives."""
    scaled, whole = traced(case, 5), traced(case, 5, every_micro_batch=True)
    assert (scaled.traced_micro_batches, whole.traced_micro_batches) == (3, 5)
    assert scaled.memory_gib == whole.memory_gib
    assert scaled.comm_bytes == whole.comm_bytes and scaled.comm_calls == whole.comm_calls
    for name in ("flops", "roofline_s", "compute_s", "memory_s", "block_memory_bound_s", "optimizer_roofline_s"):
        assert getattr(scaled, name) == pytest.approx(getattr(whole, name), rel=1e-9), name


@pytest.mark.parametrize("case", ["fsdp2", "ddp"])
def test_time_and_collectives_scale_with_the_micro_batches_and_the_optimizer_runs_once(case):
    one, four = traced(case, 1, seq_len=256), traced(case, 4, seq_len=256)
    assert four.optimizer_roofline_s == pytest.approx(one.optimizer_roofline_s, rel=1e-6)
    assert 0 < one.optimizer_roofline_s < one.roofline_s
    # Within a few % of 4 micro-batches of one: each micro-batch also adds its gradients to the accumulated
    # ones, and the gradients are reduced once per step, not once per micro-batch (this tiny model's 512 tokens
    # per micro-batch make both show: ~+2% under FSDP2, ~-3% under DDP).
    assert four.roofline_s - four.optimizer_roofline_s == pytest.approx(
        4 * (one.roofline_s - one.optimizer_roofline_s), rel=0.05)
    assert four.flops == pytest.approx(4 * one.flops, rel=1e-6)  # matmuls and attention: no FLOPs in the rest
    if case == "fsdp2":
        # Every micro-batch all-gathers the weights (forward and backward); only the last reduce-scatters.
        assert four.comm_bytes["allgather_base"] == 4 * one.comm_bytes["allgather_base"]
        assert four.comm_bytes["reduce_scatter_base"] == one.comm_bytes["reduce_scatter_base"]
    else:  # DDP all-reduces the buckets once, in the last micro-batch's backward
        assert four.comm_bytes["allreduce"] == one.comm_bytes["allreduce"]


@pytest.mark.parametrize("case", ["fsdp2", "ddp"])
def test_accumulated_gradients_are_held_across_micro_batches(case):
    """The rank holds the same parameters and optimizer state, and one micro-batch's activations at a time; its
    peak (the end of a forward, at this size) holds beyond one micro-batch's step the gradients accumulated so
    far: under FSDP2 without gradient sync, the whole unsharded gradients in the reduce dtype (fp32), not this
    rank's shard of them; under DDP, the gradients beside the reducer's bucket copy of them."""
    world, strategy = CASES[case]
    one, four = traced(case, 1), traced(case, 4)
    assert four.resident_gib == one.resident_gib
    for category in ("parameters", "optimizer_state", "activations", "temporaries"):
        assert four.memory_gib[category] == one.memory_gib[category], category
    fp32_grads_gib = 4 * tiny_trial(world, **strategy).assessment.analytic.params_trainable / GIB
    assert four.memory_gib["gradients"] - one.memory_gib["gradients"] == pytest.approx(fp32_grads_gib, rel=1e-3)
    if case == "fsdp2":  # one micro-batch holds no more than this rank's shard of them
        assert one.memory_gib["gradients"] <= fp32_grads_gib / world
