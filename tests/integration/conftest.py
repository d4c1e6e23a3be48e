"""One embedded Ray per test process for the files whose runs can share it: Ray's start and shutdown take about
9 s on 2 cores, paid once per pytest worker instead of once per file. test_pool.py keeps a Ray of its own: it
counts the pool's actors and groups, which another file's warm pool would add to."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def shared_ray():
    """A private local Ray (raybench's embedded one) held for the rest of this test process; runs inside it
    connect to it instead of starting their own (drivers.ray_cluster: an initialized Ray is used as it is)."""
    from raybench.drivers.ray_cluster import ray_cluster

    with ray_cluster(None):
        yield
