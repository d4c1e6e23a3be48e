"""A collective call as NCCL 2.30's tuning model prices it: each algorithm's latency and bandwidth, the one it picks."""

from __future__ import annotations

import pytest

from raybench.rehearse import nccl, step_time, trace

MB = 1e6


def test_one_node_runs_every_collective_on_a_ring():
    """Inside one NVLink node a tree's hops cost more (4.0 us against 3.4) and it reaches half the algorithm
    bandwidth: NCCL's model picks the ring at every size."""
    for nbytes in (1e3, 1e5, 25 * MB, 1e9):
        call = nccl.call("allreduce_", nbytes, 8, 1, 450.0)
        assert call.algorithm == "ring"
        assert call.latency_s == pytest.approx((8.4 + 14 * 3.4) * 1e-6)
        assert call.seconds == pytest.approx(call.latency_s + nbytes * 2 * 7 / 8 / 450e9)
    gather = nccl.call("all_gather_into_tensor", 25 * MB, 8, 1, 450.0)
    assert (gather.algorithm, gather.latency_s) == ("ring", pytest.approx((8.4 + 7 * 3.4) * 1e-6))
    assert nccl.call("allreduce_", 25 * MB, 1, 1, 450.0) == nccl.Call(0.0, 0.0, "none")


def test_ddp_buckets_across_eight_nodes_run_on_trees():
    """64 ranks on 8 nodes, a 25 MB bucket: the ring's 126 steps (14 across nodes, at 14 us, the whole x1.4 for
    the ring's plateau) against the tree's chain of 7 NVLink hops and log2(8) = 3 network hops, up and down, at
    0.92 x half the bus bandwidth x NCCL's medium-size correction (0.7 at 16-32 MB)."""
    ring = nccl.ring_call("allreduce_", 25 * MB, 64, 8, 400.0)
    tree = nccl.tree_all_reduce(25 * MB, 64, 8, 400.0)
    assert ring.latency_s == pytest.approx((8.4 + 112 * 3.4 + 14 * 14.0) * 1.4e-6)
    assert tree.latency_s == pytest.approx((8.4 + 2 * (7 * 4.0 + 3 * 14.0)) * 1e-6)
    assert tree.seconds == pytest.approx(tree.latency_s + 25 * MB / (400e9 * 0.92 * 0.5 * 0.7))
    assert nccl.call("allreduce_", 25 * MB, 64, 8, 400.0) == tree
    assert tree.seconds < ring.seconds / 2
    # Gathers and scatters have no tree: rings, 63 steps of which 7 cross nodes, no plateau.
    assert nccl.call("reduce_scatter_tensor", 25 * MB, 64, 8, 400.0).latency_s == pytest.approx(
        (8.4 + 56 * 3.4 + 7 * 14.0) * 1e-6)


def test_the_ring_plateau_starts_at_64_bytes_a_channel_a_rank():
    below, above = 64 * 32 * 16 - 1, 64 * 32 * 16
    base_us = 8.4 + 28 * 3.4 + 2 * 14.0  # 16 ranks on 2 nodes
    assert nccl.ring_call("allreduce_", below, 16, 2, 400.0).latency_s == pytest.approx(base_us * 1e-6)
    assert nccl.ring_call("allreduce_", above, 16, 2, 400.0).latency_s == pytest.approx(base_us * 1.4e-6)


def test_the_step_reports_the_algorithm_each_collective_runs_with():
    """A DDP step on 64 ranks: its bucket all-reduces priced as trees on 8-GPU nodes, as rings inside one
    64-GPU NVLink domain (a GB200 NVL72 rack)."""
    step = trace.StepTrace(memory_gib={}, resident_gib={}, comm_bytes={"allreduce_": 40 * 25 * MB},
                           comm_calls={"allreduce_": 40}, overlapped_comm=("allreduce_",), flops=0, roofline_s=1.0,
                           compute_s=1.0, memory_s=0.0)
    nodes = step_time.predict_step_time(step, 64, 400.0, "set", efficiency=1.0, layout=step_time.Layout(8, 8))
    rack = step_time.predict_step_time(step, 64, 400.0, "set", efficiency=1.0, layout=step_time.Layout(72, 72))
    assert nodes.comm_algorithms == {"allreduce_": "tree"} and rack.comm_algorithms == {"allreduce_": "ring"}
    assert nodes.comm_s == pytest.approx(40 * nccl.tree_all_reduce(25 * MB, 64, 8, 400.0).seconds)
    assert nodes.comm_latency_s == pytest.approx(40 * nccl.tree_all_reduce(25 * MB, 64, 8, 400.0).latency_s)
    bytes_only = step_time.predict_step_time(step, 64, 400.0, "set", efficiency=1.0)
    assert bytes_only.comm_s == pytest.approx(1e9 * 2 * 63 / 64 / 400e9) and bytes_only.comm_algorithms is None
