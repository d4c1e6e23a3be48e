"""The pre-flight on a real local Ray: every node's device measured in a Ray task pinned to it, and a cluster
whose CPUs trials hold said busy rather than waited on (the 2-node SLURM case, a node held back for real:
test_cluster_faults.py::test_the_preflight_names_a_throttled_node, -m slow)."""

from __future__ import annotations

import os
import time

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


def test_a_links_ranks_meet_and_measure_one_all_reduce():
    """The link measurement's own path (Ray actors pinned to their nodes, a rendezvous on the first one's address,
    gloo): here a "pair" of this one node with itself, two ranks on its two CPUs. The rounds of a real cluster's
    links: tests/unit/test_preflight.py."""
    from raybench.drivers import nodes, preflight_links

    with ray_cluster(None):
        (node,) = nodes.current()
        (row,) = preflight_links.measure([[(node, node)]], preflight._get)
        assert row["link"] == preflight_links.PAIR and row["link_ranks"] == 2 and row["link_error"] is None, row
        assert row["busbw_gb_per_s"] > 0
        import ray

        deadline = time.monotonic() + 60  # the ranks' actors are killed, their CPUs given back (asynchronously)
        while ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]
