"""The pre-flight on a real local Ray: every node's device measured in a Ray task pinned to it, and a cluster
whose CPUs trials hold said busy rather than waited on (the 2-node SLURM case, a node held back for real:
test_cluster_faults.py::test_the_preflight_names_a_throttled_node, -m slow)."""

from __future__ import annotations

import os

import pytest

from raybench.drivers import preflight
from raybench.drivers.ray_cluster import ray_cluster

pytestmark = pytest.mark.integration


def test_every_node_is_measured_and_a_busy_cluster_is_said_busy(monkeypatch):
    import ray

    with ray_cluster(None):
        (row,) = preflight.check("local", None)
        assert row["device"] == "cpu" and row["device_index"] is None and row["torch_threads"] == 1
        assert row["matmul_tflops"] > 0 and row["memory_gb_per_s"] > 0 and row["slow"] is False
        assert row["node"] == ray.nodes()[0]["NodeManagerAddress"]  # no SLURM label: Ray's node name

        holder = ray.remote(num_cpus=os.cpu_count())(type("Holder", (), {"ping": lambda self: 1})).remote()
        ray.get(holder.ping.remote())  # every CPU taken, as a warm pool's actors take theirs
        monkeypatch.setattr(preflight, "BUSY_TIMEOUT_S", 3.0)
        with pytest.raises(preflight.ClusterBusy, match="held by trials"):
            preflight.check("local", None)
        ray.kill(holder)
