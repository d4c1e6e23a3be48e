"""The step's costs (`rehearse.step_costs`), fed operators by hand: the timeline of compute and collectives, and
the step's total over the traced parts. The traces themselves are checked in test_rehearse*.py."""

from __future__ import annotations

import pytest
import torch

from raybench.rehearse.roofline import gpu_roofline
from raybench.rehearse.step_costs import StepCosts

MM = torch.ops.aten.mm.default
GATHER = torch.ops.c10d._allgather_base_.default  # FSDP2's all-gather: issued ahead of the compute that reads it


def matmul(costs: StepCosts, a: torch.Tensor, b: torch.Tensor, backward: bool = False) -> torch.Tensor:
    out = a @ b
    costs.count(costs.parts[-1], MM, (a, b), {}, out, backward, modules=())
    return out


def test_compute_merges_until_an_operator_reads_a_gathered_tensor():
    costs = StepCosts(gpu_roofline("H100 SXM"))
    a, b = torch.ones(64, 64), torch.ones(64, 64)
    matmul(costs, a, b)
    matmul(costs, a, b)  # waits for nothing: the same compute event
    gathered = torch.empty(128, 64)
    costs.count(costs.parts[-1], GATHER, (gathered, a), {}, gathered, False, modules=())
    matmul(costs, gathered, b)  # the first to read the gathered weight: waits for collective 0
    matmul(costs, gathered, b)  # read already: waits for nothing, and merges with the one before
    matmul(costs, a, b, backward=True)  # another pass: an event of its own
    events = costs.parts[-1].events
    assert [e[0] for e in events] == ["compute", "comm", "compute", "compute"]
    assert events[1][1:] == ["allgather_base", 128 * 64 * 4, "gather"]
    assert [e[2:] for e in (events[0], events[2], events[3])] == [[-1, False], [0, False], [-1, True]]
    assert events[0][1] > 0 and events[2][1] > events[0][1]  # twice the rows
    assert costs.overlapped_names == {"allgather_base"}


def test_the_step_counts_each_traced_micro_batch_as_often_as_it_runs_and_the_optimizer_once():
    costs = StepCosts(gpu_roofline("H100 SXM"))
    a = torch.ones(32, 32)
    for _ in range(3):  # the first, a middle and the last micro-batch
        matmul(costs, a, a)
        costs.next_part()
    matmul(costs, a, a)  # the optimizer step
    total = costs.step_total([1, 5, 1])
    one = costs.parts[0]
    assert total.flops == (1 + 5 + 1 + 1) * one.flops == 8 * 2 * 32**3
    assert total.op_s["mm"] == pytest.approx(8 * one.op_s["mm"]) and total.launches == 8
    assert total.roofline_s == pytest.approx(8 * one.roofline_s)
